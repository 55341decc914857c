"""Queries on ``dream_signals``: the producer's insert, listing and replay."""

from __future__ import annotations

from collections.abc import Sequence
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from store.models import Signal
from store.types import now


@dataclass(frozen=True)
class Inserted:
    signal_id: int
    idempotency_key: str
    created: bool


def insert_signal(
    session: Session,
    *,
    kind: str,
    user_id: str,
    payload: Any,
    agent_id: str | None,
    idempotency_key: str | None,
    fallback_key: str,
) -> Inserted:
    """Insert a signal unless one with the same idempotency key exists.

    On PostgreSQL a missing key is computed by the table's trigger, exactly as for a
    producer that INSERTs by hand; elsewhere ``fallback_key`` is used.
    """
    dialect = session.get_bind().dialect.name
    key = idempotency_key if idempotency_key is not None or dialect == "postgresql" else fallback_key
    values = {
        "kind": kind,
        "user_id": user_id,
        "agent_id": agent_id,
        "payload": payload,
        "idempotency_key": key,
    }
    insert = postgresql.insert(Signal) if dialect == "postgresql" else sqlite.insert(Signal)
    statement = (
        insert.values(**values)
        .on_conflict_do_nothing(index_elements=["idempotency_key"])
        .returning(Signal.id, Signal.idempotency_key)
    )
    row = session.execute(statement).first()
    if row is not None:
        return Inserted(row.id, row.idempotency_key, created=True)
    existing = session.execute(
        select(Signal.id, Signal.idempotency_key).where(Signal.idempotency_key == _key_expression(key, values, dialect))
    ).one()
    return Inserted(existing.id, existing.idempotency_key, created=False)


def _key_expression(key: str | None, values: dict[str, Any], dialect: str) -> Any:
    if key is not None:
        return key
    # The same expression the trigger uses, so a duplicate is found without a second hash.
    assert dialect == "postgresql"
    return text(
        "encode(sha256(convert_to(:kind || E'\\n' || :user_id || E'\\n' || CAST(:payload AS jsonb)::text, 'UTF8')), 'hex')"
    ).bindparams(
        kind=values["kind"],
        user_id=values["user_id"],
        payload=_json_text(values["payload"]),
    )


def _json_text(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False)


def list_signals(
    session: Session,
    *,
    status: str | None = None,
    kind: str | None = None,
    user_id: str | None = None,
    limit: int = 50,
) -> Sequence[Signal]:
    query = select(Signal).order_by(Signal.id.desc()).limit(limit)
    if status is not None:
        query = query.where(Signal.status == status)
    if kind is not None:
        query = query.where(Signal.kind == kind)
    if user_id is not None:
        query = query.where(Signal.user_id == user_id)
    return session.scalars(query).all()


def count_by_status(session: Session) -> dict[tuple[str, str], int]:
    rows = session.execute(select(Signal.kind, Signal.status, func.count()).group_by(Signal.kind, Signal.status))
    return {(kind, status): count for kind, status, count in rows}


def retry_signals(session: Session, *, signal_id: int | None = None, all_dead: bool = False) -> list[int]:
    """Put dead (or failed) signals back to ``pending`` with fresh attempts."""
    statement = (
        update(Signal)
        .values(status="pending", attempts=0, available_at=now(), claimed_until=None, claim_token=None)
        .returning(Signal.id)
    )
    if signal_id is not None:
        statement = statement.where(Signal.id == signal_id, Signal.status.in_(("dead", "failed")))
    elif all_dead:
        statement = statement.where(Signal.status == "dead")
    else:
        return []
    return list(session.scalars(statement))


def get_signal(session: Session, signal_id: int) -> Signal | None:
    return session.get(Signal, signal_id)


def oldest_pending(session: Session) -> datetime | None:
    return session.scalar(select(func.min(Signal.enqueued_at)).where(Signal.status == "pending"))
