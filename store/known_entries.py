"""Queries on the entries a signal's model is shown, and writes onto one of them.

What one agent may see of one user (EDDI visibility): its own ``self`` and ``group``
entries and every ``global`` entry, never another agent's ``self`` entries. ``_gdpr_``
entries are never shown: they are the application's, and never rewritten.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, and_, or_, select
from sqlalchemy.orm import Session

from store.entry_state import reserved
from store.memories import Upserted, _replace, whole_rows
from store.types import loadable_columns

#: The most entries one look reads, newest first: a prompt shows a few dozen at most.
MAX_VISIBLE = 500


def visible_entries(session: Session, table: Table, user_id: str, agent_id: str | None) -> list[Any]:
    """The user's entries that ``agent_id`` may see, newest first (at most ``MAX_VISIBLE``)."""
    own = table.c.source_agent_id.is_(None) if agent_id is None else table.c.source_agent_id == agent_id
    shown = [
        table.c.id,
        table.c.key,
        table.c.value,
        table.c.category,
        table.c.visibility,
        table.c.source_agent_id,
        table.c.updated_at,
    ]
    stmt = (
        select(*loadable_columns(shown, postgres=session.get_bind().dialect.name == "postgresql"))
        .where(
            table.c.user_id == user_id,
            or_(table.c.visibility == "global", and_(table.c.visibility.in_(("self", "group")), own)),
            ~reserved(table.c.key),
        )
        .order_by(table.c.updated_at.desc(), table.c.id)
        .limit(MAX_VISIBLE)
    )
    return list(session.execute(stmt).all())


def locked_entry(session: Session, table: Table, entry_id: str, user_id: str) -> Any | None:
    """One entry of ``user_id`` by id, locked for update (None if it is gone)."""
    stmt = whole_rows(session, table).where(table.c.id == entry_id, table.c.user_id == user_id).with_for_update()
    return session.execute(stmt).first()


def rewrite_entry(
    session: Session,
    table: Table,
    existing: Any,
    *,
    value: Any,
    category: str,
    source: str,
    source_conversation_id: str | None = None,
    protected_categories: frozenset[str] = frozenset(),
    signal_id: int | None = None,
) -> Upserted:
    """Write a new value onto an existing (locked) entry, keeping its key, id and owner.

    The same rules as an upsert that finds its row: the old row is archived whole first
    (reason ``replace``); ``_gdpr_`` and protected-category entries are never rewritten.
    """
    return _replace(
        session,
        table,
        existing,
        value=value,
        category=category,
        source=source,
        source_conversation_id=source_conversation_id,
        protected_categories=protected_categories,
        signal_id=signal_id,
        run_id=None,
    )
