"""Beat's outbox sweeper: new wake-ups for signals that are not moving.

A producer's row in ``dream_signals`` is the truth; the broker only carries wake-ups.
A wake-up can be missing: the producer only ran an ``INSERT``, Redis lost the message,
a failed signal's backoff ended, or a worker died mid-task and its lease ran out. The
sweeper finds those rows (oldest first, at most ``sweep_max_signals`` per sweep) and
sends each a fresh ``signals.process`` message. A wake-up for a signal that is already
moving is harmless: processing claims the row first, so the second message finds
nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from store import dispatch as dispatch_store
from store.db import session_scope
from store.types import now
from worker.logs import get_logger
from worker.settings import Settings

#: Sends wake-ups for signal ids; returns how many the broker accepted.
SendWakeups = Callable[[list[int]], int]

log = get_logger(__name__)


def stranded(settings: Settings, *, at: datetime | None = None) -> list[int]:
    """Ids of the signals that need a new wake-up now, oldest first."""
    with session_scope(settings) as session:
        return dispatch_store.stranded_signal_ids(
            session,
            at=at or now(),
            grace_seconds=settings.sweep_grace_seconds,
            limit=settings.sweep_max_signals,
        )


def sweep(settings: Settings, send: SendWakeups, *, at: datetime | None = None) -> int:
    """One sweep: returns the number of wake-ups sent."""
    signal_ids = stranded(settings, at=at)
    if not signal_ids:
        return 0
    sent = send(signal_ids)
    log.info("sweep.resent", stranded=len(signal_ids), sent=sent)
    return sent
