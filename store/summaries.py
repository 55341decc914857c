"""The summarizer's write: replace a group of entries by its summary, in one transaction.

The originals are re-read under lock and compared with what the model was shown; if
the application changed any of them meanwhile, nothing is written and the group waits
for the next run. Otherwise they are archived and removed (``remove_entries``) and the
summary entries inserted, so a summary key equal to an original's key survives.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, insert
from sqlalchemy.orm import Session

from store.db import hold_writes
from store.memories import Removed, entries_of, record_events, remove_entries, stored_time, user_keys, whole_rows
from store.types import naive_utc, now


@dataclass(frozen=True)
class NewEntry:
    key: str
    value: Any


def snapshot(row: Any) -> tuple[Any, ...]:
    """What must not have changed between the model call and the write: the groups
    too, as the summary is shared with the groups its originals had when read."""
    return (
        row.id,
        row.key,
        _canonical(row.value),
        row.category,
        row.visibility,
        row.source_agent_id,
        _canonical(row.group_ids),
        row.updated_at,
    )


def _canonical(value: Any) -> str:
    """A JSON column's value as canonical JSON (SQLite may hand JSON back as text)."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    return json.dumps(value, sort_keys=True)


def _taken_keys(session: Session, table: Table, user_id: str) -> set[str]:
    # Every key of the user, whatever its agent or visibility: EDDI's upsert keys would
    # let a global summary share a key with a self one (global entries are unique per
    # (user, key), others per (user, key, agent)), but two groups' summaries under one
    # key would then be read as one fact with two values, a contradiction, and under
    # ``keep_newest`` one group's summary would be archived.
    # (``_gdpr_`` keys are left out: a summary's never is one.)
    return {key for _, key in user_keys(session, table, [user_id])}


def _free_key(key: str, taken: set[str]) -> str:
    if key not in taken:
        return key
    for n in range(2, 1000):
        candidate = f"{key[: 100 - len(str(n)) - 1]}_{n}"
        if candidate not in taken:
            return candidate
    return f"{key[:63]}_{uuid.uuid4().hex}"


def replace_group(
    session: Session,
    table: Table,
    originals: list[Any],
    items: list[NewEntry],
    *,
    run_id: int | None,
) -> list[str] | None:
    """Swap ``originals`` for ``items``; returns the new entry ids, or None when an
    original changed or vanished since it was read (nothing written then)."""
    first = originals[0]
    user_id, visibility, agent_id = first.user_id, first.visibility, first.source_agent_id
    # A group is one user's: its ids name rows only with that user.
    these = entries_of(table, user_id, [row.id for row in originals])
    hold_writes(session)  # SQLite: no edit between this look and the delete
    current = session.execute(whole_rows(session, table).where(these).with_for_update()).all()
    if sorted(map(snapshot, current), key=str) != sorted(map(snapshot, originals), key=str):
        return None
    category = first.category or "fact"
    group_ids: list[Any] = []
    for row in originals:
        raw = row.group_ids
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError:
                raw = []
        for gid in raw or []:
            if gid not in group_ids:
                group_ids.append(gid)
    remove_entries(session, table, these, reason="summarize", source="summarize", run_id=run_id)

    taken = _taken_keys(session, table, user_id)
    at = now()
    # Naive UTC, as ``at`` (a host's ``timestamptz`` column reads with a zone).
    created_at = min((naive_utc(r.created_at) for r in originals if r.created_at is not None), default=at)
    recalls = max((r.access_count or 0 for r in originals), default=0)
    rows: list[dict[str, Any]] = []
    for item in items:
        key = _free_key(item.key, taken)
        taken.add(key)
        rows.append(
            {
                "id": str(uuid.uuid4()),
                "user_id": user_id,
                "key": key,
                "value": item.value,
                "category": category,
                "visibility": visibility,
                "source_agent_id": agent_id,
                "group_ids": sorted(group_ids, key=str),
                "source_conversation_id": None,
                "conflicted": False,
                "access_count": recalls,
                "created_at": _older(created_at, at),
                "updated_at": at,
            }
        )
    written = session.execute(insert(table).returning(table.c.id, stored_time(session, table)), rows)
    record_events(
        session,
        [Removed(r["id"], user_id, r["key"]) for r in rows],
        action="insert",
        source="summarize",
        run_id=run_id,
        at=at,
        stored={entry_id: updated_at for entry_id, updated_at in written},
    )
    return [r["id"] for r in rows]


def _older(a: datetime, b: datetime) -> datetime:
    return a if a <= b else b
