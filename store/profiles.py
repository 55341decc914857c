"""Queries on ``dream_profiles``: which users' memory changed since their profiles were
built, the entries a build reads, writing a user's profiles, and the one read.

A profile row's ``source_*`` columns fingerprint the user's rows it was built from (how
many, the latest ``updated_at``, the sum of ``access_count``, how many are
contradicted, a hash of their contents): a user whose fingerprint is unchanged is not rebuilt.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from operator import itemgetter
from typing import Any

from sqlalchemy import (
    ColumnElement,
    DateTime,
    Select,
    String,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    false,
    func,
    or_,
    select,
    text,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from store.bulk import insert_rows
from store.entry_state import prunable_where, users_in
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
        """The fingerprint of rows read by :func:`entries_for_build` (a column at a time)."""
        if not rows:
            return cls()
        stamps = [s for s in map(_updated_at, rows) if s is not None]
        return cls(
            rows=len(rows),
            updated_at=max(stamps) if stamps else None,
            recalls=sum(int(r or 0) for r in map(_access_count, rows)),
            conflicted=sum(1 for c in map(_conflicted, rows) if c),
            content=sum(int(h or 0) for h in map(_content_hash, rows)),
        )


def among(session: Session, column: Any, values: Sequence[str]) -> ColumnElement[bool]:
    """``column IN values``; on PostgreSQL as ``= ANY(array)``, one parameter whatever
    the number of values (the statement's text, and so its parsing, is the same each time)."""
    return users_in(column, values, array=session.get_bind().dialect.name == "postgresql")


def content_hash(session: Session, table: Table) -> ColumnElement[Any]:
    """A per-row hash of what a profile shows (key, value, category, visibility,
    owner), so an application write that leaves ``updated_at`` alone is seen too.
    PostgreSQL hashes the text; SQLite, which has no hash function, sums lengths."""
    if session.get_bind().dialect.name == "postgresql":
        return _pg_content_hash(table)
    parts = _shown_parts(table)
    return sum((func.length(part) for part in parts[1:]), func.length(parts[0]))


def _shown_parts(table: Table) -> list[ColumnElement[Any]]:
    return [
        table.c.key,
        func.coalesce(cast(table.c.value, Text), ""),
        func.coalesce(table.c.category, ""),
        func.coalesce(table.c.visibility, ""),
        func.coalesce(table.c.source_agent_id, ""),
    ]


def _pg_content_hash(table: Table) -> ColumnElement[Any]:
    return func.hashtext(func.concat_ws("\x1f", *_shown_parts(table)))


def changed_users(session: Session, table: Table, user_ids: Collection[str]) -> list[str]:
    """The users among ``user_ids`` whose rows differ from what their profiles were
    built from (or who have rows and no profile yet). On PostgreSQL one statement
    compares the fingerprints and returns the changed users only; elsewhere two
    set-based statements read them and they are compared here."""
    users = sorted(set(user_ids))
    if not users:
        return []
    if session.get_bind().dialect.name == "postgresql":
        return sorted(session.connection().execute(_changed_statement(table), {"ids": users}).scalars())
    return compare_fingerprints(session, table, users)


def compare_fingerprints(session: Session, table: Table, users: Sequence[str]) -> list[str]:
    """:func:`changed_users` as two statements and a comparison here (any database)."""
    current = {
        row.user_id: Fingerprint(
            int(row.rows), row.updated_at, int(row.recalls or 0), int(row.conflicted or 0), int(row.content or 0)
        )
        for row in session.execute(
            _current_fingerprints(table, among(session, table.c.user_id, users), content_hash(session, table))
        )
    }
    built = {
        row.user_id: Fingerprint(
            row.source_rows, row.source_updated_at, row.source_recalls, row.source_conflicted, row.source_content
        )
        for row in session.execute(_stored_fingerprints(among(session, Profile.user_id, users)))
    }
    return [u for u in users if (u in current or u in built) and current.get(u, Fingerprint()) != built.get(u)]


def _current_fingerprints(table: Table, of_users: ColumnElement[bool], hashed: ColumnElement[Any]) -> Select[Any]:
    """Each of the users' fingerprint now, from their rows (one row per user with rows)."""
    return (
        select(
            table.c.user_id.label("user_id"),
            func.count().label("rows"),
            func.max(table.c.updated_at).label("updated_at"),
            func.sum(func.coalesce(table.c.access_count, 0)).label("recalls"),
            func.sum(case((table.c.conflicted.is_(True), 1), else_=0)).label("conflicted"),
            func.sum(hashed).label("content"),
        )
        .where(of_users)
        .group_by(table.c.user_id)
    )


def _stored_fingerprints(of_users: ColumnElement[bool]) -> Select[Any]:
    """The fingerprint each of the users' profiles were built from (kept on the agent-less one)."""
    return select(
        Profile.user_id,
        Profile.source_rows,
        Profile.source_updated_at,
        Profile.source_recalls,
        Profile.source_conflicted,
        Profile.source_content,
    ).where(of_users, Profile.agent_id == NO_AGENT)


@lru_cache(maxsize=8)
def _changed_statement(table: Table) -> Select[tuple[str]]:
    """:func:`changed_users` as one PostgreSQL statement (built once per table; the users
    are its one parameter, ``ids``): each user's current fingerprint against the one
    stored with their agent-less profile, a user with no rows counting as the empty
    fingerprint (as :class:`Fingerprint` does)."""
    ids = bindparam("ids", type_=ARRAY(String))
    current = _current_fingerprints(table, table.c.user_id == any_(ids), _pg_content_hash(table)).subquery("current")
    built = _stored_fingerprints(Profile.user_id == any_(ids)).subquery("built")
    now = tuple_(
        func.coalesce(current.c.rows, 0),
        current.c.updated_at,
        func.coalesce(current.c.recalls, 0),
        func.coalesce(current.c.conflicted, 0),
        func.coalesce(current.c.content, 0),
    )
    then = tuple_(
        built.c.source_rows,
        built.c.source_updated_at,
        built.c.source_recalls,
        built.c.source_conflicted,
        built.c.source_content,
    )
    return (
        select(func.coalesce(current.c.user_id, built.c.user_id))
        .select_from(current.join(built, current.c.user_id == built.c.user_id, full=True))
        .where(now.is_distinct_from(then))
    )


def entries_for_build(
    session: Session,
    table: Table,
    user_ids: Collection[str],
    *,
    agent_cutoffs: Mapping[str, datetime | None],
    default_cutoff: datetime | None,
    protected_categories: Collection[str],
    last_access_column: str | None,
) -> tuple[list[Any], bool]:
    """Every row of the users, with ``last_recalled_at`` (Reverie's recall look, or the
    host's last-access column where later), ``stale`` (pruning would remove it: the
    cutoffs and protection as :func:`store.entry_state.prunable_where` takes them), and
    ``value_json``, the value as JSON text (the builder shows it without a JSON object
    made of it where it can). Read in the order of ``BUILD_COLUMNS``.

    Returns the rows and whether they come ranked: on PostgreSQL the rows of each user
    come in the profiles' documented order (see :func:`rank_order`), so the builder does
    not rank them; elsewhere they come by user and id, and the builder ranks them. On
    PostgreSQL the statement is built once for each shape of the policies (which agents
    prune), and the users and cutoffs are its parameters."""
    users = sorted(set(user_ids))
    if not users:
        return [], False
    if session.get_bind().dialect.name == "postgresql":
        agents = tuple((agent, cutoff is not None) for agent, cutoff in agent_cutoffs.items())
        stmt = _pg_build_statement(
            table, agents, default_cutoff is not None, tuple(sorted(protected_categories)), last_access_column
        )
        params: dict[str, Any] = {"ids": users, "cutoff_default": default_cutoff}
        params.update((f"cutoff_{i}", cutoff) for i, cutoff in enumerate(agent_cutoffs.values()))
        return list(session.connection().execute(stmt, params).all()), True
    stale = prunable_where(
        table,
        users,
        agent_cutoffs=agent_cutoffs,
        default_cutoff=default_cutoff,
        owners=None,
        protected_categories=protected_categories,
        last_access_column=last_access_column,
    )
    stmt = _build_statement(
        table, table.c.user_id.in_(users), stale, last_access_column, content_hash(session, table), ranked=False
    )
    # Through the connection: plain rows, without the ORM's loading of each one.
    return list(session.connection().execute(stmt).all()), False


@lru_cache(maxsize=64)
def _pg_build_statement(
    table: Table,
    agents: tuple[tuple[str, bool], ...],
    default_prunes: bool,
    protected_categories: tuple[str, ...],
    last_access_column: str | None,
) -> Select[Any]:
    """:func:`entries_for_build`'s PostgreSQL statement for one shape of the policies
    (``agents``: each agent with a policy of its own, and whether it prunes), with the
    parameters ``ids`` (the users), ``cutoff_<i>`` (the i-th agent's cutoff) and
    ``cutoff_default``."""
    ids = bindparam("ids", type_=ARRAY(String))
    stale = prunable_where(
        table,
        ids,
        agent_cutoffs={
            agent: bindparam(f"cutoff_{i}", type_=DateTime()) if prunes else None
            for i, (agent, prunes) in enumerate(agents)
        },
        default_cutoff=bindparam("cutoff_default", type_=DateTime()) if default_prunes else None,
        owners=None,
        protected_categories=protected_categories,
        last_access_column=last_access_column,
        array=True,
    )
    return _build_statement(
        table, table.c.user_id == any_(ids), stale, last_access_column, _pg_content_hash(table), ranked=True
    )


def _build_statement(
    table: Table,
    of_users: ColumnElement[bool],
    stale: ColumnElement[bool],
    last_access_column: str | None,
    hashed: ColumnElement[Any],
    *,
    ranked: bool,
) -> Select[Any]:
    recalled: ColumnElement[Any] = EntryState.__table__.c.last_recalled_at
    if last_access_column:
        accessed = table.c[last_access_column]
        recalled = case(
            (EntryState.last_recalled_at.is_(None), accessed),
            (or_(accessed.is_(None), accessed < EntryState.last_recalled_at), EntryState.last_recalled_at),
            else_=accessed,
        )
    order: list[ColumnElement[Any]] = [table.c.user_id]
    order += rank_order(table, recalled) if ranked else [table.c.id]
    return (
        select(
            table.c.id,
            table.c.user_id,
            table.c.key,
            cast(table.c.value, Text).label("value_json"),
            table.c.category,
            table.c.visibility,
            table.c.source_agent_id,
            table.c.conflicted,
            table.c.access_count,
            table.c.created_at,
            table.c.updated_at,
            recalled.label("last_recalled_at"),
            hashed.label("content_hash"),
            func.coalesce(case((stale, True), else_=False), false()).label("stale"),
        )
        .select_from(
            table.outerjoin(EntryState, and_(EntryState.entry_id == table.c.id, EntryState.user_id == table.c.user_id))
        )
        .where(of_users)
        .order_by(*order)
    )


#: The positions of :func:`entries_for_build`'s columns (the builder reads rows by position).
BUILD_COLUMNS = (
    "id",
    "user_id",
    "key",
    "value_json",
    "category",
    "visibility",
    "source_agent_id",
    "conflicted",
    "access_count",
    "created_at",
    "updated_at",
    "last_recalled_at",
    "content_hash",
    "stale",
)
_conflicted, _access_count, _updated_at, _content_hash = (
    itemgetter(BUILD_COLUMNS.index(name)) for name in ("conflicted", "access_count", "updated_at", "content_hash")
)

#: Category priority in the ranking (lowest first); any other category ranks ``4``.
CATEGORY_PRIORITY = {"property": 0, "fact": 1, "preference": 2, "context": 3, "legacy": 5}
OTHER_CATEGORY_PRIORITY = 4


def rank_order(table: Table, recalled: ColumnElement[Any]) -> list[ColumnElement[Any]]:
    """The profiles' ranking as PostgreSQL ``ORDER BY`` terms, most important first:
    the day of the latest of updated, created and recalled (newest first, none last),
    recalls, category priority, that exact time, then key and id in code-point order
    (``COLLATE "C"``: UTF-8 byte order is code-point order, as Python compares text).
    ``tasks.profiles.rank_key`` is the same order in Python; a test holds them equal."""
    touched = func.greatest(table.c.updated_at, table.c.created_at, recalled)
    category = func.lower(func.coalesce(table.c.category, "fact"))
    return [
        func.date_trunc("day", touched).desc().nulls_last(),
        func.coalesce(table.c.access_count, 0).desc(),
        case(CATEGORY_PRIORITY, value=category, else_=OTHER_CATEGORY_PRIORITY),
        touched.desc().nulls_last(),
        table.c.key.collate("C"),
        table.c.id.collate("C"),
    ]


def replace_profiles(session: Session, user_ids: Collection[str], rows: Iterable[dict[str, Any]]) -> int:
    """Make ``rows`` the only profiles of ``user_ids`` (one delete, one insert; the
    caller's transaction, so a reader sees the old set or the new one). Profiles are
    derived from the memory table and rebuilt from it, so the old ones are not kept."""
    users = sorted(set(user_ids))
    if not users:
        return 0
    session.execute(delete(Profile).where(Profile.user_id.in_(users)))
    fresh = list(rows)
    return insert_rows(session, Profile, fresh)


def texts(session: Session, user_ids: Collection[str]) -> dict[tuple[str, str], str]:
    """The stored text of every profile of ``user_ids``, keyed by (user, agent)."""
    users = sorted(set(user_ids))
    if not users:
        return {}
    stmt = select(Profile.user_id, Profile.agent_id, Profile.text).where(Profile.user_id.in_(users))
    return {(row.user_id, row.agent_id): row.text for row in session.execute(stmt)}


_READ_COLUMNS = "user_id, agent_id, text, tokens, budget, entries_included, entries_left_out, built_at"
_READ_WHERE = (
    "FROM dream_profiles WHERE user_id = :user_id AND agent_id IN (:agent_id, '') ORDER BY agent_id DESC LIMIT 1"
)
_READ_TYPES = {"built_at": Profile.__table__.c.built_at.type, "layout": Profile.__table__.c.layout.type}
# Plain statements built once: a read is on every prompt, so it skips building and
# keying an expression each time. The layout is sent only when a cut needs it.
_READ = text(f"SELECT {_READ_COLUMNS}, NULL AS layout {_READ_WHERE}").columns(**_READ_TYPES)
_READ_FOR_CUT = text(
    f"SELECT {_READ_COLUMNS}, CASE WHEN tokens > :over THEN layout END AS layout {_READ_WHERE}"
).columns(**_READ_TYPES)


def read(session: Session, user_id: str, agent_id: str | None, *, layout_over: int | None = None) -> Any:
    """The profile ``agent_id`` reads (one primary-key lookup): its own, or, for an agent
    that owns no entries of the user, the agent-less one (the global entries, which is
    exactly what such an agent may see). A row of the columns a reader needs (None: no
    profile); its ``layout`` is read only when the profile holds more than
    ``layout_over`` tokens (a reader's cut needs it then), else it is None."""
    params: dict[str, Any] = {"user_id": user_id, "agent_id": agent_id or NO_AGENT}
    if layout_over is None:
        return session.execute(_READ, params).first()
    return session.execute(_READ_FOR_CUT, {**params, "over": layout_over}).first()
