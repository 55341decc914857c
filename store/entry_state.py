"""Recall detection and the staleness test that pruning uses.

The host increments ``access_count`` when it recalls an entry but may never touch
``updated_at``. Reverie remembers the count it last saw per entry; when the count has
grown, the entry was recalled since, and ``last_recalled_at`` moves to that look. An
entry first seen with recalls already counted gets the benefit of the doubt (recalled
now). Where the host keeps a last-access column (a setting), it counts too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    String,
    Table,
    and_,
    any_,
    bindparam,
    case,
    delete,
    false,
    func,
    literal,
    or_,
    select,
    true,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.functions import FunctionElement

from store.db import SQLITE_LOWER
from store.models import EntryState, query_name

#: Keys beginning with this, in any case (``_GDPR_consent`` too), are reserved: never
#: pruned, merged, rewritten or written by Reverie.
GDPR_PREFIX = "_gdpr_"


def is_reserved(key: str) -> bool:
    """Whether ``key`` is reserved (begins with ``_gdpr_``, in any case)."""
    return key[: len(GDPR_PREFIX)].lower() == GDPR_PREFIX


def reserved(key: ColumnElement[str]) -> ColumnElement[bool]:
    """SQL: the key is reserved (:func:`is_reserved`), on every database alike (SQLite's
    ``LIKE`` ignores ASCII case, PostgreSQL's does not: both are told to)."""
    return key.ilike(_GDPR_LIKE, escape="/")


_GDPR_LIKE = GDPR_PREFIX.replace("_", "/_") + "%"


#: Users as :func:`users_in` takes them: one user, several, or an array parameter
#: bound when the statement runs (a statement built once, PostgreSQL).
Users = str | Collection[str] | BindParameter[Any]
#: A cutoff time, or a parameter bound when the statement runs.
Cutoff = datetime | BindParameter[Any]


def users_in(column: Any, users: Users, *, array: bool) -> ColumnElement[bool]:
    """``column`` is one user's (a string) or one of several users' (any other
    collection). ``array`` (PostgreSQL only): as ``= ANY(array)``, one parameter whatever
    the number of users, so a chunk's statement is neither re-rendered with a parameter
    per user nor re-parsed each time; else ``IN`` with a parameter per user. A bound
    parameter is an array given when the statement runs."""
    condition: ColumnElement[bool]
    if isinstance(users, BindParameter):
        condition = column == any_(users)
    elif isinstance(users, str):
        condition = column == users
    elif array:
        condition = column == any_(bindparam(None, sorted(users), type_=ARRAY(String), expanding=False))
    else:
        condition = column.in_(sorted(users))
    return condition


def _is_pg(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def observe_recalls(session: Session, table: Table, users: str | Collection[str], at: datetime) -> set[str]:
    """Record the users' current ``access_count`` per entry, noting growth as a recall
    (one statement); returns the users with a recall recorded at ``at`` (their entries
    rank anew in their profiles).

    Only entries with a count, or with a state row already, are written, and a state
    row only when its count changed: an entry never recalled needs no row (no row reads
    as a count of 0 seen and no recall), which keeps a look at a large table cheap.
    """
    count = func.coalesce(table.c.access_count, 0)
    known = EntryState.__table__.alias(query_name("known"))
    source = (
        select(
            table.c.id,
            table.c.user_id,
            count,
            case((count > 0, literal(at, EntryState.last_recalled_at.type)), else_=None),
            literal(at, EntryState.seen_at.type),
        )
        .select_from(table.outerjoin(known, and_(known.c.entry_id == table.c.id, known.c.user_id == table.c.user_id)))
        .where(users_in(table.c.user_id, users, array=_is_pg(session)), or_(count > 0, known.c.entry_id.is_not(None)))
    )
    columns = ["entry_id", "user_id", "access_count_seen", "last_recalled_at", "seen_at"]
    # Both dialects' INSERT speak the same ON CONFLICT; only the constructor differs.
    dialect_insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    statement = dialect_insert(EntryState).from_select(columns, source)
    excluded = statement.excluded
    grew = excluded.access_count_seen > EntryState.access_count_seen
    written = statement.on_conflict_do_update(
        index_elements=[EntryState.user_id, EntryState.entry_id],
        set_={
            "last_recalled_at": case((grew, excluded.seen_at), else_=EntryState.last_recalled_at),
            "access_count_seen": excluded.access_count_seen,
            "seen_at": excluded.seen_at,
        },
        where=EntryState.access_count_seen != excluded.access_count_seen,
    ).returning(EntryState.user_id, EntryState.last_recalled_at)
    if _is_pg(session):
        # Only the users come back, once each (a first look writes a row per recalled entry).
        done = written.cte(query_name("observed"))
        recalled_now = done.c.last_recalled_at == literal(at, EntryState.last_recalled_at.type)
        return set(session.scalars(select(done.c.user_id).where(recalled_now).distinct()))
    return {user_id for user_id, recalled_at in session.execute(written) if recalled_at == at}


def mark_restored(session: Session, entries: Collection[tuple[str, str, int]], at: datetime) -> None:
    """Entries put back by a restore (entry id, user id, access count) count as recalled
    at ``at``: the host's ``updated_at`` stays as it was, yet the next pass does not
    prune them again before ``pruneStaleAfterDays`` from the restore."""
    if not entries:
        return
    dialect_insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    statement = dialect_insert(EntryState).values(
        [
            {
                "entry_id": entry_id,
                "user_id": user_id,
                "access_count_seen": count,
                "last_recalled_at": at,
                "seen_at": at,
            }
            for entry_id, user_id, count in entries
        ]
    )
    excluded = statement.excluded
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[EntryState.user_id, EntryState.entry_id],
            set_={
                "access_count_seen": excluded.access_count_seen,
                "last_recalled_at": excluded.last_recalled_at,
                "seen_at": excluded.seen_at,
            },
        )
    )


