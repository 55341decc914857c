"""Queries on the shared memory table (the host's; contract section 1).

Every removal goes through :func:`remove_entries`, which archives each row whole,
deletes it and records an event in one statement on PostgreSQL (one transaction on
SQLite). The delete re-checks its condition row by row, so an entry the application
updates while Reverie works is left alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from sqlalchemy import ColumnElement, Table, delete, func, insert, literal, literal_column, select
from sqlalchemy.orm import Session

from store.models import ArchivedEntry, Event, memory_table
from store.types import now
from worker.settings import Settings


@dataclass(frozen=True)
class Removed:
    entry_id: str
    user_id: str
    key: str


def table_for(settings: Settings) -> Table:
    """The memory table named by the settings."""
    return memory_table(settings.memory_table, settings.memory_last_access_column)


def jsonable_row(row: Any) -> dict[str, Any]:
    """A memory-table row as the JSON object the archive stores."""
    out: dict[str, Any] = {}
    for key, value in dict(row._mapping).items():
        if isinstance(value, datetime | date):
            value = value.isoformat()
        elif isinstance(value, str) and key in ("value", "group_ids"):
            # SQLite hands JSON back as text when read through a plain select.
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[key] = value
    return out


def remove_entries(
    session: Session,
    table: Table,
    where: ColumnElement[bool],
    *,
    reason: str,
    source: str,
    run_id: int | None = None,
    signal_id: int | None = None,
) -> list[Removed]:
    """Archive, delete and record every row of ``table`` matching ``where``.

    ``reason`` is stored with the archived row (``prune``, ``contradiction``,
    ``summarize``, ``replace``, ``erase``); ``source`` goes into the event.
    """
    if session.get_bind().dialect.name == "postgresql":
        return _remove_pg(session, table, where, reason=reason, source=source, run_id=run_id, signal_id=signal_id)
    return _remove_portable(session, table, where, reason=reason, source=source, run_id=run_id, signal_id=signal_id)


def _remove_pg(
    session: Session,
    table: Table,
    where: ColumnElement[bool],
    *,
    reason: str,
    source: str,
    run_id: int | None,
    signal_id: int | None,
) -> list[Removed]:
    at = now()
    gone = delete(table).where(where).returning(*table.c).cte("gone")
    archived = (
        insert(ArchivedEntry)
        .from_select(
            ["run_id", "signal_id", "user_id", "entry_id", "reason", "row", "archived_at"],
            select(
                literal(run_id, ArchivedEntry.run_id.type),
                literal(signal_id, ArchivedEntry.signal_id.type),
                gone.c.user_id,
                gone.c.id,
                literal(reason),
                # The whole row, including any columns the host added beyond the contract.
                func.to_jsonb(literal_column("gone")),
                literal(at, ArchivedEntry.archived_at.type),
            ).select_from(gone),
        )
        .cte("archived")
    )
    events = (
        insert(Event)
        .from_select(
            ["user_id", "entry_id", "key", "action", "source", "signal_id", "run_id", "at"],
            select(
                gone.c.user_id,
                gone.c.id,
                gone.c.key,
                literal("delete"),
                literal(source),
                literal(signal_id, Event.signal_id.type),
                literal(run_id, Event.run_id.type),
                literal(at, Event.at.type),
            ).select_from(gone),
        )
        .returning(Event.entry_id, Event.user_id, Event.key)
    ).add_cte(archived)
    rows = session.execute(events).all()
    return [Removed(r.entry_id, r.user_id, r.key) for r in rows]


def _remove_portable(
    session: Session,
    table: Table,
    where: ColumnElement[bool],
    *,
    reason: str,
    source: str,
    run_id: int | None,
    signal_id: int | None,
) -> list[Removed]:
    rows = session.execute(select(table).where(where)).all()
    if not rows:
        return []
    at = now()
    ids = [row.id for row in rows]
    session.execute(
        insert(ArchivedEntry),
        [
            {
                "run_id": run_id,
                "signal_id": signal_id,
                "user_id": row.user_id,
                "entry_id": row.id,
                "reason": reason,
                "row": jsonable_row(row),
                "archived_at": at,
            }
            for row in rows
        ],
    )
    for start in range(0, len(ids), 500):
        session.execute(delete(table).where(table.c.id.in_(ids[start : start + 500])))
    removed = [Removed(row.id, row.user_id, row.key) for row in rows]
    record_events(session, removed, action="delete", source=source, run_id=run_id, signal_id=signal_id, at=at)
    return removed


def record_events(
    session: Session,
    entries: list[Removed],
    *,
    action: str,
    source: str,
    run_id: int | None = None,
    signal_id: int | None = None,
    at: datetime | None = None,
) -> None:
    """One ``dream_events`` row per entry (never the value)."""
    if not entries:
        return
    when = at or now()
    session.execute(
        insert(Event),
        [
            {
                "user_id": e.user_id,
                "entry_id": e.entry_id,
                "key": e.key,
                "action": action,
                "source": source,
                "run_id": run_id,
                "signal_id": signal_id,
                "at": when,
            }
            for e in entries
        ],
    )
