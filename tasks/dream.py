"""One user's dream run: lock, ledger row, prune, contradictions, summarize, record.

:func:`dream_user` is what the Celery task and ``reverie run`` call. Each step commits
on its own (the model calls of summarization run outside any transaction); the ledger
row records counts, cost, status and, for a failed run, the reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

from store import locks, runs, schedule
from store import policies as policy_store
from store import spend as spend_store
from store.db import session_scope
from store.runs import RunCounts
from store.spend import BudgetLine
from store.types import nano_to_usd, now, usd_to_nano
from tasks.contradictions import detect
from tasks.prune import prune_user
from tasks.summarize import SummaryCounts, summarize_user
from worker import budget, metrics
from worker.errors import PermanentError, UserBusy
from worker.logs import get_logger, user_ref
from worker.policy import PolicyBook, book
from worker.settings import Settings

log = get_logger(__name__)


@dataclass
class RunOutcome:
    """What a dream run did (``status``: succeeded, failed or skipped)."""

    user_id: str
    status: str
    run_id: int | None = None
    entries_pruned: int = 0
    contradictions_found: int = 0
    contradictions_resolved: int = 0
    entries_summarized: int = 0
    entries_written: int = 0
    groups_deferred: int = 0
    cost_usd: float = 0.0
    error: str | None = None

    def counts(self) -> RunCounts:
        return RunCounts(
            entries_pruned=self.entries_pruned,
            contradictions_found=self.contradictions_found,
            contradictions_resolved=self.contradictions_resolved,
            entries_summarized=self.entries_summarized,
            entries_written=self.entries_written,
            groups_deferred=self.groups_deferred,
        )


def lease_ttl(settings: Settings) -> timedelta:
    # Long enough for a model call to time out between renewals, short enough that a
    # crashed worker's user is picked up again within the hour.
    return timedelta(seconds=max(600.0, 4 * settings.llm_timeout_seconds))


def dream_user(settings: Settings, user_id: str, *, trigger: str = "manual", agent_id: str | None = None) -> RunOutcome:
    """Dream for one user (or, with ``agent_id``, for one agent's entries of that user,
    all of them if that agent's policy has ``crossAgentMaintenance``).

    Returns a ``skipped`` outcome when another run holds the user's lease. Raises only
    for errors that are not the run's own (the ledger then says ``failed`` too).
    """
    token = str(uuid.uuid4())
    ttl = lease_ttl(settings)
    at = now()
    with session_scope(settings) as session:
        if not locks.acquire(session, user_id, token, ttl):
            log.info("dream_skipped_busy", user=user_ref(user_id, settings.log_hash_key))
            return RunOutcome(
                user_id=user_id, status="skipped", error=str(UserBusy(user_ref(user_id, settings.log_hash_key)))
            )
        policies = book(settings, policy_store.all_configs(session))
        scope = "user" if agent_id is None else f"agent:{agent_id}"[:32]
        run_id = runs.start_run(session, user_id, scope=scope, trigger=trigger)
        # The run's total budget: the largest maxCostPerRun among its policies (each
        # agent's own cap is a line of its own, see worker.budget).
        caps = [policies.default.maxCostPerRun, *(p.maxCostPerRun for p in policies.agents.values())]
        spend_store.ensure_lines(session, [BudgetLine("run", budget.run_key(run_id), usd_to_nano(max(caps)))])
    started = time.monotonic()
    outcome = RunOutcome(user_id=user_id, status="running", run_id=run_id)
    try:
        _run(settings, user_id, token=token, ttl=ttl, at=at, policies=policies, agent_id=agent_id, outcome=outcome)
    finally:
        with session_scope(settings) as session:
            locks.release(session, user_id, token)
        metrics.DURATION.observe(time.monotonic() - started)
    return outcome


def _run(
    settings: Settings,
    user_id: str,
    *,
    token: str,
    ttl: timedelta,
    at: datetime,
    policies: PolicyBook,
    agent_id: str | None,
    outcome: RunOutcome,
) -> None:
    run_id = outcome.run_id
    assert run_id is not None
    owners = _owners(policies, agent_id)

    def keep_alive() -> None:
        with session_scope(settings) as s:
            locks.renew(s, user_id, token, ttl)

    try:
        # Pruning and contradictions are set-based and quick: one transaction.
        with session_scope(settings) as session:
            outcome.entries_pruned = prune_user(
                session, settings, user_id, book=policies, owners=owners, at=at, run_id=run_id
            )
            found = detect(session, settings, user_id, book=policies, owners=owners, at=at, run_id=run_id)
        outcome.contradictions_found = found.found
        outcome.contradictions_resolved = found.resolved
        if any(p.summarizes for p in (policies.default, *policies.agents.values())):
            summary: SummaryCounts = summarize_user(
                settings, user_id, book=policies, owners=owners, run_id=run_id, keep_alive=keep_alive
            )
            outcome.entries_summarized = summary.summarized
            outcome.entries_written = summary.written
            outcome.groups_deferred = summary.deferred
        outcome.status = "succeeded"
    except PermanentError as exc:
        outcome.status = "failed"
        outcome.error = str(exc)
    except Exception as exc:
        outcome.status = "failed"
        outcome.error = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        _finish(settings, user_id, run_id, at, outcome)
        raise
    _finish(settings, user_id, run_id, at, outcome)


def _owners(policies: PolicyBook, agent_id: str | None) -> Collection[str] | None:
    if agent_id is None or policies.for_agent(agent_id).crossAgentMaintenance:
        return None
    return (agent_id,)


def _finish(settings: Settings, user_id: str, run_id: int, started: datetime, outcome: RunOutcome) -> None:
    with session_scope(settings) as session:
        cost_nano = spend_store.spent_nano(session, "run", budget.run_key(run_id))
        outcome.cost_usd = nano_to_usd(cost_nano)
        runs.finish_run(
            session, run_id, status=outcome.status, counts=outcome.counts(), cost_nano=cost_nano, error=outcome.error
        )
        schedule.mark_dreamed(session, user_id, started, now() + timedelta(hours=settings.dream_interval_hours))
        if outcome.groups_deferred:
            # Work left over (budget, transient errors) is carried to the next pass.
            schedule.mark_dirty(session, user_id)
    if outcome.status == "failed":
        metrics.CYCLES_FAILED.inc()
        log.warning("dream_failed", user=user_ref(user_id, settings.log_hash_key), run_id=run_id, error=outcome.error)
    else:
        metrics.USERS_PROCESSED.inc()
        metrics.ENTRIES_PRUNED.inc(outcome.entries_pruned)
        metrics.CONTRADICTIONS_FOUND.inc(outcome.contradictions_found)
        metrics.ENTRIES_SUMMARIZED.inc(outcome.entries_summarized)
        log.info(
            "dream_finished",
            user=user_ref(user_id, settings.log_hash_key),
            run_id=run_id,
            pruned=outcome.entries_pruned,
            contradictions=outcome.contradictions_found,
            summarized=outcome.entries_summarized,
            deferred=outcome.groups_deferred,
            cost_usd=outcome.cost_usd,
        )