def forget_missing(session: Session, table: Table, users: str | Collection[str]) -> int:
    """Drop state rows of the users' entries that no longer exist."""
    gone = delete(EntryState).where(
        users_in(EntryState.user_id, users, array=_is_pg(session)),
        ~select(table.c.id)
        .where(table.c.id == EntryState.entry_id, table.c.user_id == EntryState.user_id)
        .correlate(EntryState)
        .exists(),
    )
    return int(session.execute(gone).rowcount or 0)  # type: ignore[attr-defined]


class Folded(FunctionElement[str]):
    """``lower()`` of every letter: PostgreSQL's own; on SQLite, whose ``lower()`` folds
    ASCII letters only, the function every connection of Reverie's has there
    (:data:`store.db.SQLITE_LOWER`)."""

    type = String()
    inherit_cache = True


@compiles(Folded)
def _folded(element: Folded, compiler: Any, **kw: Any) -> str:
    return f"lower({compiler.process(element.clauses, **kw)})"


@compiles(Folded, "sqlite")
def _folded_sqlite(element: Folded, compiler: Any, **kw: Any) -> str:
    return f"{SQLITE_LOWER}({compiler.process(element.clauses, **kw)})"


def not_protected(table: Table, protected_categories: Collection[str]) -> ColumnElement[bool]:
    """Rows Reverie may prune or merge: no ``_gdpr_`` key, no protected category (in
    any case: ``Property`` is ``property``, ``ÄRZTE`` is ``ärzte``)."""
    category = Folded(func.coalesce(table.c.category, "fact"))
    condition = ~reserved(table.c.key)
    if protected_categories:
        condition = and_(condition, category.not_in(sorted({c.lower() for c in protected_categories})))
    return condition


def protected_category(category: str | None, protected_categories: Collection[str]) -> bool:
    """:func:`not_protected`'s category test, of one row's category (None: ``fact``), with
    ``protected_categories`` lower-cased (``Settings.protected_category_set``)."""
    return (category or "fact").lower() in protected_categories


def _stale(
    table: Table, users: Users, cutoff: Cutoff, last_access_column: str | None, *, array: bool
) -> ColumnElement[bool]:
    touched = func.coalesce(table.c.updated_at, table.c.created_at)
    count = func.coalesce(table.c.access_count, 0)
    # Not recalled: the entry's state row saw no recall since the cutoff and saw exactly
    # the row's current access_count; an entry without a state row must have a count of
    # 0. Both tests are uncorrelated subqueries over the users' state rows (hashed once
    # per statement) that compare with the row itself: when the application recalls the
    # entry while the DELETE waits for its row lock, PostgreSQL re-checks this
    # condition on the new row version (READ COMMITTED) and the entry lives.
    # An entry is named by (user_id, id): the host may number its rows per user.
    quiet = select(EntryState.user_id, EntryState.entry_id, EntryState.access_count_seen).where(
        users_in(EntryState.user_id, users, array=array),
        or_(EntryState.last_recalled_at.is_(None), EntryState.last_recalled_at < cutoff),
    )
    known = select(EntryState.user_id, EntryState.entry_id).where(users_in(EntryState.user_id, users, array=array))
    entry = (table.c.user_id, table.c.id)
    unrecalled = or_(tuple_(*entry, count).in_(quiet), and_(count == 0, tuple_(*entry).not_in(known)))
    condition = and_(touched < cutoff, unrecalled)
    if last_access_column:
        accessed = table.c[last_access_column]
        condition = and_(condition, or_(accessed.is_(None), accessed < cutoff))
    return condition


def prunable_where(
    table: Table,
    users: Users,
    *,
    agent_cutoffs: Mapping[str, Cutoff | None],
    default_cutoff: Cutoff | None,
    owners: Collection[str] | None,
    protected_categories: Collection[str],
    last_access_column: str | None,
    array: bool = False,
) -> ColumnElement[bool]:
    """The set of the users' stale entries (one user id, or a collection of them), each
    judged by its owner's policy. ``array``: the users as one array parameter
    (PostgreSQL; see :func:`users_in`).

    ``agent_cutoffs`` holds the agents with a policy of their own (None: they do not
    prune); everyone else, and unowned entries, use ``default_cutoff``. ``owners``
    limits the run to those agents' entries (None: all of the user's entries).
    """
    owner = table.c.source_agent_id
    branches: list[ColumnElement[bool]] = []
    for agent, cutoff in agent_cutoffs.items():
        if cutoff is not None:
            branches.append(and_(owner == agent, _stale(table, users, cutoff, last_access_column, array=array)))
    if default_cutoff is not None:
        others: ColumnElement[bool] = true()
        if agent_cutoffs:
            others = or_(owner.is_(None), owner.not_in(sorted(agent_cutoffs)))
        branches.append(and_(others, _stale(table, users, default_cutoff, last_access_column, array=array)))
    if not branches:
        return false()
    of_users = users_in(table.c.user_id, users, array=array)
    condition = and_(of_users, not_protected(table, protected_categories), or_(*branches))
    if owners is not None:
        condition = and_(condition, owner.in_(sorted(owners)))
    return condition


def observe_access_counts(session: Session, table: Table, *, user_ids: Collection[str], at: datetime) -> set[str]:
    """:func:`observe_recalls` for several users (a look taken at ``at``)."""
    return observe_recalls(session, table, list(user_ids), at)
