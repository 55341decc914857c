"""Restore: put back, unchanged, the rows a run archived (``reverie restore``).

Entries the run itself inserted (summaries) are taken out first, through
``remove_entries``, so they are archived in turn and nothing is lost either way.
A row whose id or upsert key is taken again by the application is left in the archive
and reported as a conflict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Table, and_, insert, select, update
from sqlalchemy.orm import Session

from store.memories import remove_entries
from store.models import ArchivedEntry, Event, Run
from store.types import now
from worker.errors import NotFound

RESTORABLE = ("prune", "contradiction", "summarize")


@dataclass(frozen=True)
class Restored:
    run_id: int
    restored: int
    conflicts: int
    removed_inserts: int


def restore_run(session: Session, table: Table, run_id: int) -> Restored:
    """Undo a run's removals and inserts (idempotent: a second call restores nothing)."""
    if session.get(Run, run_id) is None:
        raise NotFound("run", run_id)
    inserted = select(Event.entry_id).where(Event.run_id == run_id, Event.action == "insert")
    removed = remove_entries(session, table, table.c.id.in_(inserted), reason="restore", source="restore")
    archived = session.execute(
        select(ArchivedEntry.id, ArchivedEntry.row)
        .where(
            ArchivedEntry.run_id == run_id,
            ArchivedEntry.restored_at.is_(None),
            ArchivedEntry.reason.in_(RESTORABLE),
        )
        .order_by(ArchivedEntry.id)
    ).all()
    restored: list[int] = []
    conflicts = 0
    for archive_id, raw in archived:
        row = _row(table, raw)
        if session.scalar(select(table.c.id).where(_clash(table, row)).limit(1)) is not None:
            conflicts += 1
            continue
        session.execute(insert(table).values(**row))
        restored.append(archive_id)
    if restored:
        session.execute(update(ArchivedEntry).where(ArchivedEntry.id.in_(restored)).values(restored_at=now()))
    return Restored(run_id=run_id, restored=len(restored), conflicts=conflicts, removed_inserts=len(removed))


def _row(table: Table, raw: Any) -> dict[str, Any]:
    data = json.loads(raw) if isinstance(raw, str) else dict(raw)
    row = {name: value for name, value in data.items() if name in table.c}
    for name, column in table.c.items():
        value = row.get(name)
        if isinstance(value, str) and isinstance(column.type, DateTime):
            row[name] = datetime.fromisoformat(value)
    return row


def _clash(table: Table, row: dict[str, Any]) -> Any:
    same_id = table.c.id == row["id"]
    same_key = and_(table.c.user_id == row["user_id"], table.c.key == row["key"])
    if row.get("visibility") == "global":
        taken = and_(same_key, table.c.visibility == "global")
    else:
        agent = row.get("source_agent_id")
        owner = table.c.source_agent_id.is_(None) if agent is None else table.c.source_agent_id == agent
        taken = and_(same_key, table.c.visibility != "global", owner)
    return same_id | taken
