"""Dream runs: lock, ledger row, prune, contradictions, summarize, record.

:func:`dream_user` is one user's run (``dream.run_user``, on demand);
:func:`dream_users` runs a chunk of users with set-based statements
(``dream.run_users`` from the dispatcher, and ``reverie run``). Each step commits on its
own (the model calls of summarization run outside any transaction); the ledger row of
each run records counts, cost, status and, for a failed run, the reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from store import locks, runs, schedule
from store import policies as policy_store
from store import spend as spend_store
from store.db import closing_transaction, committing, get_engine, session_scope
from store.memories import table_for
from store.runs import RunCounts
from store.spend import BudgetLine
from store.types import db_now, nano_to_usd, usd_to_nano
from tasks import profiles
from tasks.contradictions import ContradictionCounts, detect, detect_many
from tasks.leases import LeaseKeeper
from tasks.profile_writer import ProfileWriter
from tasks.prune import prune_user, prune_users
from tasks.summarize import SummaryCounts, summarize_user
from worker import budget, metrics
from worker.errors import (
    DatabaseUnavailable,
    Interrupted,
    LeaseLost,
    PermanentError,
    ReverieError,
    TransientError,
    UserBusy,
    describe,
)
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
    #: Deferred work worth another try at the next pass (see ``SummaryCounts.retry_soon``;
    #: or profiles a transient error kept from being rebuilt).
    retry_soon: bool = False
    #: Deferred work the day's budget could not pay for: dreamed again once the day's
    #: budgets are new (``SummaryCounts.retry_next_day``), if not scheduled before.
    retry_next_day: bool = False
    cost_usd: float = 0.0
    error: str | None = None
    # Profiles written for the user by this run (0: their memory had not changed).
    profiles_built: int = 0

    @property
    def changed_memory(self) -> bool:
        """Whether the run's own committed work changed the user's rows."""
        return bool(
            self.entries_pruned
            or self.contradictions_found
            or self.contradictions_resolved
            or self.entries_summarized
            or self.entries_written
        )

    def counts(self) -> RunCounts:
        return RunCounts(
            entries_pruned=self.entries_pruned,
            contradictions_found=self.contradictions_found,
            contradictions_resolved=self.contradictions_resolved,
            entries_summarized=self.entries_summarized,
            entries_written=self.entries_written,
            groups_deferred=self.groups_deferred,
        )


#: What the ledger says of a run whose summarizing the pass's time left to the next pass.
CARRIED = "summarizing carried to the next pass: the pass's time for model work was up"

#: A skipped run's reason for a user with no entries and no schedule (erased since a
#: message named them, or never known): nothing is made for them.
UNKNOWN_USER = "no entries and no schedule (erased, or not known yet): nothing to dream"


#: A worker's dream task is interrupted (soft) and then killed (hard) after this long:
#: the longest a worker's run holds its users' leases, renewing them.
DREAM_SOFT_TIME_LIMIT_SECONDS = 1500
DREAM_TIME_LIMIT_SECONDS = 1800


def longest_hold(settings: Settings) -> float:
    """The longest a healthy dream holds a user's lease (renewing it): a worker's task
    until its hard time limit, a cron pass until its time limit, each plus one lease for
    the work under way then to end."""
    return max(DREAM_TIME_LIMIT_SECONDS, settings.cron_time_limit_seconds) + lease_ttl(settings).total_seconds()


@dataclass(frozen=True)
class ModelTime:
    """When a chunk's model work stops: after ``deadline`` (``time.monotonic()``; None:
    no budget of time), or once one of ``interrupts`` (the task's soft time limit) fired."""

    deadline: float | None = None
    interrupts: tuple[type[BaseException], ...] = ()


def lease_ttl(settings: Settings) -> timedelta:
    if settings.dream_lease_seconds is not None:
        return timedelta(seconds=settings.dream_lease_seconds)
    # Long enough for a model call to time out between renewals, short enough that a
    # crashed worker's user is picked up again within the hour.
    return timedelta(seconds=max(600.0, 4 * settings.llm_timeout_seconds))


def rebuild_profiles(settings: Settings, user_ids: Sequence[str]) -> tuple[int, list[str]]:
    """Rebuild now, outside a dream, the profiles of users whose memory was just changed
    (a restore); returns the profiles built and the users left to their next dream.

    As a dream does: the users' leases are taken first (a transaction of their own), the
    profiles are read and written in one transaction that re-takes the leases last, and
    the leases are given back. An erasure waits for the lease and then removes what was
    written; a user erased first is not brought back; and the locks come in a dream's
    order (profile rows, then the leases' rows), so the two never wait on each other in
    a cycle. A user another holds (a dream), or whose lease is lost meanwhile, is marked
    changed: the dream after it, due after the dirty delay, builds the profiles again."""
    users = sorted(set(user_ids))
    if not users or not settings.build_profiles:
        return 0, []
    token = str(uuid.uuid4())
    ttl = lease_ttl(settings)
    table = table_for(settings)
    with session_scope(settings) as session:
        held = [u for u in users if locks.acquire(session, u, token, ttl, entries=table)]
    built: dict[str, list[int]] = {}
    written: list[str] = []
    try:
        if held:
            with session_scope(settings) as session:
                composed = profiles.rebuild(
                    session, settings, held, book=book(settings, policy_store.all_configs(session))
                )
                renewed = len(locks.renew_many(session, held, token, ttl)) == len(held)
                if not renewed:
                    session.rollback()  # a lease ran out and was taken meanwhile: nothing written
            if renewed:
                # Committed. A user whose build failed keeps the old profiles: left to the next dream.
                written = [u for u in held if u not in composed.unbuilt]
                built = composed.tokens(written)
    except Exception as exc:
        # The restore is committed: its users' profiles are left to their next dream.
        log.error("restore.profiles_deferred", users=len(held), error_type=type(exc).__name__)
        metrics.PROFILE_FAILURES.inc(len(held))
        built = {}
    finally:
        with session_scope(settings) as session:
            for user_id in held:
                locks.release(session, user_id, token)
            left = [u for u in users if u not in written]
            # The dream holding them may have read their rows before the restore: it
            # leaves them marked, and the next one, due after the dirty delay, builds them.
            schedule.mark_dirty_known(session, left, db_now(session))
    return sum(len(tokens) for tokens in built.values()), left


def _budget_line(policies: PolicyBook, run_id: int) -> BudgetLine:
    # The run's total budget: the largest maxCostPerRun among its policies (each
    # agent's own cap is a line of its own, see worker.budget).
    caps = [policies.default.maxCostPerRun, *(p.maxCostPerRun for p in policies.agents.values())]
    return BudgetLine("run", budget.run_key(run_id), usd_to_nano(max(caps)))


def dream_user(
    settings: Settings,
    user_id: str,
    *,
    trigger: str = "manual",
    agent_id: str | None = None,
    raise_failure: bool = True,
) -> RunOutcome:
    """Dream for one user (or, with ``agent_id``, for one agent's entries of that user,
    all of them if that agent's policy has ``crossAgentMaintenance``).

    Returns a ``skipped`` outcome when another run holds the user's lease. Raises only
    for errors that are not the run's own (the ledger then says ``failed`` too); with
    ``raise_failure`` false, only for a lost database or a transient error: any other
    comes back as the ``failed`` outcome (one of several users, whose data broke the
    run, must not stop the others' runs).
    """
    token = str(uuid.uuid4())
    ttl = lease_ttl(settings)
    with _opening(settings, token, [user_id]) as session:
        # The database's clock: the run's start is compared with times other hosts wrote.
        at = db_now(session)
        if not locks.acquire(session, user_id, token, ttl, entries=table_for(settings)):
            if not locks.holds_row(session, user_id):
                # No entries and no schedule: erased since a message named them (or never known).
                log.info("dream_skipped_unknown", user=user_ref(user_id, settings.log_hash_key))
                return RunOutcome(user_id=user_id, status="skipped", error=UNKNOWN_USER)
            log.info("dream_skipped_busy", user=user_ref(user_id, settings.log_hash_key))
            return RunOutcome(
                user_id=user_id, status="skipped", error=str(UserBusy(user_ref(user_id, settings.log_hash_key)))
            )
        policies = book(settings, policy_store.all_configs(session))
        scope = "user" if agent_id is None else f"agent:{agent_id}"[:32]
        runs.close_abandoned(session, [user_id])
        run_id = runs.start_run(session, user_id, scope=scope, trigger=trigger)
        spend_store.ensure_lines(session, [_budget_line(policies, run_id)])
    started = time.monotonic()
    outcome = RunOutcome(user_id=user_id, status="running", run_id=run_id)
    try:
        with LeaseKeeper(settings, token, ttl, [user_id], until=at + ttl) as keeper:
            _run(settings, user_id, keeper=keeper, at=at, policies=policies, agent_id=agent_id, outcome=outcome)
    except (TransientError, DatabaseUnavailable):
        raise
    except Exception as exc:
        if raise_failure:
            raise
        # The run is closed as failed, with the error named in its row (``_run``).
        log.error("dream.user_failed", user=user_ref(user_id, settings.log_hash_key), error_type=type(exc).__name__)
    finally:
        closing_transaction(settings, lambda session: locks.release(session, user_id, token))
        metrics.DURATION.observe(time.monotonic() - started)
    return outcome


def _opening(settings: Settings, token: str, user_ids: Sequence[str]) -> AbstractContextManager[Session]:
    """The transaction that takes the users' leases under ``token`` and opens their runs.
    Where its ``COMMIT`` lost its reply, what it took is given back at once (its runs
    closed as failed, its leases released), so that neither the task's retry nor the
    next pass finds the users busy until the leases run out."""

    def give_back(session: Session) -> None:
        runs.close_leased_under(session, user_ids, token)
        locks.release_many(session, user_ids, token)

    return committing(settings, give_back)


def _run(
    settings: Settings,
    user_id: str,
    *,
    keeper: LeaseKeeper,
    at: datetime,
    policies: PolicyBook,
    agent_id: str | None,
    outcome: RunOutcome,
) -> None:
    run_id = outcome.run_id
    assert run_id is not None
    owners = _owners(policies, agent_id)
    try:
        _prune_and_detect(settings, user_id, keeper=keeper, policies=policies, owners=owners, at=at, outcome=outcome)
        try:
            _summarize(settings, user_id, keeper=keeper, policies=policies, owners=owners, outcome=outcome)
        except Interrupted as exc:
            # The task's time is up in a model call: the run closes, and the next pass,
            # which the user is marked for, does the rest (profiles included).
            _fail(outcome, exc)
            outcome.retry_soon = True
            _finish(settings, user_id, run_id, at, outcome, keeper=keeper)
            return
        try:
            _refresh_profiles(settings, {user_id: outcome}, policies, keeper)
        except (TransientError, DatabaseUnavailable) as exc:
            # The run's memory work is committed; the profiles are rebuilt by the next
            # pass, which the user is marked for.
            log.warning("dream.profiles_deferred", users=1, error_type=type(exc).__name__)
            outcome.retry_soon = True
        outcome.status = "succeeded"
    except (PermanentError, LeaseLost) as exc:
        outcome.status = "failed"
        outcome.error = str(exc)
    except Exception as exc:
        _fail(outcome, exc)
        # A lock the application held past the database's ``lock_timeout``: tried again
        # by the next pass (after the dirty delay), not at the next dream a day away.
        outcome.retry_soon = outcome.retry_soon or _a_lock_wait(exc)
        _finish(settings, user_id, run_id, at, outcome, keeper=keeper)
        raise
    except KeyboardInterrupt as exc:
        # Ctrl-C or SIGTERM (``reverie run``): the run closes, the next pass does the rest.
        outcome.status, outcome.error = "failed", f"interrupted: {type(exc).__name__}"
        outcome.retry_soon = True
        _finish(settings, user_id, run_id, at, outcome, keeper=keeper)
        raise
    _finish(settings, user_id, run_id, at, outcome, keeper=keeper)


def _fail(outcome: RunOutcome, exc: Exception) -> None:
    outcome.status = "failed"
    if isinstance(exc, PermanentError | LeaseLost):
        outcome.error = str(exc)
    elif isinstance(exc, ReverieError):
        outcome.error = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
    else:
        # Kept in the run's row and logged: the database's own words, never the rows'.
        outcome.error = describe(exc)[:500]


def _prune_and_detect(
    settings: Settings,
    user_id: str,
    *,
    keeper: LeaseKeeper,
    policies: PolicyBook,
    owners: Collection[str] | None,
    at: datetime,
    outcome: RunOutcome,
) -> None:
    run_id = outcome.run_id
    # Pruning and contradictions are set-based and quick: one transaction. The counts
    # are taken only once it has committed: a rolled-back prune removed nothing.
    with session_scope(settings) as session:
        pruned = prune_user(session, settings, user_id, book=policies, owners=owners, at=at, run_id=run_id)
        found = detect(session, settings, user_id, book=policies, owners=owners, at=at, run_id=run_id)
        # Last, so the lease's row is locked only for the commit: a lost lease rolls it all back.
        keeper.hold(session, user_id)
    outcome.entries_pruned = pruned
    outcome.contradictions_found = found.found
    outcome.contradictions_resolved = found.resolved


def _refresh_profiles(
    settings: Settings, outcomes: dict[str, RunOutcome], policies: PolicyBook, keeper: LeaseKeeper
) -> None:
    """Rebuild the profiles of the users whose memory changed, only for users whose
    lease the run still holds (an erased user never gets one back). Three steps: one
    short transaction reads, the text is built (and, where a policy says so, written by
    the model) outside any transaction, and one transaction writes, taking the leases
    last so their rows are locked only for the commit. A failure leaves the old
    profiles, and the next pass tries again (the fingerprint still differs); it does not
    fail the runs, whose memory work is committed."""
    composed = _build_profiles(settings, outcomes, policies, keeper)
    if composed is None:
        return
    users = composed.users
    try:
        while users:
            with session_scope(settings) as session:
                profiles.save(session, composed, users)
                # Last, so the leases' rows are locked only for the commit.
                held = keeper.hold_many(session, users)
                if len(held) == len(users):
                    break
                session.rollback()
            users = [u for u in users if u in held]
    except (TransientError, DatabaseUnavailable):
        raise
    except OperationalError as exc:
        # The database's doing (a lock or statement timeout): built again at the next pass.
        raise TransientError(f"the profile write failed: {type(exc.orig).__name__}") from exc
    except Exception as exc:
        log.error("dream.profiles_failed", users=len(users), error_type=type(exc).__name__)
        metrics.PROFILE_FAILURES.inc(len(users))
        return
    _count_profiles(outcomes, composed, users)


def _build_profiles(
    settings: Settings,
    outcomes: dict[str, RunOutcome],
    policies: PolicyBook,
    keeper: LeaseKeeper,
    limits: ModelTime = ModelTime(),
) -> profiles.Composed | None:
    """The profiles of the users whose memory changed, read in one short transaction
    and built outside any (None: profiles are off, nobody changed, or the build failed,
    which is logged: the next pass tries again)."""
    if not settings.build_profiles:
        return None
    started = time.monotonic()
    try:
        with session_scope(settings) as session:
            read = profiles.plan(
                session,
                settings,
                [u for u in sorted(outcomes) if not keeper.lost(u)],
                book=policies,
                changed=[u for u, outcome in outcomes.items() if outcome.changed_memory],
            )
        if not read.users:
            return None
        writer = None
        keep_paid = None
        if profiles.writes_with_model(policies):
            run_ids = {u: o.run_id for u, o in outcomes.items()}
            writer = ProfileWriter(settings, run_ids, profiles.counter(settings), deadline=limits.deadline)
            keep_paid = _keeping_paid(settings, keeper, writer)
        composed = profiles.compose(
            settings,
            read,
            book=policies,
            writer=writer,
            interrupts=limits.interrupts,
            built=keep_paid,
        )
    except (TransientError, DatabaseUnavailable):
        raise
    except Exception as exc:
        if isinstance(exc, OperationalError) and _waited_for_a_lock(exc):
            # A lock held a moment (a migration's, a VACUUM FULL): not one user's rows.
            # The users are built at the next pass, after the dirty delay.
            raise TransientError("the profile read waited too long for a lock") from exc
        if len(outcomes) == 1:
            user_id = next(iter(outcomes))
            log.error(
                "dream.profiles_failed", user=user_ref(user_id, settings.log_hash_key), error_type=type(exc).__name__
            )
            metrics.PROFILE_FAILURES.inc()
            return None
        # Each user on their own now: one user's rows (a value no code foresaw) must not
        # keep the others' profiles from being built, pass after pass.
        log.error("dream.profiles_failed", users=len(outcomes), error_type=type(exc).__name__)
        return _build_one_by_one(settings, outcomes, policies, keeper, limits)
    metrics.PROFILE_BUILD_DURATION.observe(time.monotonic() - started)
    if composed.deferred:
        # What was built is written; the others are built again at the next pass.
        log.warning("dream.profiles_deferred", users=len(composed.deferred), error_type=composed.deferred_by)
        for user_id in composed.deferred:
            outcomes[user_id].retry_soon = True
    return composed


def _keeping_paid(
    settings: Settings, keeper: LeaseKeeper, writer: ProfileWriter
) -> Callable[[str, list[dict[str, Any]]], None]:
    """What keeps, as soon as they are built, the profiles of a user the model was paid
    to write: written in a transaction of their own that re-takes the user's lease last
    (a user lost to an erasure gets nothing), so a pass that dies before its runs close
    does not pay for them again. The transaction that closes the runs writes them again,
    the same rows (a failure here only leaves them to that one)."""

    def keep(user_id: str, rows: list[dict[str, Any]]) -> None:
        if user_id not in writer.paid:
            return
        # A user whose build stopped midway: those agents' rows only (tasks.profiles._keep_partial).
        stopped = any(row["source_rows"] == -1 for row in rows)
        only = {user_id: {row["agent_id"] for row in rows}} if stopped else {}
        try:
            with session_scope(settings) as session:
                profiles.save(session, profiles.Composed({user_id: rows}, only), [user_id])
                if not keeper.hold_many(session, [user_id]):
                    session.rollback()
        except Exception as exc:
            log.warning("dream.profiles_deferred", users=1, error_type=type(exc).__name__)

    return keep


def _waited_for_a_lock(exc: OperationalError) -> bool:
    """Whether the database gave up waiting for a lock (``lock_timeout``: SQLSTATE 55P03)."""
    return getattr(exc.orig, "sqlstate", None) == "55P03"


def _a_lock_wait(exc: BaseException) -> bool:
    """Whether ``exc`` is the database giving up waiting for a lock."""
    return isinstance(exc, OperationalError) and _waited_for_a_lock(exc)


def _build_one_by_one(
    settings: Settings,
    outcomes: dict[str, RunOutcome],
    policies: PolicyBook,
    keeper: LeaseKeeper,
    limits: ModelTime = ModelTime(),
) -> profiles.Composed | None:
    """:func:`_build_profiles` for each user alone (after the chunk's build failed)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    only: dict[str, set[str]] = {}
    users = list(outcomes)
    for index, user_id in enumerate(users):
        mine = _build_profiles(settings, {user_id: outcomes[user_id]}, policies, keeper, limits)
        if mine is not None:
            rows.update(mine.rows)
            only.update(mine.only)
            if mine.deferred and mine.deferred_by != profiles.OutOfTime.__name__:
                # Interrupted (the task's time is up), or the database or the model's service
                # went away: no other user's build starts now; they wait for the next pass.
                for rest in users[index + 1 :]:
                    outcomes[rest].retry_soon = True
                break
    return profiles.Composed(rows, only) if rows else None


def _save_profiles(session: Session, composed: profiles.Composed, held: Collection[str]) -> tuple[list[str], list[str]]:
    """Write the built profiles of the users among ``held`` (whose leases the caller's
    transaction holds) in a savepoint: a failure leaves their old profiles and the rest
    of the transaction. The users written, and those the database kept from being
    written (a lock or statement timeout: worth another try at the next pass)."""
    users = [u for u in composed.users if u in held]
    try:
        with session.begin_nested():
            profiles.save(session, composed, users)
    except (TransientError, DatabaseUnavailable):
        raise
    except OperationalError as exc:
        if exc.connection_invalidated:
            raise  # the connection is gone: the closing transaction is tried again whole
        # A lock or statement timeout: rolled back to the savepoint, and the runs are
        # closed all the same.
        log.warning("dream.profiles_deferred", users=len(users), error_type=type(exc.orig).__name__)
        return [], users
    except Exception as exc:
        log.error("dream.profiles_failed", users=len(users), error_type=type(exc).__name__)
        if len(users) == 1:
            metrics.PROFILE_FAILURES.inc()
            return [], []
        # Each user in a savepoint of their own: one user's rows must not keep the others' out.
        written: list[str] = []
        deferred: list[str] = []
        for user_id in users:
            mine, later = _save_profiles(session, composed, [user_id])
            written += mine
            deferred += later
        return written, deferred
    return users, []


def _count_profiles(outcomes: dict[str, RunOutcome], composed: profiles.Composed, users: Collection[str]) -> None:
    """Count the profiles written for ``users`` (once committed)."""
    for user_id, built in composed.tokens(users).items():
        outcomes[user_id].profiles_built = len(built)
        metrics.PROFILES_BUILT.inc(len(built))
        for tokens in built:
            metrics.PROFILE_TOKENS.observe(tokens)


def _summarizes(policies: PolicyBook) -> bool:
    return any(p.summarizes for p in (policies.default, *policies.agents.values()))


def _calls_model(settings: Settings, policies: PolicyBook) -> bool:
    """Whether a run may call the model: it summarizes, or the model writes profiles."""
    return _summarizes(policies) or (settings.build_profiles and profiles.writes_with_model(policies))


def _summarize(
    settings: Settings,
    user_id: str,
    *,
    keeper: LeaseKeeper,
    policies: PolicyBook,
    owners: Collection[str] | None,
    outcome: RunOutcome,
) -> None:
    """Summarization, per user, outside any transaction (model calls), where a policy enables it."""
    if not _summarizes(policies):
        return
    assert outcome.run_id is not None
    summary: SummaryCounts = summarize_user(
        settings,
        user_id,
        book=policies,
        owners=owners,
        run_id=outcome.run_id,
        keep_alive=lambda: keeper.check(user_id),
        hold=lambda session: keeper.hold(session, user_id),
    )
    outcome.entries_summarized = summary.summarized
    outcome.entries_written = summary.written
    outcome.groups_deferred = summary.deferred
    outcome.retry_soon = summary.retry_soon > 0
    outcome.retry_next_day = summary.retry_next_day
    outcome.error = summary.note()  # the ledger says what was deferred, and why


def _owners(policies: PolicyBook, agent_id: str | None) -> Collection[str] | None:
    if agent_id is None or policies.for_agent(agent_id).crossAgentMaintenance:
        return None
    return (agent_id,)


def _finish(
    settings: Settings, user_id: str, run_id: int, started: datetime, outcome: RunOutcome, *, keeper: LeaseKeeper
) -> None:
    keeper.stop()

    def close(session: Session) -> None:
        cost_nano = spend_store.spent_nano(session, "run", budget.run_key(run_id))
        outcome.cost_usd = nano_to_usd(cost_nano)
        if not keeper.hold_many(session, [user_id]):
            _close_lost(session, keeper, outcome, cost_nano)
            return
        runs.finish_run(
            session, run_id, status=outcome.status, counts=outcome.counts(), cost_nano=cost_nano, error=outcome.error
        )
        next_at = _next_dreams(session, settings, [user_id], [outcome])[user_id]
        schedule.mark_dreamed(session, user_id, started, next_at)
        if outcome.retry_soon:
            # Work left over (a run's cap used up, transient errors) is carried to the next pass; a
            # group the model could not summarize waits for the next scheduled dream.
            schedule.mark_dirty(session, settings, user_id)

    # Retried on a lost connection: a run must not stay "running" because one died.
    closing_transaction(settings, close)
    _report(settings, outcome)


def _next_dreams(
    session: Session, settings: Settings, users: list[str], outcomes: Iterable[RunOutcome]
) -> dict[str, datetime]:
    """When each user dreams next: their next slot, or the start of the next day (UTC,
    when the day's budgets are new) for a user whose work the day's budget deferred."""
    at = db_now(session)
    next_at = schedule.next_dreams(users, at, settings.dream_interval)
    tomorrow = budget.next_day_start(at)
    for outcome in outcomes:
        if outcome.retry_next_day and outcome.user_id in next_at:
            next_at[outcome.user_id] = min(next_at[outcome.user_id], tomorrow)
    return next_at


def _close_lost(session: Session, keeper: LeaseKeeper, outcome: RunOutcome, cost_nano: int) -> None:
    """Close the ledger row of a run whose lease was lost, and write nothing else: the
    user was erased (then there is no row to close) or another run holds them now. The
    run is over since its lease ran out, so it ends then, before any later run began."""
    assert outcome.run_id is not None
    _fail(outcome, LeaseLost(user_ref(outcome.user_id, keeper.settings.log_hash_key)))
    runs.finish_run(
        session,
        outcome.run_id,
        status=outcome.status,
        counts=outcome.counts(),
        cost_nano=cost_nano,
        error=outcome.error,
        finished_at=keeper.ended_at(outcome.user_id),
    )


def _report(settings: Settings, outcome: RunOutcome) -> None:
    """Metrics and the log line of one finished run."""
    user_id, run_id = outcome.user_id, outcome.run_id
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


# -- a chunk of users at once ---------------------------------------------------------


def dream_users(
    settings: Settings,
    user_ids: Sequence[str],
    *,
    trigger: str = "schedule",
    interrupts: tuple[type[BaseException], ...] = (),
    budget_seconds: float | None = None,
) -> list[RunOutcome]:
    """Whole-user dream runs for a chunk of users (the dispatcher's ``dream.run_users``
    and ``reverie run``), with the same promises as :func:`dream_user` for each.

    On PostgreSQL the chunk's database work is set-based: one transaction takes the
    leases of every free user, opens their ledger rows; one prunes and detects
    contradictions for all of them (each removed row archived under its own user's
    run); one closes the runs, moves the schedule and gives the leases back. Model
    calls (summarization) stay per user and run only where a policy enables them. If
    the chunk's transaction fails, each user is retried on their own, so one user's bad
    data does not cost the others their run. Users whose lease is held elsewhere come
    back ``skipped``. ``interrupts`` (the soft time limit) stop the summarization (that
    user's run fails, without raising); the users left are marked dirty and picked up
    by the next pass, as are those left when summarization has used ``budget_seconds``.
    """
    ids = list(dict.fromkeys(user_ids))
    if not ids:
        return []
    if get_engine(settings).dialect.name != "postgresql":
        return [dream_user(settings, user_id, trigger=trigger, raise_failure=False) for user_id in ids]
    token = str(uuid.uuid4())
    ttl = lease_ttl(settings)
    with _opening(settings, token, ids) as session:
        at = db_now(session)
        leased = locks.acquire_many(session, ids, token, ttl, entries=table_for(settings))
        policies = book(settings, policy_store.all_configs(session))
        runs.close_abandoned(session, leased)
        run_ids = runs.start_runs(session, leased, scope="user", trigger=trigger)
        if _calls_model(settings, policies):
            spend_store.ensure_lines(session, [_budget_line(policies, run_id) for run_id in run_ids.values()])
    started = time.monotonic()
    # Every lease of the chunk is renewed while any of its users is worked on.
    with LeaseKeeper(settings, token, ttl, leased, until=at + ttl) as keeper:
        chunk = _Chunk(settings, keeper, at, policies, {u: RunOutcome(u, "running", run_id=run_ids[u]) for u in leased})
        try:
            chunk.prune_and_detect()
            chunk.summarize(interrupts, budget_seconds)
            if chunk.interrupted:
                # The soft time limit: close the runs now; the next pass builds the profiles.
                chunk.leave_profiles_to_next_pass()
            else:
                # Past the pass's time budget too: no model call starts then (the users
                # who need one wait for the next pass), and the others are built.
                deadline = None if budget_seconds is None else started + budget_seconds
                chunk.refresh_profiles(ModelTime(deadline, interrupts))
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM (``reverie run``): the runs close below, and every user
            # is left to the next pass (their work may be undone or their profiles unbuilt).
            chunk.stopped()
            raise
        finally:
            chunk.finish(time.monotonic() - started)
    # A user left out was busy or had their schedule row locked at that instant: the
    # one-user path waits for the row and then runs, or says skipped.
    done = chunk.outcomes
    return [done[u] if u in done else dream_user(settings, u, trigger=trigger, raise_failure=False) for u in ids]


@dataclass
class _Chunk:
    """The shared state of one chunk's runs (see :func:`dream_users`)."""

    settings: Settings
    keeper: LeaseKeeper
    at: datetime
    policies: PolicyBook
    outcomes: dict[str, RunOutcome]
    carried: list[str] = field(default_factory=list)
    #: Stopped by the soft time limit (``interrupts``), not only out of its time budget.
    interrupted: bool = False
    #: The profiles built for the chunk's changed users, written when the runs close.
    composed: profiles.Composed | None = None

    def run_ids(self) -> dict[str, int]:
        return {u: o.run_id for u, o in self.outcomes.items() if o.run_id is not None and o.status == "running"}

    def prune_and_detect(self) -> None:
        run_ids = self.run_ids()
        try:
            pruned, found = self._prune_held(run_ids)
        except (TransientError, DatabaseUnavailable):
            for outcome in self.outcomes.values():
                _fail(outcome, TransientError("the database went away during the chunk"))
            raise
        except Exception as exc:
            # Rolled back: nothing of the chunk was written. Each user on their own now.
            log.warning("dream.chunk_fallback", users=len(run_ids), error_type=type(exc).__name__)
            self._one_by_one()
            return
        for user_id, outcome in self.outcomes.items():
            if user_id not in pruned:
                _fail(outcome, LeaseLost(user_ref(user_id, self.settings.log_hash_key)))
                continue
            outcome.entries_pruned = pruned[user_id]
            outcome.contradictions_found = found[user_id].found
            outcome.contradictions_resolved = found[user_id].resolved

    def _prune_held(self, run_ids: dict[str, int]) -> tuple[dict[str, int], dict[str, ContradictionCounts]]:
        """Prune and detect for the users whose lease still holds, in one transaction; a
        lease found lost at its end rolls it back, and it is done again without that user."""
        while True:
            with session_scope(self.settings) as session:
                pruned = prune_users(session, self.settings, run_ids, book=self.policies, at=self.at)
                found = detect_many(session, self.settings, run_ids, book=self.policies, at=self.at)
                # Last, so the leases' rows are locked only for the commit.
                held = self.keeper.hold_many(session, sorted(run_ids))
                if len(held) == len(run_ids):
                    return pruned, found
                session.rollback()
            run_ids = {u: r for u, r in run_ids.items() if u in held}

    def _one_by_one(self) -> None:
        for user_id, outcome in self.outcomes.items():
            try:
                _prune_and_detect(
                    self.settings,
                    user_id,
                    keeper=self.keeper,
                    policies=self.policies,
                    owners=None,
                    at=self.at,
                    outcome=outcome,
                )
            except (TransientError, DatabaseUnavailable):
                raise
            except LeaseLost as exc:
                _fail(outcome, exc)
            except Exception as exc:
                # Named by type only: a driver's message can quote the row it failed on.
                log.error("dream.user_failed", user=user_ref(user_id), error_type=type(exc).__name__)
                _fail(outcome, exc)
                if _a_lock_wait(exc):
                    # The application held a row past ``lock_timeout``: the next pass tries again.
                    self.carried.append(user_id)

    def summarize(self, interrupts: tuple[type[BaseException], ...], budget_seconds: float | None) -> None:
        pending = [o for o in self.outcomes.values() if o.status == "running"]
        stops: tuple[type[BaseException], ...] = (Interrupted, *interrupts)
        started = time.monotonic()
        for index, outcome in enumerate(pending):
            if budget_seconds is not None and index and time.monotonic() - started >= budget_seconds:
                self._carry(pending[index:])
                return
            try:
                self.keeper.check(outcome.user_id)
                _summarize(
                    self.settings,
                    outcome.user_id,
                    keeper=self.keeper,
                    policies=self.policies,
                    owners=None,
                    outcome=outcome,
                )
                outcome.status = "succeeded"
            except LeaseLost as exc:
                # Erased, or taken over by another run: that user's work stops here.
                _fail(outcome, exc)
            except stops as exc:
                # The soft time limit (in a model call, or out of one): stop here, close
                # the runs, and let the task end.
                _fail(outcome, TransientError(f"interrupted: {type(exc).__name__}"))
                self.interrupted = True
                self.carried.append(outcome.user_id)
                self._carry(pending[index + 1 :])
                return
            except Exception as exc:
                if not isinstance(exc, PermanentError):
                    log.error("dream.user_failed", user=user_ref(outcome.user_id), error_type=type(exc).__name__)
                _fail(outcome, exc)
                if isinstance(exc, TransientError | DatabaseUnavailable) or _a_lock_wait(exc):
                    # Worth another try soon (the next pass after the dirty delay), not
                    # at the user's next dream time a day away; a bug is not retried early.
                    self.carried.append(outcome.user_id)

    def refresh_profiles(self, limits: ModelTime) -> None:
        """Build the profiles of the chunk's users whose memory changed; :meth:`finish`
        writes them, in the transaction that closes the runs and checks the leases. No
        model call starts once ``limits`` say the time for model work is up:
        the users left are built at the next pass."""
        try:
            self.composed = _build_profiles(self.settings, self.outcomes, self.policies, self.keeper, limits)
        except (TransientError, DatabaseUnavailable) as exc:
            # The runs' own work is committed; the profiles are rebuilt on the next
            # pass, which the users are marked for.
            log.warning("dream.profiles_deferred", users=len(self.outcomes), error_type=type(exc).__name__)
            for outcome in self.outcomes.values():
                outcome.retry_soon = True

    def stopped(self) -> None:
        """The chunk was stopped from outside (Ctrl-C, SIGTERM): every user is marked for
        the next pass, which does what this one did not."""
        for outcome in self.outcomes.values():
            outcome.retry_soon = True

    def leave_profiles_to_next_pass(self) -> None:
        """The profiles are not built by this chunk: every user is marked for the next
        pass (after the dirty delay), which builds those whose memory changed."""
        if self.settings.build_profiles:
            for outcome in self.outcomes.values():
                outcome.retry_soon = True

    def _carry(self, rest: list[RunOutcome]) -> None:
        # Pruned and checked, not summarized (time is up): the next pass summarizes them.
        for outcome in rest:
            outcome.status = "succeeded"
            outcome.error = outcome.error or CARRIED
            self.carried.append(outcome.user_id)

    def finish(self, elapsed: float) -> None:
        """Close every run of the chunk, move the schedule, give the leases back: one transaction."""
        outcomes = list(self.outcomes.values())
        for outcome in outcomes:
            if outcome.status == "running":
                outcome.status = "failed"
                outcome.error = outcome.error or "the chunk stopped before this run finished"

        self.keeper.stop()

        saved: list[str] = []

        def close(session: Session) -> None:
            # Only users whose lease still holds get anything written (see _close_lost).
            held = set(self.keeper.hold_many(session, sorted(self.outcomes)))
            if self.composed is not None:
                saved[:], deferred = _save_profiles(session, self.composed, held)
                for user_id in deferred:
                    self.outcomes[user_id].retry_soon = True
            costs: dict[int, int] = {}
            for outcome in outcomes:
                if outcome.run_id is not None and _calls_model(self.settings, self.policies):
                    # Only a run that may have called the model has spend to read.
                    costs[outcome.run_id] = spend_store.spent_nano(session, "run", budget.run_key(outcome.run_id))
                    outcome.cost_usd = nano_to_usd(costs[outcome.run_id])
            runs.finish_runs(
                session,
                [
                    runs.Finished(o.run_id, o.status, o.counts(), costs.get(o.run_id, 0), o.error)
                    for o in outcomes
                    if o.run_id is not None and o.user_id in held
                ],
            )
            for outcome in outcomes:
                if outcome.user_id not in held:
                    _close_lost(session, self.keeper, outcome, costs.get(outcome.run_id or 0, 0))
            next_at = _next_dreams(session, self.settings, sorted(held), outcomes)
            schedule.mark_dreamed_many(session, next_at, self.at)
            # Work left over (a run's cap used up, time, transient errors) is carried to the next pass.
            # (A group the model could not summarize waits for the next scheduled dream.)
            left_over = ({o.user_id for o in outcomes if o.retry_soon} | set(self.carried)) & held
            schedule.mark_dirty_many(session, self.settings, sorted(left_over))
            locks.release_many(session, sorted(held), self.keeper.token)

        # Retried on a lost connection: the runs must not stay "running", nor the
        # leases held, because one connection died.
        closing_transaction(self.settings, close)
        if self.composed is not None:
            _count_profiles(self.outcomes, self.composed, saved)
        for outcome in outcomes:
            # The chunk's wall time, shared out: what one user's run cost.
            metrics.DURATION.observe(elapsed / len(outcomes))
            _report(self.settings, outcome)
