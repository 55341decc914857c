"""Seeding helpers for the dream-cycle tests: entries written straight into the host table."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import insert, select

from store.db import session_scope
from store.memories import table_for
from store.types import now
from worker.settings import Settings


def entry(
    user_id: str,
    key: str,
    value: Any,
    *,
    category: str = "fact",
    visibility: str = "self",
    agent: str | None = "agent-a",
    age_days: float = 1,
    access_count: int = 0,
    group_ids: list[str] | None = None,
) -> dict[str, Any]:
    at = now() - timedelta(days=age_days)
    return {
        "id": str(uuid.uuid4()),
        "user_id": user_id,
        "key": key,
        "value": value,
        "category": category,
        "visibility": visibility,
        "source_agent_id": agent,
        "group_ids": group_ids or [],
        "source_conversation_id": None,
        "conflicted": False,
        "access_count": access_count,
        "created_at": at,
        "updated_at": at,
    }


def seed(settings: Settings, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with session_scope(settings) as session:
        session.execute(insert(table_for(settings)), rows)
    return rows


def entries_of(settings: Settings, user_id: str) -> dict[str, Any]:
    """The user's rows keyed by id (as mappings)."""
    table = table_for(settings)
    with session_scope(settings) as session:
        rows = session.execute(select(table).where(table.c.user_id == user_id)).all()
    return {row.id: dict(row._mapping) for row in rows}


def keys_of(settings: Settings, user_id: str) -> set[str]:
    return {row["key"] for row in entries_of(settings, user_id).values()}
