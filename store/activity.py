"""Queries on ``dream_activity``: the events routines are found in."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from store.models import ActivityEvent


def add_events(session: Session, rows: list[dict[str, Any]]) -> int:
    """Insert events (``user_id``, ``agent_id``, ``action``, ``at``, ``attributes``, ``signal_id``)."""
    if rows:
        session.execute(insert(ActivityEvent), rows)
    return len(rows)


def events_since(session: Session, since: datetime) -> Iterator[tuple[str, str, str, datetime]]:
    """(user, agent, action, at) of every event at or after ``since``, grouped by
    user, agent and action, in time order."""
    query = (
        select(ActivityEvent.user_id, ActivityEvent.agent_id, ActivityEvent.action, ActivityEvent.at)
        .where(ActivityEvent.at >= since)
        .order_by(ActivityEvent.user_id, ActivityEvent.agent_id, ActivityEvent.action, ActivityEvent.at)
        .execution_options(yield_per=5000)
    )
    for row in session.execute(query):
        yield row.user_id, row.agent_id, row.action, row.at


def delete_before(session: Session, cutoff: datetime) -> int:
    """Forget events older than ``cutoff`` (past the routine look-back, they serve nothing)."""
    result = session.execute(delete(ActivityEvent).where(ActivityEvent.at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)
