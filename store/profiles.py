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
from typing import Any, NamedTuple

from sqlalchemy import (
    ColumnElement,
    Connection,
    DateTime,
    FromClause,
    Integer,
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
    null,
    or_,
    select,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from store.bulk import insert_rows
from store.db import SQLITE_HASH, driver_cursor
from store.entry_state import prunable_where, users_in
from store.models import PG_MODEL_WRITTEN, SQLITE_MODEL_WRITTEN, EntryState, Profile, query_name
from store.types import in_range_time, naive_utc

#: ``agent_id`` of the agent-less profile (shared entries only: global ones and the self ones no agent owns).
NO_AGENT = ""
#: The longest agent id a profile can be kept under (``dream_profiles.agent_id``).
MAX_AGENT_ID: int = Profile.__table__.c.agent_id.type.length  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Fingerprint:
    rows: int = 0
    updated_at: datetime | None = None
    recalls: int = 0
    conflicted: int = 0
    content: int = 0

    def __post_init__(self) -> None:
        # As stored (naive UTC), whatever the host's column: a ``timestamptz`` one reads
        # with a zone, and would never equal the stored one.
        if self.updated_at is not None and self.updated_at.tzinfo is not None:
            object.__setattr__(self, "updated_at", naive_utc(self.updated_at))

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


def content_hash(session: Session, table: Table, last_access_column: str | None = None) -> ColumnElement[Any]:
    """A per-row hash of what a profile shows and ranks by (key, value, category,
    visibility, owner, the contradicted mark, ``access_count``, the row's times and the
    host's last-access column), so any change to one row is seen, whoever made it: an
    application write that leaves ``updated_at`` alone, an older row's time moved, a
    recall recorded in the host's column, recalls or a mark moved from one row to
    another. PostgreSQL hashes the parts' text with ``hashtext``; SQLite with the
    function every connection of Reverie's has (:func:`store.db.sqlite_hash`)."""
    if session.get_bind().dialect.name == "postgresql":
        return _pg_content_hash(table, last_access_column)
    ranked = [table.c.conflicted, table.c.access_count, *_ranked_times(table, last_access_column)]
    hashed: ColumnElement[Any] = getattr(func, SQLITE_HASH)(*_shown_parts(table), *ranked)
    return hashed


def _shown_parts(table: Table) -> list[ColumnElement[Any]]:
    return [
        table.c.key,
        func.coalesce(cast(table.c.value, Text), ""),
        func.coalesce(table.c.category, ""),
        func.coalesce(table.c.visibility, ""),
        func.coalesce(table.c.source_agent_id, ""),
    ]


def _ranked_times(table: Table, last_access_column: str | None) -> list[ColumnElement[Any]]:
    """The row's times a profile's ranking reads (the host's last access where it has one)."""
    times: list[ColumnElement[Any]] = [table.c.created_at, table.c.updated_at]
    return [*times, table.c[last_access_column]] if last_access_column else times


def _pg_content_hash(table: Table, last_access_column: str | None) -> ColumnElement[Any]:
    # Each column hashed by its type's own hash function (``hash_record``: a time by its
    # value, whatever the session's TimeZone and DateStyle, ``infinity`` included; a NULL
    # as itself), with no text made of it: half the cost of hashing the row's text. The
    # value as ``jsonb`` (a no-op for EDDI's column), which has a hash where ``json`` has
    # none. ``hash_record`` adds its columns' hashes up (times 31 each), so a sum of it
    # would miss two rows swapping a column's values: it is hashed once more, which mixes.
    parts = [
        table.c.key,
        cast(table.c.value, JSONB),
        table.c.category,
        table.c.visibility,
        table.c.source_agent_id,
        table.c.conflicted,
        table.c.access_count,
        *_ranked_times(table, last_access_column),
    ]
    return func.hashint4(func.hash_record(func.row(*parts)))


class BuiltWith(NamedTuple):
    """The settings profiles are built with: one built with others is built again."""

    budget: int
    tokenizer: str


@dataclass(frozen=True)
class BuildRead:
    """What a build reads: the users whose memory changed (sorted), the fingerprint of
    each one's rows as read, and each one's shown rows (not stale), whose first columns
    are ``SHOWN_COLUMNS``; ``ranked``: the rows of each user come in the profiles'
    documented order (see :func:`rank_order`), else by id and carrying every column of
    ``BUILD_COLUMNS``, for the builder to rank."""

    users: list[str]
    prints: dict[str, Fingerprint]
    rows: dict[str, list[Any]]
    ranked: bool


def read_for_build(
    session: Session,
    table: Table,
    user_ids: Collection[str],
    *,
    changed: Collection[str] = (),
    agent_cutoffs: Mapping[str, datetime | None],
    default_cutoff: datetime | None,
    protected_categories: Collection[str],
    last_access_column: str | None,
    built_with: BuiltWith | None = None,
) -> BuildRead:
    """The users among ``user_ids`` whose rows differ from what their profiles were built
    from (or who have rows and no profile yet), or whose profiles were built with another
    budget or tokenizer than ``built_with`` (the settings changed since), with ``changed``
    (users known to have changed) counted in whatever their fingerprint says, and their rows. Stale rows
    (pruning would remove them: the cutoffs and protection as
    :func:`store.entry_state.prunable_where` takes them) count in the fingerprint and
    are not returned.

    On PostgreSQL this is one statement, built once for each shape of the policies
    (which agents prune), with the users and cutoffs as its parameters: every row is
    hashed once into its user's fingerprint, the fingerprints are compared there, and
    only the changed users' shown rows are then looked up, and come back ranked and
    with the columns a line needs. Elsewhere, and on
    a Citus cluster (whose planner does not take the one statement's per-user lookup,
    a correlated subquery with ``OFFSET``), the fingerprints are compared here
    (:func:`compare_fingerprints`) and the changed users' rows are read by
    :func:`entries_for_build`."""
    users = sorted(set(user_ids))
    if not users:
        return BuildRead([], {}, {}, ranked=False)
    policy: dict[str, Any] = {
        "agent_cutoffs": agent_cutoffs,
        "default_cutoff": default_cutoff,
        "protected_categories": protected_categories,
        "last_access_column": last_access_column,
    }
    if session.get_bind().dialect.name == "postgresql" and not _on_citus(session):
        return _read_for_build_pg(session, table, users, sorted(set(changed) & set(users)), built_with, **policy)
    known = set(changed) & set(users)
    looked = set(compare_fingerprints(session, table, sorted(set(users) - known), last_access_column, built_with))
    changed_users = sorted(known | looked)
    if not changed_users:
        return BuildRead([], {}, {}, ranked=False)
    rows: dict[str, list[Any]] = {u: [] for u in changed_users}
    for row in entries_for_build(session, table, changed_users, **policy):
        rows[row.user_id].append(row)
    prints = {u: Fingerprint.of(mine) for u, mine in rows.items()}
    shown = {u: [row for row in mine if not row.stale] for u, mine in rows.items()}
    return BuildRead(changed_users, prints, shown, ranked=False)


def _on_citus(session: Session) -> bool:
    """Whether the database is a Citus cluster (looked up once per connection)."""
    info = session.connection().connection.info
    if "reverie_citus" not in info:
        found = session.connection().exec_driver_sql(_CITUS).scalar()
        info["reverie_citus"] = bool(found)
    return bool(info["reverie_citus"])


_CITUS = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')"


def _read_for_build_pg(
    session: Session,
    table: Table,
    users: list[str],
    changed: list[str],
    built_with: BuiltWith | None,
    *,
    agent_cutoffs: Mapping[str, datetime | None],
    default_cutoff: datetime | None,
    protected_categories: Collection[str],
    last_access_column: str | None,
) -> BuildRead:
    agents = tuple((agent, cutoff is not None) for agent, cutoff in agent_cutoffs.items())
    sql, defaults = _pg_build_sql(
        session.get_bind().dialect,
        table,
        agents=agents,
        default_prunes=default_cutoff is not None,
        protected_categories=tuple(sorted(protected_categories)),
        last_access_column=last_access_column,
    )
    params = {**defaults, "ids": users, "changed": changed, "cutoff_default": default_cutoff}
    params.update(built_with._asdict() if built_with else {"budget": None, "tokenizer": None})
    params.update((f"cutoff_{i}", cutoff) for i, cutoff in enumerate(agent_cutoffs.values()))
    # Read on the session's own connection (its transaction) as plain tuples: the read
    # is of every shown row of every changed user, and making a result row of each
    # costs more than reading it.
    with driver_cursor(session) as cursor:
        # Compiled just in time (its estimated cost for a chunk's users is over the
        # default ``jit_above_cost``), the statement takes three times as long; and its
        # sort of a chunk's rows (a few MB) spills to disk under the default ``work_mem``
        # (4 MB), a third of its time. JIT is off and ``work_mem`` larger for it alone,
        # then both are put back as they were for the rest of the caller's transaction
        # (a server without JIT is left without it).
        jit, work_mem = cursor.execute(_SETTINGS).fetchone() or (None, None)
        cursor.execute(_SET_JIT if jit is not None else _SET, {"jit": "off", "work_mem": _BUILD_WORK_MEM})
        fetched = cursor.execute(sql, params).fetchall()
        cursor.execute(_SET_JIT if jit is not None else _SET, {"jit": jit, "work_mem": work_mem})
    prints: dict[str, Fingerprint] = {}
    rows: dict[str, list[Any]] = {}
    mine: list[Any] = []
    current = None
    for row in fetched:
        user_id = row[0]
        if user_id != current:
            current = user_id
            mine = rows[user_id] = []
            rows_, updated_at, recalls, conflicted, content = row[_PRINT_AT:]
            prints[user_id] = Fingerprint(int(rows_), updated_at, int(recalls), int(conflicted), int(content))
        if row[_ID_AT] is not None:  # None: no shown row (the user's one row of the outer join)
            mine.append(row)
    for user_id in changed:
        # Known to have changed, with no rows and no profile: the empty fingerprint.
        if user_id not in rows:
            rows[user_id], prints[user_id] = [], Fingerprint()
    return BuildRead(sorted(rows), prints, rows, ranked=True)


_SETTINGS = "SELECT current_setting('jit', true), current_setting('work_mem')"
_SET = "SELECT set_config('work_mem', %(work_mem)s, true)"
_SET_JIT = "SELECT set_config('work_mem', %(work_mem)s, true), set_config('jit', %(jit)s, true)"
#: What the build's sort of a chunk's rows gets (its own statement only).
_BUILD_WORK_MEM = "64MB"


def compare_fingerprints(
    session: Session,
    table: Table,
    users: Sequence[str],
    last_access_column: str | None = None,
    built_with: BuiltWith | None = None,
) -> list[str]:
    """The users among ``users`` whose rows differ from what their profiles were built
    from (or who have rows and no profile yet), or whose profiles were built with another
    budget or tokenizer than ``built_with``: their fingerprints read by two set-based
    statements and compared here (any database)."""
    if not users:
        return []
    current = {
        row.user_id: Fingerprint(
            int(row.rows), row.updated_at, int(row.recalls or 0), int(row.conflicted or 0), int(row.content or 0)
        )
        for row in session.execute(
            _current_fingerprints(
                table,
                among(session, table.c.user_id, users),
                content_hash(session, table, last_access_column),
                finite=session.get_bind().dialect.name == "postgresql",
            )
        )
    }
    stored = built_from(session, users)
    built = {user_id: fingerprint for user_id, (fingerprint, _) in stored.items()}
    # Built with other settings than the ones given.
    other = {user_id for user_id, (_, with_) in stored.items() if built_with is not None and with_ != built_with}
    return [
        u
        for u in users
        if u in other or ((u in current or u in built) and current.get(u, Fingerprint()) != built.get(u))
    ]


def _current_fingerprints(
    rows: FromClause, of_users: ColumnElement[bool] | None, hashed: ColumnElement[Any], *, finite: bool = False
) -> Select[Any]:
    """Each of the users' fingerprint now, from their rows (one row per user with rows).
    ``finite``: the latest ``updated_at`` as a time Python holds (:func:`store.types.in_range_time`)."""
    latest: ColumnElement[Any] = func.max(rows.c.updated_at)
    stmt = select(
        rows.c.user_id.label("user_id"),
        func.count().label("rows"),
        (in_range_time(latest) if finite else latest).label("updated_at"),
        func.sum(func.coalesce(rows.c.access_count, 0)).label("recalls"),
        func.sum(case((rows.c.conflicted.is_(True), 1), else_=0)).label("conflicted"),
        func.sum(hashed).label("content"),
    ).group_by(rows.c.user_id)
    return stmt if of_users is None else stmt.where(of_users)


def _stored_fingerprints(of_users: ColumnElement[bool]) -> Select[Any]:
    """The fingerprint each of the users' profiles were built from (kept on the agent-less one)."""
    return select(
        Profile.user_id,
        Profile.source_rows,
        Profile.source_updated_at,
        Profile.source_recalls,
        Profile.source_conflicted,
        Profile.source_content,
        Profile.budget,
        Profile.tokenizer,
    ).where(of_users, Profile.agent_id == NO_AGENT)


#: The statement's subqueries' names (the per-user lookup names the changed users from
#: inside a FROM that holds the host's table: a table called ``changed`` was once read
#: as the changed users, and every user's rows matched).
_CURRENT, _BUILT, _CHANGED, _ENTRIES = map(query_name, ("current", "built", "changed", "entries"))


@lru_cache(maxsize=64)
def _pg_build_sql(
    dialect: Dialect,
    table: Table,
    *,
    agents: tuple[tuple[str, bool], ...],
    default_prunes: bool,
    protected_categories: tuple[str, ...],
    last_access_column: str | None,
) -> tuple[str, dict[str, Any]]:
    """:func:`read_for_build`'s PostgreSQL statement for one shape of the policies
    (``agents``: each agent with a policy of its own, and whether it prunes), as the SQL
    of the session's driver (``dialect``) and the values of its constant parameters.
    Its parameters: ``ids`` (the users), ``changed`` (those known to have changed),
    ``cutoff_<i>`` (the i-th agent's cutoff) and ``cutoff_default``.

    ``current`` is each user's fingerprint now; ``changed`` the users whose fingerprint
    differs from the one stored with their agent-less profile (a user with no rows
    counting as the empty fingerprint, as :class:`Fingerprint` does), or who are known
    to have changed, with their fingerprint; ``entries`` each changed user's shown
    rows, looked up by user. They come out ranked, each carrying the user's fingerprint
    (``PRINT_COLUMNS``), and a changed user with no shown row as one row of NULLs."""
    ids = bindparam("ids", None, type_=ARRAY(String))  # values: given when it runs
    stale = prunable_where(
        table,
        ids,
        agent_cutoffs={
            agent: bindparam(f"cutoff_{i}", None, type_=DateTime()) if prunes else None
            for i, (agent, prunes) in enumerate(agents)
        },
        default_cutoff=bindparam("cutoff_default", None, type_=DateTime()) if default_prunes else None,
        owners=None,
        protected_categories=protected_categories,
        last_access_column=last_access_column,
        array=True,
    )
    current = _current_fingerprints(
        table, table.c.user_id == any_(ids), _pg_content_hash(table, last_access_column), finite=True
    ).subquery(_CURRENT)
    built = _stored_fingerprints(Profile.user_id == any_(ids)).subquery(_BUILT)
    user_id = func.coalesce(current.c.user_id, built.c.user_id)
    now = (
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
    known = bindparam("changed", None, type_=ARRAY(String))
    changed = (
        select(user_id.label("user_id"), *(value.label(name) for value, name in zip(now, PRINT_COLUMNS, strict=True)))
        .select_from(current.join(built, current.c.user_id == built.c.user_id, full=True))
        .where(
            or_(
                tuple_(*now).is_distinct_from(then),
                user_id == any_(known),
                # Built with other settings (no value given: not compared).
                built.c.budget != func.coalesce(bindparam("budget", None, type_=Integer()), built.c.budget),
                built.c.tokenizer != func.coalesce(bindparam("tokenizer", None, type_=String()), built.c.tokenizer),
            )
        )
        .subquery(_CHANGED)
    )
    # Each changed user's shown rows, looked up by user (the rows of the others are only
    # aggregated above), without their hash.
    entries = (
        _build_statement(table, table.c.user_id == changed.c.user_id, stale, last_access_column, None)
        .where(_flag(stale).is_(False))
        .offset(0)  # kept a subquery: an index lookup per changed user, not a scan of them all
        .lateral(_ENTRIES)
    )
    stmt = (
        select(
            changed.c.user_id,
            *(entries.c[name] for name in SHOWN_COLUMNS[1:]),
            entries.c.id,
            *(changed.c[name] for name in PRINT_COLUMNS),
        )
        .select_from(changed.outerjoin(entries, true()))
        .order_by(changed.c.user_id, *rank_order(entries, entries.c.last_recalled_at))
    )
    # Lists of constants (``IN``) rendered as one parameter each, once, here.
    compiled = stmt.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
    defaults = {name: value for name, value in compiled.params.items() if value is not None}
    return compiled.string, defaults


def entries_for_build(
    session: Session,
    table: Table,
    user_ids: Collection[str],
    *,
    agent_cutoffs: Mapping[str, datetime | None],
    default_cutoff: datetime | None,
    protected_categories: Collection[str],
    last_access_column: str | None,
) -> list[Any]:
    """Every row of the users (stale ones too), by user and id, with the columns of
    ``BUILD_COLUMNS``: ``last_recalled_at`` (Reverie's recall look, or the host's
    last-access column where later), ``stale`` (pruning would remove it: the cutoffs and
    protection as :func:`store.entry_state.prunable_where` takes them), and
    ``value_json``, the value as JSON text (the builder shows it without a JSON object
    made of it where it can). Any database; :func:`read_for_build` reads PostgreSQL's
    in one statement with the look at who changed."""
    users = sorted(set(user_ids))
    if not users:
        return []
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
        table,
        table.c.user_id.in_(users),
        stale,
        last_access_column,
        content_hash(session, table, last_access_column),
        finite=session.get_bind().dialect.name == "postgresql",
    ).order_by(table.c.user_id, table.c.id)
    # Through the connection: plain rows, without the ORM's loading of each one.
    return list(session.connection().execute(stmt).all())


def _build_statement(
    table: Table,
    of_users: ColumnElement[bool],
    stale: ColumnElement[bool],
    last_access_column: str | None,
    hashed: ColumnElement[Any] | None,
    *,
    finite: bool = False,
) -> Select[Any]:
    """The users' rows with the columns of ``BUILD_COLUMNS``, in that order (a NULL
    ``content_hash`` where ``hashed`` is None). ``finite``: the rows' times and the
    host's last access as times Python holds (:func:`store.types.in_range_time`), for
    rows ranked in Python."""
    recalled: ColumnElement[Any] = EntryState.__table__.c.last_recalled_at
    created_at: ColumnElement[Any] = table.c.created_at
    updated_at: ColumnElement[Any] = table.c.updated_at
    if finite:
        created_at, updated_at = (
            in_range_time(created_at).label("created_at"),
            in_range_time(updated_at).label("updated_at"),
        )
    if last_access_column:
        accessed: ColumnElement[Any] = table.c[last_access_column]
        if finite:
            accessed = in_range_time(accessed)
        recalled = case(
            (EntryState.last_recalled_at.is_(None), accessed),
            (or_(accessed.is_(None), accessed < EntryState.last_recalled_at), EntryState.last_recalled_at),
            else_=accessed,
        )
    return (
        select(
            table.c.user_id,
            table.c.key,
            cast(table.c.value, Text).label("value_json"),
            table.c.category,
            table.c.visibility,
            table.c.source_agent_id,
            table.c.conflicted,
            table.c.id,
            table.c.access_count,
            created_at,
            updated_at,
            recalled.label("last_recalled_at"),
            (null() if hashed is None else hashed).label("content_hash"),
            _flag(stale).label("stale"),
        )
        .select_from(
            table.outerjoin(EntryState, and_(EntryState.entry_id == table.c.id, EntryState.user_id == table.c.user_id))
        )
        .where(of_users)
    )


def _flag(condition: ColumnElement[bool]) -> ColumnElement[bool]:
    """``condition`` as true or false (never NULL)."""
    return func.coalesce(case((condition, True), else_=False), false())


#: The columns a line is made of, first in every row a build reads (the builder reads them by position).
SHOWN_COLUMNS = ("user_id", "key", "value_json", "category", "visibility", "source_agent_id", "conflicted")
#: The columns of :func:`entries_for_build`'s rows, in order.
BUILD_COLUMNS = (
    *SHOWN_COLUMNS,
    "id",
    "access_count",
    "created_at",
    "updated_at",
    "last_recalled_at",
    "content_hash",
    "stale",
)
#: A fingerprint's parts, as :func:`read_for_build`'s PostgreSQL rows carry them after the row's id.
PRINT_COLUMNS = ("rows", "updated_at", "recalls", "conflicted", "content")
_ID_AT = len(SHOWN_COLUMNS)
_PRINT_AT = _ID_AT + 1
_conflicted, _access_count, _updated_at, _content_hash = (
    itemgetter(BUILD_COLUMNS.index(name)) for name in ("conflicted", "access_count", "updated_at", "content_hash")
)

#: Category priority in the ranking (lowest first); any other category ranks ``4``.
CATEGORY_PRIORITY = {"property": 0, "fact": 1, "preference": 2, "context": 3, "legacy": 5}
OTHER_CATEGORY_PRIORITY = 4


def rank_order(rows: FromClause, recalled: ColumnElement[Any]) -> list[ColumnElement[Any]]:
    """The profiles' ranking as PostgreSQL ``ORDER BY`` terms over ``rows`` (the memory
    table's columns), most important first:
    the day of the latest of updated, created and recalled (newest first, none last),
    recalls, category priority, that exact time, then key and id in code-point order
    (``COLLATE "C"``: UTF-8 byte order is code-point order, as Python compares text).
    ``tasks.profiles.rank_key`` is the same order in Python; a test holds them equal."""
    touched = func.greatest(rows.c.updated_at, rows.c.created_at, recalled)
    # No category, or an empty one, is a fact (as the builder reads it in Python).
    category = func.lower(func.coalesce(func.nullif(rows.c.category, ""), "fact"))
    return [
        func.date_trunc("day", touched).desc().nulls_last(),
        func.coalesce(rows.c.access_count, 0).desc(),
        case(CATEGORY_PRIORITY, value=category, else_=OTHER_CATEGORY_PRIORITY),
        touched.desc().nulls_last(),
        rows.c.key.collate("C"),
        rows.c.id.collate("C"),
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


def model_written(session: Session, user_ids: Collection[str]) -> list[tuple[str, str]]:
    """(user, agent) of each of the users' profiles the model wrote (one indexed look)."""
    users = sorted(set(user_ids))
    if not users:
        return []
    # The partial index's own predicate, word for word, so the planner takes the index.
    postgres = session.get_bind().dialect.name == "postgresql"
    written = text(PG_MODEL_WRITTEN if postgres else SQLITE_MODEL_WRITTEN)
    stmt = select(Profile.user_id, Profile.agent_id).where(among(session, Profile.user_id, users), written)
    return [(user_id, agent_id) for user_id, agent_id in session.execute(stmt).all()]


def built_from(session: Session, user_ids: Collection[str]) -> dict[str, tuple[Fingerprint, BuiltWith]]:
    """The fingerprint each of the users' profiles were built from, and the settings they
    were built with (kept on the agent-less profile; a user with no profile is absent)."""
    users = sorted(set(user_ids))
    if not users:
        return {}
    return {
        row.user_id: (
            Fingerprint(
                row.source_rows, row.source_updated_at, row.source_recalls, row.source_conflicted, row.source_content
            ),
            BuiltWith(row.budget, row.tokenizer),
        )
        for row in session.execute(_stored_fingerprints(among(session, Profile.user_id, users)))
    }


def mark_for_rebuild(session: Session, user_ids: Collection[str]) -> None:
    """Have the users' profiles built again at their next refresh, whatever their rows'
    fingerprint says: the one their profiles were built from is made one no rows have."""
    users = sorted(set(user_ids))
    if users:
        session.execute(
            update(Profile)
            .where(among(session, Profile.user_id, users), Profile.agent_id == NO_AGENT)
            .values(source_rows=-1)
        )


def replace_agent_profiles(session: Session, pairs: Collection[tuple[str, str]], rows: Iterable[dict[str, Any]]) -> int:
    """Make ``rows`` the only profiles of these (user, agent) pairs, leaving the users'
    other profiles as they are (one delete, one insert; the caller's transaction)."""
    wanted = sorted(set(pairs))
    if not wanted:
        return 0
    session.execute(delete(Profile).where(tuple_(Profile.user_id, Profile.agent_id).in_(wanted)))
    return insert_rows(session, Profile, list(rows))


class Current(NamedTuple):
    """A stored profile as the model writer is shown it: its text, and the lines the
    model was offered when it wrote it (None: the model did not write it, or it was
    written before they were kept)."""

    text: str
    offered: tuple[tuple[int, str], ...] | None = None


def texts(session: Session, user_ids: Collection[str]) -> dict[tuple[str, str], Current]:
    """The stored text of every profile of ``user_ids`` (and, for those the model wrote,
    the lines it was offered), keyed by (user, agent)."""
    users = sorted(set(user_ids))
    if not users:
        return {}
    stmt = select(Profile.user_id, Profile.agent_id, Profile.text, Profile.layout).where(Profile.user_id.in_(users))
    return {(row.user_id, row.agent_id): Current(row.text, _offered(row.layout)) for row in session.execute(stmt)}


def _offered(layout: Any) -> tuple[tuple[int, str], ...] | None:
    """The (section, line) pairs kept as ``offered`` (None where there are none, or in
    another form: the model is then asked, as it was before they were kept)."""
    offered = layout.get("offered") if isinstance(layout, dict) else None
    if not isinstance(offered, list):
        return None
    pairs = []
    for item in offered:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and isinstance(item[1], str)):
            return None
        pairs.append((item[0], item[1]))
    return tuple(pairs)


_READ_COLUMNS = "user_id, agent_id, text, tokens, budget, entries_included, entries_left_out, built_at"
_READ_WHERE = (
    "FROM dream_profiles WHERE user_id = :user_id AND agent_id IN (:agent_id, '') ORDER BY agent_id DESC LIMIT 1"
)
_READ_TYPES = {"built_at": Profile.__table__.c.built_at.type, "layout": Profile.__table__.c.layout.type}
# Plain statements built once: a read is on every prompt, so it skips building and
# keying an expression each time. The layout is sent only when a cut needs it.
_READ = text(f"SELECT {_READ_COLUMNS}, NULL AS layout {_READ_WHERE}").columns(**_READ_TYPES)
_READ_FOR_CUT = text(
    f"SELECT {_READ_COLUMNS}, CASE WHEN tokens > :over OR (entries_left_out > 0 AND budget > :over)"
    f" THEN layout END AS layout {_READ_WHERE}"
).columns(**_READ_TYPES)


def read(session: Session | Connection, user_id: str, agent_id: str | None, *, layout_over: int | None = None) -> Any:
    """The profile ``agent_id`` reads (one primary-key lookup): its own, or, for an agent
    that owns no entries of the user, the agent-less one (the shared entries, which is
    exactly what such an agent may see). A row of the columns a reader needs (None: no
    profile); its ``layout`` is read only when a reader's cut to ``layout_over`` tokens
    needs it: the profile holds more, or it was cut to a larger budget (a cut to a
    smaller one is made as a build at that budget would make it), else it is None."""
    params: dict[str, Any] = {"user_id": user_id, "agent_id": agent_id or NO_AGENT}
    if layout_over is None:
        return session.execute(_READ, params).first()
    # ``tokens`` is a 32-bit column: a larger budget reads as "no cut", and is bound as
    # one a driver takes (SQLite's binds no integer of 2**63 or more).
    return session.execute(_READ_FOR_CUT, {**params, "over": min(layout_over, _MAX_TOKENS)}).first()


_MAX_TOKENS = 2**31 - 1
