"""One pass in this process, for cron (``reverie run``): signals first, then dreams,
then the retention purge (:mod:`tasks.retention`).

It first settles the budget reservations that a killed pass left behind (see
:func:`worker.budget.reap_expired`), so they do not hold the day's budget until
midnight, and closes the dream runs a killed pass left ``running`` once their leases
have lapsed (:func:`schedules.sweeper.close_lapsed_runs`).

Without ``users`` or ``all_users`` the users due now are dreamed (see
:mod:`store.schedule`), in chunks of ``dispatch_chunk_size`` through
:func:`tasks.dream.dream_users`, ``cron_concurrency`` chunks at a time on PostgreSQL
(threads: a chunk's Python work overlaps another's wait on the database; each chunk
holds its own users' leases and transactions, as a worker's would).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any

from schedules.sweeper import close_lapsed_runs
from store import schedule
from store.db import get_engine, session_scope
from store.types import db_now
from tasks.dream import UNKNOWN_USER, RunOutcome, dream_users
from worker.budget import reap_expired
from worker.settings import Settings
from worker.url_secrets import mask_secrets


@dataclass
class PassReport:
    """The ``reverie run --json`` object (docs/reference.md, Command line), plus detail."""

    users_processed: int = 0
    users_skipped: int = 0
    #: Users due that the pass left for the next one: its time limit was up.
    users_deferred: int = 0
    users_failed: int = 0
    entries_pruned: int = 0
    contradictions_found: int = 0
    entries_summarized: int = 0
    groups_deferred: int = 0
    signals_processed: int = 0
    signals_rejected: int = 0
    signals_failed: int = 0
    signals_dead: int = 0
    cost_usd: float = 0.0
    #: Profiles written for users whose memory changed.
    profiles_built: int = 0
    # Rows purged (or payloads emptied) past their retention, at the end of the pass.
    rows_purged: int = 0
    run_ids: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Users named to the pass (``--user``) with no entries and no schedule row: not dreamed.
    users_unknown: list[str] = field(default_factory=list)
    #: Users the pass skipped because another run held them (not in the JSON object:
    #: ``reverie run --user`` names those it was asked for).
    busy: list[str] = field(default_factory=list, repr=False)

    def add(self, outcome: RunOutcome) -> None:
        if outcome.run_id is not None:
            self.run_ids.append(outcome.run_id)
        if outcome.status == "skipped":
            self.users_skipped += 1
            if outcome.error != UNKNOWN_USER:  # not erased meanwhile: held by another run
                self.busy.append(outcome.user_id)
            return
        if outcome.status == "failed":
            self.users_failed += 1
            if outcome.error:
                # Printed by ``--json``: an error may quote a connection URL.
                self.errors.append(mask_secrets(f"run {outcome.run_id}: {outcome.error}"))
        else:
            # As ``dream_users_processed_total``: runs that finished without failing.
            self.users_processed += 1
        # A failed run's work done before it failed (committed) is counted all the same.
        self.entries_pruned += outcome.entries_pruned
        self.contradictions_found += outcome.contradictions_found
        self.entries_summarized += outcome.entries_summarized
        self.groups_deferred += outcome.groups_deferred
        self.profiles_built += outcome.profiles_built
        self.cost_usd = round(self.cost_usd + outcome.cost_usd, 9)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["busy"]
        return data


def users_for(settings: Settings, *, users: Sequence[str], all_users: bool) -> tuple[list[str], list[str]]:
    """The users a pass dreams (the named ones, everyone, or those due now), and the
    named users it does not: those with no entries in the memory table and no schedule
    row. Dreaming one would only make a schedule row, and a run, for a user that is not
    there (a typo, or a user erased)."""
    with session_scope(settings) as session:
        if users:
            named = list(dict.fromkeys(users))
            known = schedule.known_user_ids(session, settings, named)
            return [u for u in named if u in known], [u for u in named if u not in known]
        if all_users:
            return schedule.all_user_ids(session, settings), []
        return schedule.due_user_ids(session, db_now(session), limit=10_000_000, settings=settings), []


def run_once(
    settings: Settings,
    *,
    users: Sequence[str] = (),
    all_users: bool = False,
    on_user: Callable[[int, int], None] | None = None,
) -> PassReport:
    """Process pending signals, dream the chosen users, then purge what is past its
    retention; ``on_user(done, total)`` is called after each user (progress display).

    The pass stops starting model work once ``cron_time_limit_seconds`` have passed
    since it began: the users of a chunk under way that were not summarized yet are
    carried to the next pass, and the chunks not started are left due."""
    from tasks.retention import purge_expired
    from tasks.signals import process_pending

    report = PassReport()
    reap_expired(settings)
    close_lapsed_runs(settings)
    deadline = time.monotonic() + settings.cron_time_limit_seconds
    signals = process_pending(settings)
    report.signals_processed = signals.processed
    report.signals_rejected = signals.rejected
    report.signals_failed = signals.failed
    report.signals_dead = signals.dead
    # After the signals: a named user a signal just gave entries to is known.
    chosen, report.users_unknown = users_for(settings, users=users, all_users=all_users)
    done = 0
    for outcomes in _dream_in_chunks(settings, chosen, deadline, report):
        for outcome in outcomes:
            report.add(outcome)
            done += 1
            if on_user is not None:
                on_user(done, len(chosen))
    report.rows_purged = purge_expired(settings).total
    return report


def _dream_in_chunks(
    settings: Settings, chosen: Sequence[str], deadline: float, report: PassReport
) -> Iterator[list[RunOutcome]]:
    """Dream ``chosen`` in chunks, like the dispatcher's (each chunk's database work is
    set-based), up to ``cron_concurrency`` at once; yields each chunk's outcomes, in
    this thread, as it ends. No chunk starts once the deadline has passed: the users
    left are counted in ``report.users_deferred`` and stay due."""
    size = settings.dispatch_chunk_size
    chunks = [list(chosen[start : start + size]) for start in range(0, len(chosen), size)]
    # SQLite takes one writer at a time: a second thread would only wait for the lock.
    width = settings.cron_concurrency if get_engine(settings).dialect.name == "postgresql" else 1
    if width == 1 or len(chunks) == 1:
        for index, chunk in enumerate(chunks):
            left = deadline - time.monotonic()
            if left <= 0:
                report.users_deferred = sum(len(c) for c in chunks[index:])
                return
            yield dream_users(settings, chunk, trigger="cron", budget_seconds=left)
        return
    pending = iter(chunks)
    running: set[Future[list[RunOutcome]]] = set()
    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="dream-chunk") as pool:
        try:
            for chunk in pending:
                if deadline - time.monotonic() <= 0:
                    report.users_deferred = len(chunk) + sum(len(c) for c in pending)
                    break
                running.add(
                    pool.submit(
                        dream_users, settings, chunk, trigger="cron", budget_seconds=deadline - time.monotonic()
                    )
                )
                if len(running) < width:
                    continue
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield future.result()
            for future in running:
                yield future.result()
        except BaseException:
            # Interrupted (Ctrl-C): the chunks under way end on their own, closing their
            # ledger rows and giving their leases back; none starts after this.
            for future in running:
                future.cancel()
            raise
