"""Queries on ``dream_activity``: the events routines are found in."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from store import locks
from store.bulk import insert_rows
from store.models import ActivityEvent


def add_events(session: Session, rows: list[dict[str, Any]]) -> int:
    """Insert events (``user_id``, ``agent_id``, ``action``, ``at``, ``attributes``, ``signal_id``)."""
    return insert_rows(session, ActivityEvent, rows)


def events_since(session: Session, since: datetime) -> Iterator[tuple[str, str, str, datetime, int]]:
    """(user, agent, action, at, id) of every event at or after ``since``, grouped by
    user, agent and action, in time order."""
    query = (
        select(ActivityEvent.user_id, ActivityEvent.agent_id, ActivityEvent.action, ActivityEvent.at, ActivityEvent.id)
        .where(ActivityEvent.at >= since)
        .order_by(ActivityEvent.user_id, ActivityEvent.agent_id, ActivityEvent.action, ActivityEvent.at)
        .execution_options(yield_per=5000)
    )
    for row in session.execute(query):
        yield row.user_id, row.agent_id, row.action, row.at, row.id


def lock_for_erasure(session: Session, user_id: str) -> None:
    """Hold off, until the caller's transaction ends, routine detection's writes for
    ``user_id`` (and a restore's: :func:`store.locks.hold_off_erasure`); waits for a
    detection that is writing them (PostgreSQL)."""
    locks.erasure_lock(session, user_id, shared=False)


def hold_for_routines(session: Session, user_id: str, event_id: int) -> bool:
    """Before routine detection writes for ``user_id``: keep an erasure of that user
    from starting until the caller's transaction ends, and say whether the event
    ``event_id`` it read is still there (False: the user was erased since, so nothing
    may be written). On SQLite the detection's transaction already excludes every
    other writer."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    locks.erasure_lock(session, user_id, shared=True)
    return bool(session.scalar(select(exists().where(ActivityEvent.id == event_id))))


def delete_before(session: Session, cutoff: datetime) -> int:
    """Forget events older than ``cutoff`` (past the routine look-back, they serve nothing)."""
    result = session.execute(delete(ActivityEvent).where(ActivityEvent.at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)
