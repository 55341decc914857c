"""Queries on ``dream_observations``: candidate preferences waiting to recur."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.models import Observation
from store.types import now
from worker.errors import TransientError

#: How many contributing signal ids an observation remembers (enough to explain it).
MAX_SIGNAL_IDS = 50


@dataclass(frozen=True)
class Observed:
    observation_id: int
    seen_count: int
    promoted: bool


def observe(
    session: Session,
    *,
    user_id: str,
    agent_id: str | None,
    key: str,
    value: Any,
    evidence: str,
    signal_id: int,
) -> Observed:
    """Count one sighting of a candidate preference by one feedback signal.

    The same signal is counted once. A different value for the same key starts the
    count again (the user changed their mind, or the old sighting was noise).
    """
    agent = agent_id or ""
    match = (Observation.user_id == user_id, Observation.agent_id == agent, Observation.key == key)
    at = now()
    for _ in range(2):
        row = session.execute(select(Observation).where(*match).with_for_update()).scalar_one_or_none()
        if row is not None:
            return _count(session, row, value=value, evidence=evidence, signal_id=signal_id)
        builder = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
        statement = (
            builder(Observation)
            .values(
                user_id=user_id,
                agent_id=agent,
                key=key,
                value=value,
                evidence=evidence,
                seen_count=1,
                signal_ids=[signal_id],
                first_seen_at=at,
                last_seen_at=at,
            )
            .on_conflict_do_nothing()
            .returning(Observation.id)
        )
        new_id = session.execute(statement).scalar_one_or_none()
        if new_id is not None:
            return Observed(new_id, 1, promoted=False)
    raise TransientError("another worker kept changing the same observation; try again")


def keys_of(session: Session, *, user_id: str, agent_id: str | None) -> list[str]:
    """The keys of the user's observations for this agent, oldest first.

    On PostgreSQL this first takes a transaction lock on (user, agent), so two feedback
    signals of one user that name one preference with two synonyms count it together
    instead of each starting its own observation."""
    agent = agent_id or ""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(f"observations:{user_id}:{agent}", 0))))
    query = (
        select(Observation.key)
        .where(Observation.user_id == user_id, Observation.agent_id == agent)
        .order_by(Observation.first_seen_at, Observation.id)
    )
    return list(session.scalars(query))


def _same_value(stored: Any, value: Any) -> bool:
    # A model restating a preference changes its case, spacing and final stop.
    if isinstance(stored, str) and isinstance(value, str):
        return " ".join(stored.casefold().split()).rstrip(".!") == " ".join(value.casefold().split()).rstrip(".!")
    return bool(stored == value)


def _count(session: Session, row: Observation, *, value: Any, evidence: str, signal_id: int) -> Observed:
    ids = list(row.signal_ids or [])
    if signal_id in ids:
        return Observed(row.id, row.seen_count, promoted=row.promoted_at is not None)
    if not _same_value(row.value, value):
        changes: dict[str, Any] = {"value": value, "seen_count": 1, "signal_ids": [signal_id], "promoted_at": None}
        seen = 1
    else:
        seen = row.seen_count + 1
        changes = {"seen_count": seen, "signal_ids": [*ids, signal_id][-MAX_SIGNAL_IDS:]}
    changes.update(evidence=evidence, last_seen_at=now())
    session.execute(update(Observation).where(Observation.id == row.id).values(**changes))
    promoted = row.promoted_at is not None and "promoted_at" not in changes
    return Observed(row.id, seen, promoted=promoted)


def mark_promoted(session: Session, observation_id: int) -> None:
    session.execute(update(Observation).where(Observation.id == observation_id).values(promoted_at=now()))


def pending_for(session: Session, user_id: str) -> list[Observation]:
    """The user's observations not yet promoted, oldest first."""
    query = (
        select(Observation)
        .where(Observation.user_id == user_id, Observation.promoted_at.is_(None))
        .order_by(Observation.first_seen_at, Observation.id)
    )
    return list(session.scalars(query))
