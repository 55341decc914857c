"""Beat's dispatcher: claim the users that are due and send their runs in chunks.

One tick claims at most ``dispatch_max_users`` users in one transaction (see
:func:`store.dispatch.claim_due_users` for what "due" means), commits, and only then
sends ``dream.run_users`` messages of ``dispatch_chunk_size`` users each, so a worker
never races the claim. A second beat or a double tick claims nobody twice. If a chunk
cannot be sent, its users are released and the next tick picks them up again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from store import dispatch as dispatch_store
from store.db import committing, session_scope
from store.types import db_now
from worker.errors import BrokerUnavailable
from worker.logs import get_logger
from worker.settings import Settings

#: Sends one chunk of user ids (``dream.run_users``); raises :class:`BrokerUnavailable`.
SendChunk = Callable[[list[str]], None]

log = get_logger(__name__)


@dataclass(frozen=True)
class DispatchResult:
    """What one tick did: users claimed and sent, users released for the next tick."""

    claimed: int
    sent: int
    released: int
    chunks: int


def chunked(items: Sequence[str], size: int) -> list[list[str]]:
    return [list(items[start : start + size]) for start in range(0, len(items), size)]


def claim(settings: Settings, *, at: datetime | None = None) -> list[str]:
    """Claim the due users in a transaction of its own; committed when this returns.
    A claim whose reply was lost (the connection died as it committed) is undone at
    once, so its users are claimed by the next tick, not when the dispatch lease ends."""
    stamped: list[datetime] = []
    with committing(
        settings, lambda session: dispatch_store.release_claim(session, stamped[0]) if stamped else 0
    ) as session:
        stamped.append(at or db_now(session))
        return dispatch_store.claim_due_users(
            session,
            at=stamped[0],
            limit=settings.dispatch_max_users,
            interval_seconds=settings.dream_interval_seconds,
            dirty_delay_seconds=settings.dispatch_dirty_delay_seconds,
            lease_seconds=settings.dispatch_lease_seconds,
        )


def dispatch(settings: Settings, send: SendChunk, *, at: datetime | None = None) -> DispatchResult:
    """One dispatcher tick: claim, commit, then send the runs in chunks."""
    user_ids = sorted(claim(settings, at=at))
    sent = 0
    unsent: list[str] = []
    chunks = chunked(user_ids, settings.dispatch_chunk_size)
    for index, chunk in enumerate(chunks):
        try:
            send(chunk)
        except BrokerUnavailable as exc:
            # The broker is away: give every unsent user back rather than skip a cycle.
            unsent = [uid for rest in chunks[index:] for uid in rest]
            log.warning("dispatch.send_failed", unsent=len(unsent), error=str(exc))
            break
        sent += len(chunk)
    if unsent:
        with session_scope(settings) as session:
            dispatch_store.release_users(session, unsent, at=at)
    if user_ids:
        log.info("dispatch.tick", claimed=len(user_ids), sent=sent, released=len(unsent))
    return DispatchResult(claimed=len(user_ids), sent=sent, released=len(unsent), chunks=len(chunks))


def adopt(settings: Settings, *, at: datetime | None = None) -> int:
    """Schedule users the memory table has and the schedule does not (due at once)."""
    with session_scope(settings) as session:
        adopted = dispatch_store.adopt_unseen_users(session, settings, at=at)
    if adopted:
        log.info("dispatch.adopted", users=adopted)
    return adopted
