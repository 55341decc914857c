"""Beat's outbox sweeper: new wake-ups for signals that are not moving.

A producer's row in ``dream_signals`` is the truth; the broker only carries wake-ups.
A wake-up can be missing: the producer only ran an ``INSERT``, Redis lost the message,
a failed signal's backoff ended, or a worker died mid-task and its lease ran out. The
sweeper finds those rows (oldest first, at most ``sweep_max_signals`` per sweep) and
sends them fresh ``signals.process`` messages.

A stranded row may still have a wake-up waiting in a long queue, and the sweeper cannot
tell which. So it sends no more wake-ups than there are stranded rows beyond the
messages already queued, oldest rows first (plus any row stranded longer than a
signal lease): a backlog is never flooded with copies, and once the queue drains every
stranded row gets its wake-up. A copy that does go out
is harmless: processing claims the row first, so the second message finds nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from store import dispatch as dispatch_store
from store.db import session_scope
from store.types import now
from worker.logs import get_logger
from worker.settings import Settings

#: Sends wake-ups for signal ids; returns how many the broker accepted.
SendWakeups = Callable[[list[int]], int]
#: How many signal wake-ups are waiting in the broker's queue.
QueueDepth = Callable[[], int]

log = get_logger(__name__)


def stranded(settings: Settings, *, at: datetime) -> list[tuple[int, datetime]]:
    """(id, since) of the signals that may need a new wake-up now, oldest first."""
    with session_scope(settings) as session:
        return dispatch_store.stranded_signals(
            session, at=at, grace_seconds=settings.sweep_grace_seconds, limit=settings.sweep_max_signals
        )


def sweep(settings: Settings, send: SendWakeups, queued: QueueDepth, *, at: datetime | None = None) -> int:
    """One sweep: returns the number of wake-ups sent."""
    at = at or now()
    rows = stranded(settings, at=at)
    if not rows:
        return 0
    waiting = queued()
    # Rows stranded longer than a lease are sent regardless: a queue that never quite
    # drains must not starve a signal whose wake-up was lost.
    overdue = at - timedelta(seconds=settings.signal_lease_seconds)
    keep = max(len(rows) - waiting, 0)
    missing = [signal_id for index, (signal_id, since) in enumerate(rows) if index < keep or since <= overdue]
    sent = send(missing) if missing else 0
    log.info("sweep.resent", stranded=len(rows), queued=waiting, sent=sent)
    return sent
