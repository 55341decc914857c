"""Read-only summaries of what Reverie did, for ``reverie demo`` and operators."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, and_, func, select
from sqlalchemy.orm import Session

from store.models import ArchivedEntry, Contradiction, Event, Run, Signal


def memory_counts(session: Session, table: Table) -> dict[str, int]:
    rows = session.execute(select(table.c.user_id, func.count()).group_by(table.c.user_id).order_by(table.c.user_id))
    return {user: count for user, count in rows}


def conflicted_entries(session: Session, table: Table) -> list[tuple[str, str, str | None, Any]]:
    rows = session.execute(
        select(table.c.user_id, table.c.key, table.c.source_agent_id, table.c.visibility)
        .where(table.c.conflicted.is_(True))
        .order_by(table.c.user_id, table.c.key)
    )
    return [(r.user_id, r.key, r.source_agent_id, r.visibility) for r in rows]


def runs(session: Session) -> Sequence[Run]:
    return session.scalars(select(Run).order_by(Run.id)).all()


def archived(session: Session) -> list[tuple[str, str, str, int | None, int | None]]:
    """Each archived row: user, reason, key, and the run or the signal that archived it."""
    archive = ArchivedEntry
    rows = session.execute(
        select(archive.user_id, archive.reason, archive.row, archive.run_id, archive.signal_id).order_by(archive.id)
    )
    return [(user, reason, str(row.get("key")), run_id, signal_id) for user, reason, row, run_id, signal_id in rows]


def open_contradictions(session: Session) -> Sequence[Contradiction]:
    return session.scalars(select(Contradiction).where(Contradiction.status == "open").order_by(Contradiction.id)).all()


def signals(session: Session) -> Sequence[Signal]:
    return session.scalars(select(Signal).order_by(Signal.id)).all()


def written_entries(session: Session, table: Table, sources: tuple[str, ...]) -> list[dict[str, Any]]:
    """Entries Reverie wrote from signals (joined to their events), newest last."""
    rows = session.execute(
        select(
            Event.source, Event.action, Event.signal_id, table.c.user_id, table.c.key, table.c.value, table.c.category
        )
        .join(table, and_(table.c.id == Event.entry_id, table.c.user_id == Event.user_id))
        .where(Event.source.in_(sources), Event.action != "delete")
        .order_by(Event.id)
    )
    return [dict(r._mapping) for r in rows]
