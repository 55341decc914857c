"""Writes used to seed a store (the demo and the benchmarks), not by the dream path."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Table, insert, text, update
from sqlalchemy.orm import Session


def insert_entries(session: Session, table: Table, rows: Iterable[dict[str, Any]]) -> int:
    """Insert memory entries as the host application would; returns the count."""
    batch = []
    for row in rows:
        full = {
            "id": row.get("id") or str(uuid.uuid4()),
            "category": "fact",
            "visibility": "self",
            "group_ids": [],
            "conflicted": False,
            "access_count": 0,
            **row,
        }
        batch.append(full)
    if batch:
        session.execute(insert(table), batch)
    return len(batch)


def insert_raw_signal(session: Session, kind: str, user_id: str, payload_json: str) -> None:
    """INSERT a signal by plain SQL, the way a producer in another language does."""
    session.execute(
        text("INSERT INTO dream_signals (kind, user_id, payload) VALUES (:kind, :user_id, :payload)"),
        {"kind": kind, "user_id": user_id, "payload": payload_json},
    )


def backdate(entry: dict[str, Any], at: datetime) -> dict[str, Any]:
    return {**entry, "created_at": at, "updated_at": at}


def bump_access_count(session: Session, table: Table, *, user_id: str, key: str, by: int = 1) -> None:
    """What the host application does on recall: increment ``access_count``."""
    session.execute(
        update(table)
        .where(table.c.user_id == user_id, table.c.key == key)
        .values(access_count=table.c.access_count + by)
    )
