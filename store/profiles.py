"""Queries on ``dream_profiles``: which users' memory changed since their profiles were
built, the entries a build reads, writing a user's profiles, and the one read.

A profile row's ``source_*`` columns fingerprint the user's rows it was built from (how
many, the latest ``updated_at``, the sum of ``access_count``, how many are
contradicted, a hash of their contents): a user whose fingerprint is unchanged is not rebuilt.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Table, Text, case, cast, delete, false, func, insert, or_, select
from sqlalchemy.orm import Session

from store.models import EntryState, Profile

#: ``agent_id`` of the agent-less profile (global entries only).
NO_AGENT = ""


@dataclass(frozen=True)
class Fingerprint:
    rows: int = 0
    updated_at: datetime | None = None
    recalls: int = 0
    conflicted: int = 0
    content: int = 0

    @classmethod
    def of(cls, rows: Sequence[Any]) -> Fingerprint:
        """The fingerprint of rows read from the memory table."""
        stamps = [r.updated_at for r in rows if r.updated_at is not None]
        return cls(
            rows=len(rows),
            updated_at=max(stamps) if stamps else None,
            recalls=sum(int(r.access_count or 0) for r in rows),
            conflicted=sum(1 for r in rows if r.conflicted),
            content=sum(int(r.content_hash or 0) for r in rows),
        )


def content_hash(session: Session, table: Table) -> ColumnElement[Any]:
    """A per-row hash of what a profile shows (key, value, category, visibility,
    owner), so an application write that leaves ``updated_at`` alone is seen too.
    PostgreSQL hashes the text; SQLite, which has no hash function, sums lengths."""
    parts = [
        table.c.key,
        func.coalesce(cast(table.c.value, Text), ""),
        func.coalesce(table.c.category, ""),
        func.coalesce(table.c.visibility, ""),
        func.coalesce(table.c.source_agent_id, ""),
    ]
    if session.get_bind().dialect.name == "postgresql":
        return func.hashtext(func.concat_ws("\x1f", *parts))
    return sum((func.length(part) for part in parts[1:]), func.length(parts[0]))


def changed_users(session: Session, table: Table, user_ids: Collection[str]) -> list[str]:
    """The users among ``user_ids`` whose rows differ from what their profiles were
    built from (or who have rows and no profile yet): two set-based statements."""
    users = sorted(set(user_ids))
    if not users:
        return []
    current = {
        row.user_id: Fingerprint(
            int(row.rows), row.updated_at, int(row.recalls or 0), int(row.conflicted or 0), int(row.content or 0)
        )
        for row in session.execute(
            select(
                table.c.user_id,
                func.count().label("rows"),
                func.max(table.c.updated_at).label("updated_at"),
                func.sum(func.coalesce(table.c.access_count, 0)).label("recalls"),
                func.sum(case((table.c.conflicted.is_(True), 1), else_=0)).label("conflicted"),
                func.sum(content_hash(session, table)).label("content"),
            )
            .where(table.c.user_id.in_(users))
            .group_by(table.c.user_id)
        )
    }
    built = {
        row.user_id: Fingerprint(
            row.source_rows, row.source_updated_at, row.source_recalls, row.source_conflicted, row.source_content
        )
        for row in session.execute(
            select(
                Profile.user_id,
                Profile.source_rows,
                Profile.source_updated_at,
                Profile.source_recalls,
                Profile.source_conflicted,
                Profile.source_content,
            ).where(Profile.user_id.in_(users), Profile.agent_id == NO_AGENT)
        )
    }
    return [u for u in users if (u in current or u in built) and current.get(u, Fingerprint()) != built.get(u)]


def entries_for_build(
    session: Session,
    table: Table,
    user_ids: Collection[str],
    *,
    stale: ColumnElement[bool],
    last_access_column: str | None,
) -> list[Any]:
    """Every row of the users, with ``last_recalled_at`` (Reverie's recall look, or the
    host's last-access column where later) and ``stale`` (pruning would remove it)."""
    users = sorted(set(user_ids))
    if not users:
        return []
    recalled: ColumnElement[Any] = EntryState.__table__.c.last_recalled_at
    if last_access_column:
        accessed = table.c[last_access_column]
        recalled = case(
            (EntryState.last_recalled_at.is_(None), accessed),
            (or_(accessed.is_(None), accessed < EntryState.last_recalled_at), EntryState.last_recalled_at),
            else_=accessed,
        )
    stmt = (
        select(
            table.c.id,
            table.c.user_id,
            table.c.key,
            table.c.value,
            table.c.category,
            table.c.visibility,
            table.c.source_agent_id,
            table.c.conflicted,
            table.c.access_count,
            table.c.created_at,
            table.c.updated_at,
            recalled.label("last_recalled_at"),
            content_hash(session, table).label("content_hash"),
            func.coalesce(case((stale, True), else_=False), false()).label("stale"),
        )
        .select_from(table.outerjoin(EntryState, EntryState.entry_id == table.c.id))
        .where(table.c.user_id.in_(users))
        .order_by(table.c.user_id, table.c.id)
    )
    return list(session.execute(stmt).all())


def replace_profiles(session: Session, user_ids: Collection[str], rows: Iterable[dict[str, Any]]) -> int:
    """Make ``rows`` the only profiles of ``user_ids`` (one delete, one insert; the
    caller's transaction, so a reader sees the old set or the new one). Profiles are
    derived from the memory table and rebuilt from it, so the old ones are not kept."""
    users = sorted(set(user_ids))
    if not users:
        return 0
    session.execute(delete(Profile).where(Profile.user_id.in_(users)))
    fresh = list(rows)
    if fresh:
        session.execute(insert(Profile), fresh)
    return len(fresh)


def read(session: Session, user_id: str, agent_id: str | None) -> Profile | None:
    """The profile ``agent_id`` reads (one primary-key lookup): its own, or, for an agent
    that owns no entries of the user, the agent-less one (the global entries, which is
    exactly what such an agent may see)."""
    agents = [NO_AGENT] if not agent_id else [agent_id, NO_AGENT]
    stmt = (
        select(Profile)
        .where(Profile.user_id == user_id, Profile.agent_id.in_(agents))
        .order_by(Profile.agent_id.desc())
        .limit(1)
    )
    return session.scalars(stmt).first()
