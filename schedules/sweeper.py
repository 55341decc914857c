"""Beat's outbox sweeper: new wake-ups for signals that are not moving.

A producer's row in ``dream_signals`` is the truth; the broker only carries wake-ups.
A wake-up can be missing: the producer only ran an ``INSERT``, Redis lost the message,
a failed signal's backoff ended, or a worker died mid-task and its lease ran out. The
sweeper finds those rows (oldest first, at most ``sweep_max_signals`` per sweep) and
sends them fresh ``signals.process`` messages.

A stranded row may still have a wake-up waiting in a long queue, and the sweeper cannot
tell which; so it sends each stranded row at most one wake-up per signal lease
(``signal_lease_seconds``, remembered in the broker). A backlog is never flooded with
copies, and no lost signal waits longer than a lease for its next wake-up. A copy that
does go out is harmless: processing claims the row first, so the second message finds
nothing to do.

Each sweep also settles the budget reservations of model calls whose process died
(:func:`worker.budget.reap_expired`), so a killed worker's reservation holds the day's
budget for minutes, not until midnight, and closes the ledger rows of dream runs whose
worker died (:func:`close_lapsed_runs`), so they do not stay ``running`` until that
user's next dream.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from store import dispatch as dispatch_store
from store import runs as run_store
from store.db import session_scope
from worker.budget import reap_expired
from worker.logs import get_logger
from worker.settings import Settings

#: Sends wake-ups for signal ids; returns how many the broker accepted.
SendWakeups = Callable[[list[int]], int]
#: Keeps the ids that got no wake-up from the sweeper within a window (and marks them).
NotResent = Callable[[list[int], int], list[int]]

log = get_logger(__name__)


def stranded(settings: Settings, *, at: datetime | None = None) -> list[tuple[int, datetime]]:
    """(id, since) of the signals that may need a new wake-up now, oldest first."""
    with session_scope(settings) as session:
        return dispatch_store.stranded_signals(
            session, at=at, grace_seconds=settings.sweep_grace_seconds, limit=settings.sweep_max_signals
        )


def close_lapsed_runs(settings: Settings) -> int:
    """Close, as failed, the dream runs left ``running`` by a worker that died (their
    user's lease has lapsed): see :func:`store.runs.close_lapsed`. Returns how many."""
    with session_scope(settings) as session:
        closed = run_store.close_lapsed(session)
    if closed:
        log.warning("dream.runs_closed_lapsed", runs=closed)
    return closed


def sweep(settings: Settings, send: SendWakeups, not_resent: NotResent, *, at: datetime | None = None) -> int:
    """One sweep: returns the number of wake-ups sent."""
    reap_expired(settings)
    close_lapsed_runs(settings)
    rows = stranded(settings, at=at)
    if not rows:
        return 0
    due = not_resent([signal_id for signal_id, _since in rows], settings.signal_lease_seconds)
    sent = send(due) if due else 0
    log.info("sweep.resent", stranded=len(rows), sent=sent)
    return sent
