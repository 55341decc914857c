"""Queries on ``dream_activity``: the events routines are found in."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, select, text
from sqlalchemy.orm import Session

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


# Routine detection and erasure meet on a per-user advisory lock instead of a lock on
# the whole table, which made every producer's insert wait behind one erasure. Users
# share a bucket of the lock space so that a detection over all users holds a bounded
# number of locks (PostgreSQL's lock table is small), at the price of an erasure now
# and then waiting for a detection that holds the bucket of another user.
_LOCK_SPACE = 1_380_275_781  # the first key of every such lock: Reverie's own namespace
_BUCKETS = 1024
_PG_ERASING = text("SELECT pg_advisory_xact_lock(:space, hashtext(:user_id) & :mask)")
_PG_DETECTING = text("SELECT pg_advisory_xact_lock_shared(:space, hashtext(:user_id) & :mask)")


def lock_for_erasure(session: Session, user_id: str) -> None:
    """Hold off, until the caller's transaction ends, routine detection's writes for
    ``user_id``; waits for a detection that is writing them (PostgreSQL)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_PG_ERASING, {"space": _LOCK_SPACE, "user_id": user_id, "mask": _BUCKETS - 1})


def hold_for_routines(session: Session, user_id: str, event_id: int) -> bool:
    """Before routine detection writes for ``user_id``: keep an erasure of that user
    from starting until the caller's transaction ends, and say whether the event
    ``event_id`` it read is still there (False: the user was erased since, so nothing
    may be written). On SQLite the detection's transaction already excludes every
    other writer."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    session.execute(_PG_DETECTING, {"space": _LOCK_SPACE, "user_id": user_id, "mask": _BUCKETS - 1})
    return bool(session.scalar(select(exists().where(ActivityEvent.id == event_id))))


def delete_before(session: Session, cutoff: datetime) -> int:
    """Forget events older than ``cutoff`` (past the routine look-back, they serve nothing)."""
    result = session.execute(delete(ActivityEvent).where(ActivityEvent.at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)
