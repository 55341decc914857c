"""Queries on the shared memory table (the host's; docs/reference.md, The memory table).

Every removal goes through :func:`remove_entries`, which archives each row whole,
deletes it and records an event in one statement on PostgreSQL (one transaction on
SQLite). The delete re-checks its condition row by row, so an entry the application
updates while Reverie works is left alone.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    ColumnElement,
    DateTime,
    Integer,
    Select,
    String,
    Table,
    and_,
    bindparam,
    case,
    column,
    delete,
    false,
    func,
    insert,
    inspect,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    tuple_,
    update,
    values,
)
from sqlalchemy.dialects.postgresql import DOMAIN
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine.interfaces import ReflectedColumn
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType, TypeEngine

from store.db import has_table, session_scope
from store.entry_state import is_reserved, protected_category, reserved
from store.models import ArchivedEntry, Event, memory_table, query_name
from store.types import in_range_time, loadable_columns, naive_utc, now
from worker.errors import ConfigError, TransientError
from worker.settings import Settings


@dataclass(frozen=True)
class Removed:
    entry_id: str
    user_id: str
    key: str


def table_for(settings: Settings) -> Table:
    """The memory table named by the settings."""
    return memory_table(settings.memory_table, settings.memory_last_access_column)


#: What each column of EDDI's layout must be for Reverie's statements to run on it
#: (checked on PostgreSQL; SQLite's column types are advisory): the type's family and a
#: word for it. A column not named here only has to be there.
_COLUMN_KINDS: dict[str, tuple[type[TypeEngine[Any]], str]] = {
    **dict.fromkeys(("id", "user_id", "key"), (String, "text (varchar or text)")),
    "conflicted": (Boolean, "boolean"),
    "access_count": (Integer, "an integer"),
    **dict.fromkeys(("created_at", "updated_at"), (DateTime, "a timestamp")),
}


def check_memory_table(settings: Settings) -> None:
    """Raise :class:`ConfigError` when the host's table lacks a column of EDDI's layout,
    has one of a type Reverie's statements cannot work on (an ``id`` of type ``uuid``),
    or lacks the last-access column the settings name: every dream and signal would fail
    on it. Commands and the worker check before any work, ``reverie health`` too."""
    if not has_table(settings, settings.memory_table):
        return  # not migrated yet (said elsewhere)
    table = table_for(settings)
    with session_scope(settings) as session:
        found = {column["name"]: column["type"] for column in host_columns(session, table)}
    if settings.is_sqlite:
        # SQLite's names are case-insensitive: ``lastaccessed`` reads ``LastAccessed``.
        found = {name.lower(): kind for name, kind in found.items()}
    where = f"the memory table {settings.memory_table}"
    last = settings.memory_last_access_column
    if last and (last.lower() if settings.is_sqlite else last) not in found:
        raise ConfigError(f"REVERIE_MEMORY_LAST_ACCESS_COLUMN={last}: {where} has no such column")
    missing = [column.name for column in table.columns if column.name not in found and column.name != last]
    if missing:
        raise ConfigError(f"{where} has no column {', '.join(missing)}: Reverie works on EDDI's layout (see Tables)")
    if settings.is_sqlite:
        return
    for name, (family, word) in _COLUMN_KINDS.items():
        kind = base_type(found[name])
        if not isinstance(kind, family):
            raise ConfigError(f"{where}: column {name} is {kind}; Reverie needs {word} there")


def base_type(kind: Any) -> Any:
    """A reflected column type, a domain's as its base type (a domain is what its base is)."""
    while isinstance(kind, DOMAIN):
        kind = kind.data_type
    return kind


def quoted_name(session: Session, table: Table) -> str:
    """The table's name as SQL text, quoted where its case or spelling needs it."""
    return str(session.get_bind().dialect.identifier_preparer.format_table(table))


def sql_identifier(name: str) -> str:
    """A column's name, as the host spelled it, quoted for SQL text that SQLAlchemy
    compiles (``literal_column``): a percent sign is left single, since the statement
    doubles it for the driver (the dialect's own quoting doubles it too: twice is a
    different name)."""
    return '"' + name.replace('"', '""') + '"'


def sql_string(value: str) -> str:
    """A string literal for SQL text that SQLAlchemy compiles (see :func:`sql_identifier`)."""
    return "'" + value.replace("'", "''") + "'"


def for_text(fragment: str) -> str:
    """An identifier or a literal made for SQL text (:func:`sql_identifier`,
    :func:`sql_string`) as ``text()`` takes it: a colon escaped, or ``:name`` in a
    host's column name would be read as a parameter."""
    return fragment.replace(":", "\\:")


#: In an archived row (PostgreSQL): the names of its JSON columns that held SQL NULL
#: (``to_jsonb`` makes SQL NULL and the JSON value ``null`` alike; a restore puts back
#: which it was). Longer than PostgreSQL's 63 bytes for a name: no column can be called so.
SQL_NULL_KEY = "reverie: the JSON columns of this row that held SQL NULL, not the JSON value null"


def whole_row(session: Session, table: Table) -> ColumnElement[Any]:
    """The whole current row of ``table`` as JSON (PostgreSQL), whatever columns the host
    added; where some of its JSON columns hold SQL NULL, they are named under
    :data:`SQL_NULL_KEY` (only then: the key costs a rebuilt object per row, and most
    rows have none)."""
    name = quoted_name(session, table)
    nullable = [(f"{name}.{sql_identifier(c)}", sql_string(c)) for c in json_column_names(session, table)]
    if not nullable:
        return func.to_jsonb(literal_column(name))
    any_null = " OR ".join(f"{ref} IS NULL" for ref, _ in nullable)
    names = ", ".join(f"CASE WHEN {ref} IS NULL THEN {lit} END" for ref, lit in nullable)
    return literal_column(
        f"CASE WHEN {any_null} THEN to_jsonb({name}) || jsonb_build_object({sql_string(SQL_NULL_KEY)}, "
        f"to_jsonb(array_remove(ARRAY[{names}]::text[], NULL))) ELSE to_jsonb({name}) END"
    )


def json_column_names(session: Session, table: Table) -> list[str]:
    """The names of ``table``'s JSON columns, its own and the host's, as the catalog has
    them now (PostgreSQL; one small query: the host may add or drop a column at any time)."""
    found = session.execute(_JSON_COLUMNS, {"table": quoted_name(session, table)})
    return [str(row[0]) for row in found]


#: A domain counts as its base type (two levels of domains deep).
_JSON_COLUMNS = text(
    "SELECT a.attname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
    "LEFT JOIN pg_type b ON b.oid = t.typbasetype LEFT JOIN pg_type c ON c.oid = b.typbasetype "
    "WHERE a.attrelid = CAST(:table AS regclass) AND a.attnum > 0 AND NOT a.attisdropped "
    "AND COALESCE(c.oid, b.oid, t.oid) IN (CAST('json' AS regtype), CAST('jsonb' AS regtype)) ORDER BY a.attnum"
)


def host_columns(session: Session, table: Table) -> list[ReflectedColumn]:
    """The columns of the host's table as the database has them now (name, type, ...)."""
    return list(inspect(session.connection()).get_columns(table.name, schema=table.schema))


def whole_columns(session: Session, table: Table) -> list[ColumnElement[Any]]:
    """``table``'s columns plus those the host added (read from the database), to select
    a row whole. On SQLite the host's columns come as stored (text, a number, bytes),
    whatever type they declare: that is what a restore writes back, so a day, a time or
    a decimal comes back exactly as it was."""
    dialect = session.get_bind().dialect
    extra = [
        literal_column(
            f"{quoted_name(session, table)}.{sql_identifier(column['name'])}",
            NullType() if dialect.name == "sqlite" else column["type"],
        ).label(column["name"])
        for column in host_columns(session, table)
        if column["name"] not in table.c
    ]
    return [*table.c, *extra]


def jsonable_row(row: Any) -> dict[str, Any]:
    """A memory-table row as the JSON object the archive stores."""
    out: dict[str, Any] = {}
    for key, value in dict(row._mapping).items():
        if isinstance(value, datetime | date | time):
            value = value.isoformat()
        elif isinstance(value, Decimal):
            value = str(value)  # exact, as the column holds it
        elif isinstance(value, bytes | bytearray | memoryview):
            # JSON has no bytes: tagged, so a restore knows them from text (SQLite's
            # host columns come as stored, and text may look like anything).
            value = {BYTES_TAG: bytes(value).hex()}
        out[key] = value
    return out


#: The key of the object the archive holds bytes in (SQLite: ``{"$hex": "00ff"}``).
BYTES_TAG = "$hex"


def bytes_of(value: Any) -> bytes | None:
    """The bytes a value of :func:`jsonable_row` holds (None: it holds no bytes)."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(BYTES_TAG), str):
        return bytes.fromhex(value[BYTES_TAG])
    return None


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


def remove_entries_of_runs(
    session: Session, table: Table, where: ColumnElement[bool], runs: Mapping[str, int], *, reason: str, source: str
) -> list[Removed]:
    """:func:`remove_entries` for several users' runs at once: each removed row is
    archived and recorded under its own user's run (``runs``: user id -> run id), so
    ``reverie restore --run`` puts back exactly that user's rows. Only rows of the users
    in ``runs`` are removed. One statement on PostgreSQL.
    """
    if not runs:
        return []
    where = and_(table.c.user_id.in_(sorted(runs)), where)
    if session.get_bind().dialect.name == "postgresql":
        return _remove_pg(session, table, where, reason=reason, source=source, run_id=None, signal_id=None, runs=runs)
    removed: list[Removed] = []
    for user_id, run_id in runs.items():
        removed += _remove_portable(
            session,
            table,
            and_(table.c.user_id == user_id, where),
            reason=reason,
            source=source,
            run_id=run_id,
            signal_id=None,
        )
    return removed


def _remove_pg(
    session: Session,
    table: Table,
    where: ColumnElement[bool],
    *,
    reason: str,
    source: str,
    run_id: int | None,
    signal_id: int | None,
    runs: Mapping[str, int] | None = None,
) -> list[Removed]:
    at = now()
    # The whole row as the DELETE saw it, including any columns the host added.
    gone = (
        delete(table)
        .where(where)
        .returning(*table.c, whole_row(session, table).label("whole_row"))
        .cte(query_name("gone"))
    )
    source_rows: Any = gone
    run_of: ColumnElement[Any] = literal(run_id, ArchivedEntry.run_id.type)
    if runs is not None:
        # Each removed row goes to its own user's run.
        users = sorted(runs)
        owners = select(
            func.unnest(literal(users, ARRAY(String))).label("user_id"),
            func.unnest(literal([runs[u] for u in users], ARRAY(BigInteger))).label("run_id"),
        ).cte(query_name("owners"))
        source_rows = gone.join(owners, owners.c.user_id == gone.c.user_id)
        run_of = owners.c.run_id
    archived = (
        insert(ArchivedEntry)
        .from_select(
            ["run_id", "signal_id", "user_id", "entry_id", "reason", "row", "archived_at"],
            select(
                run_of,
                literal(signal_id, ArchivedEntry.signal_id.type),
                gone.c.user_id,
                gone.c.id,
                literal(reason),
                gone.c.whole_row,
                literal(at, ArchivedEntry.archived_at.type),
            ).select_from(source_rows),
        )
        .cte(query_name("archived"))
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
                run_of,
                literal(at, Event.at.type),
            ).select_from(source_rows),
        )
        .returning(Event.entry_id, Event.user_id, Event.key)
    ).add_cte(archived)
    rows = session.execute(events).all()
    # Rows are tuples: unpacked by position, not by name (a name is a lookup per row).
    return [Removed(entry_id, user_id, key) for entry_id, user_id, key in rows]


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
    rows = session.execute(select(*whole_columns(session, table)).where(where)).all()
    if not rows:
        return []
    at = now()
    entries = [(row.user_id, row.id) for row in rows]
    _archive_fetched(session, rows, reason=reason, run_id=run_id, signal_id=signal_id, at=at)
    for start in range(0, len(entries), 500):
        session.execute(delete(table).where(tuple_(table.c.user_id, table.c.id).in_(entries[start : start + 500])))
    removed = [Removed(row.id, row.user_id, row.key) for row in rows]
    record_events(session, removed, action="delete", source=source, run_id=run_id, signal_id=signal_id, at=at)
    return removed


def restored_entries(session: Session, user_ids: Sequence[str]) -> dict[tuple[str, str], datetime]:
    """(user id, entry id) -> when a restore last put the entry back, for every entry of
    these users a restore put back (its ``restore`` events, kept
    ``event_retention_days``): a restore that ``keep_newest`` would undo at the next pass."""
    if not user_ids:
        return {}
    found = session.execute(
        select(Event.user_id, Event.entry_id, func.max(Event.at))
        .where(Event.user_id.in_(sorted(set(user_ids))), Event.action == "restore")
        .group_by(Event.user_id, Event.entry_id)
    )
    return {(user_id, entry_id): at for user_id, entry_id, at in found}


def as_restored(row: Any, restored_at: datetime | None) -> bool:
    """Whether ``row``, which a restore put back at ``restored_at`` (None: none did), still
    holds what was put back: written since (by the host, or its id used again), it is a
    row like any other. Pruning, ``keep_newest`` and summarizing leave such a row alone."""
    if restored_at is None:
        return False
    return row.updated_at is None or naive_utc(row.updated_at) <= restored_at


def record_events(
    session: Session,
    entries: list[Removed],
    *,
    action: str,
    source: str,
    run_id: int | None = None,
    signal_id: int | None = None,
    at: datetime | None = None,
    stored: Mapping[str, datetime | None] | None = None,
) -> None:
    """One ``dream_events`` row per entry (never the value), at ``at``; ``stored``: the
    ``updated_at`` the database kept for an entry id, where the write was an insert or an
    update (a restore compares it with the row's, to tell the application's later write)."""
    if not entries:
        return
    when = at or now()
    kept = stored or {}
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
                "at": _as_stored(kept.get(e.entry_id)) or when,
            }
            for e in entries
        ],
    )


def _as_stored(value: Any) -> datetime | None:
    """A returned ``updated_at`` as ``dream_events.at`` holds times (naive UTC; a host's
    column with a time zone reads with one); None for none (or a value that is no time)."""
    return naive_utc(value) if isinstance(value, datetime) else None


# -- writes: archive-then-replace and EDDI's upsert --------------------------------------


@dataclass(frozen=True)
class Upserted:
    """What :func:`upsert_entry` did: ``insert``, ``update``, ``unchanged`` or
    ``protected`` (an existing ``_gdpr_`` or protected-category entry, left alone)."""

    entry_id: str | None
    action: str


def archive_rows(
    session: Session,
    table: Table,
    where: ColumnElement[bool],
    *,
    reason: str,
    run_id: int | None = None,
    signal_id: int | None = None,
) -> int:
    """Copy every row of ``table`` matching ``where`` whole into the archive, keeping it.

    Used before a row is rewritten in place (``reason="replace"``), so the old value
    can be restored exactly like a removed one.
    """
    at = now()
    if session.get_bind().dialect.name == "postgresql":
        statement = insert(ArchivedEntry).from_select(
            ["run_id", "signal_id", "user_id", "entry_id", "reason", "row", "archived_at"],
            select(
                literal(run_id, ArchivedEntry.run_id.type),
                literal(signal_id, ArchivedEntry.signal_id.type),
                table.c.user_id,
                table.c.id,
                literal(reason),
                whole_row(session, table),
                literal(at, ArchivedEntry.archived_at.type),
            ).where(where),
        )
        result = session.execute(statement)
        return int(getattr(result, "rowcount", 0) or 0)
    rows = session.execute(select(*whole_columns(session, table)).where(where)).all()
    _archive_fetched(session, rows, reason=reason, run_id=run_id, signal_id=signal_id, at=at)
    return len(rows)


def _archive_fetched(
    session: Session,
    rows: Sequence[Any],
    *,
    reason: str,
    run_id: int | None,
    signal_id: int | None,
    at: datetime,
) -> None:
    """Copy rows already read from the memory table into the archive, whole."""
    if not rows:
        return
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


def _upsert_key(table: Table, user_id: str, key: str, visibility: str, agent_id: str | None) -> ColumnElement[bool]:
    # EDDI's two partial unique indexes: global entries are keyed on (user, key) and
    # keep their owner; self/group entries are keyed on (user, key, agent).
    same = and_(table.c.user_id == user_id, table.c.key == key)
    if visibility == "global":
        return and_(same, table.c.visibility == "global")
    owner = table.c.source_agent_id.is_(None) if agent_id is None else table.c.source_agent_id == agent_id
    return and_(same, table.c.visibility != "global", owner)


def _lock_unowned_key(session: Session, table: Table, user_id: str, key: str) -> None:
    """Serialize writers of one (user, key) with no owning agent until their commit.

    EDDI's unique index on (user_id, key, source_agent_id) treats NULL agents as all
    distinct, so ``ON CONFLICT`` never fires for them and two concurrent inserts would
    both land. PostgreSQL only: SQLite has one writer at a time anyway.
    """
    if session.get_bind().dialect.name != "postgresql":
        return
    name = f"{table.schema or ''}.{table.name}\x1f{user_id}\x1f{key}\x1fself-or-group"
    session.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(name, 0))))


def unchanged_since_read(session: Session, table: Table, rows: Sequence[Any]) -> ColumnElement[bool]:
    """These rows, only while they still hold the key, value, category, visibility,
    owner and ``updated_at`` they were read with: a DELETE with this condition leaves a
    row the application changed since, in any column that decides whether it may be
    removed (PostgreSQL re-checks it on the new row version when the DELETE waited for
    its lock)."""
    postgres = session.get_bind().dialect.name == "postgresql"
    conditions: list[ColumnElement[bool]] = []
    for row in rows:
        value = row.value
        if isinstance(value, str) and not postgres:
            # SQLite hands JSON back as text; compare it in the canonical form json() gives.
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        same_value: ColumnElement[bool]
        if value is None:
            same_value = table.c.value.is_(None)
        elif postgres:
            same_value = table.c.value == literal(value, table.c.value.type)
        else:
            same_value = func.json(table.c.value) == func.json(json.dumps(value))
        conditions.append(
            and_(
                one_entry(table, row.user_id, row.id),
                table.c.key == row.key,
                same_value,
                table.c.category.is_not_distinct_from(row.category),
                table.c.visibility.is_not_distinct_from(row.visibility),
                table.c.source_agent_id.is_not_distinct_from(row.source_agent_id),
                # As the row was read: on PostgreSQL, in Python's range (:func:`loadable_columns`).
                (in_range_time(table.c.updated_at) if postgres else table.c.updated_at).is_not_distinct_from(
                    row.updated_at
                ),
            )
        )
    return or_(*conditions) if conditions else false()


#: The columns an overwrite (:func:`upsert_entry` of a new value for an existing key)
#: writes; a restore of the overwrite puts back these and leaves the row's others as they are.
OVERWRITTEN_COLUMNS = ("value", "category", "updated_at", "source_conversation_id")


def upsert_entry(
    session: Session,
    table: Table,
    *,
    user_id: str,
    key: str,
    value: Any,
    category: str,
    source: str,
    visibility: str = "self",
    source_agent_id: str | None = None,
    source_conversation_id: str | None = None,
    protected_categories: frozenset[str] = frozenset(),
    signal_id: int | None = None,
    run_id: int | None = None,
) -> Upserted:
    """Write one entry with EDDI's upsert semantics and record the event.

    A new value for an existing key replaces it in place (same id, access count kept)
    after the old row is archived whole (reason ``replace``). The same value and
    category again is ``unchanged`` and writes nothing. An existing entry whose key
    starts with ``_gdpr_`` or whose category is protected is never rewritten.
    """
    match = _upsert_key(table, user_id, key, visibility, source_agent_id)
    if visibility != "global" and source_agent_id is None:
        _lock_unowned_key(session, table, user_id, key)
    for _ in range(2):
        existing = session.execute(whole_rows(session, table).where(match).with_for_update()).first()
        if existing is not None:
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
                run_id=run_id,
            )
        at = now()
        entry_id = str(uuid.uuid4())
        dialect = session.get_bind().dialect.name
        builder = pg_insert(table) if dialect == "postgresql" else sqlite_insert(table)
        statement = (
            builder.values(
                id=entry_id,
                user_id=user_id,
                key=key,
                value=value,
                category=category,
                visibility=visibility,
                source_agent_id=source_agent_id,
                group_ids=[],
                source_conversation_id=source_conversation_id,
                conflicted=False,
                access_count=0,
                created_at=at,
                updated_at=at,
            )
            # A concurrent writer may have inserted the same key since our look:
            # then the loop finds its row and replaces it instead.
            .on_conflict_do_nothing()
            .returning(table.c.id, stored_time(session, table))
        )
        inserted = session.execute(statement).first()
        if inserted is not None:
            record_events(
                session,
                [Removed(entry_id, user_id, key)],
                action="insert",
                source=source,
                run_id=run_id,
                signal_id=signal_id,
                at=at,
                stored={entry_id: inserted.updated_at},
            )
            return Upserted(entry_id, "insert")
    raise TransientError("another writer kept changing the entry; try again")


def _replace(
    session: Session,
    table: Table,
    existing: Any,
    *,
    value: Any,
    category: str,
    source: str,
    source_conversation_id: str | None,
    protected_categories: frozenset[str],
    signal_id: int | None,
    run_id: int | None,
) -> Upserted:
    if is_reserved(existing.key) or protected_category(existing.category, protected_categories):
        return Upserted(existing.id, "protected")
    if existing.value == value and existing.category == category:
        return Upserted(existing.id, "unchanged")
    at = now()
    this = one_entry(table, existing.user_id, existing.id)
    archive_rows(session, table, this, reason="replace", run_id=run_id, signal_id=signal_id)
    # Only OVERWRITTEN_COLUMNS: a restore puts back those, and nothing else.
    changes: dict[str, Any] = {"value": value, "category": category, "updated_at": at}
    if source_conversation_id is not None:
        changes["source_conversation_id"] = source_conversation_id
    written = session.execute(update(table).where(this).values(**changes).returning(stored_time(session, table)))
    record_events(
        session,
        [Removed(existing.id, existing.user_id, existing.key)],
        action="update",
        source=source,
        run_id=run_id,
        signal_id=signal_id,
        at=at,
        stored={existing.id: written.scalar()},
    )
    return Upserted(existing.id, "update")


def stored_time(session: Session, table: Table) -> ColumnElement[Any]:
    """The row's ``updated_at`` as a write's ``RETURNING`` gives it back: what the
    database kept (the column's own precision, a host's trigger that sets it), as naive
    NULL where it is outside Python's range (:func:`record_events` takes it as naive UTC,
    and a NULL as no time kept: the time sent, which such a row never matches)."""
    stamp: ColumnElement[Any] = table.c.updated_at
    if session.get_bind().dialect.name != "postgresql":
        return stamp
    return _in_python_range(stamp).label("updated_at")


def _in_python_range(stamp: ColumnElement[Any]) -> ColumnElement[Any]:
    """A time outside Python's range (a trigger's ``infinity``) as NULL (PostgreSQL): not
    a time to compare with (clamped, any two such times would match), so the row reads
    as changed."""
    within = and_(stamp <= literal(datetime.max, stamp.type), stamp >= literal(datetime.min, stamp.type))
    return case((within, stamp), else_=null())


def whole_rows(session: Session, table: Table) -> Select[Any]:
    """``SELECT`` of the memory table's rows whole, as Python can hold them (times out of
    its range read in range on PostgreSQL: :func:`store.types.loadable_columns`)."""
    return select(*loadable_columns(table.c, postgres=session.get_bind().dialect.name == "postgresql"))


def user_entries(session: Session, table: Table, user_id: str, *, lock: bool = False) -> list[Any]:
    """Every entry of one user, oldest first (``lock``: FOR UPDATE on PostgreSQL)."""
    stmt = whole_rows(session, table).where(table.c.user_id == user_id).order_by(table.c.created_at, table.c.id)
    if lock:
        stmt = stmt.with_for_update()
    return list(session.execute(stmt).all())


def loose_key(key: str) -> str:
    """The key form :func:`contradiction_candidates` partitions by, computed in Python."""
    if key.isascii():
        return "".join(c for c in key if c.isascii() and c.isalnum()).lower()
    return "~"


def user_keys(session: Session, table: Table, user_ids: Sequence[str]) -> list[tuple[str, str]]:
    """The distinct ``(user_id, key)`` pairs of ``user_ids`` (``_gdpr_`` keys left out), one query."""
    if not user_ids:
        return []
    stmt = (
        select(table.c.user_id, table.c.key)
        .distinct()
        .where(table.c.user_id.in_(sorted(user_ids)), ~reserved(table.c.key))
    )
    # Fetched at once, and kept as the tuples they are (a fetch and a name lookup per row cost more).
    return [(user_id, key) for user_id, key in session.execute(stmt).all()]


def contradiction_candidates(
    session: Session, table: Table, user_ids: Sequence[str], same_keys: Mapping[tuple[str, str], str] | None = None
) -> list[Any]:
    """The entries of ``user_ids`` that may contradict another, users' entries in order
    (PostgreSQL, one query): every non-``_gdpr_`` entry whose user has another entry
    with a loosely equal key (ASCII letters and digits, lowercased; every non-ASCII key
    of a user counts as one key) and a different value. ``same_keys`` maps
    ``(user_id, key)`` to a group label for keys that mean the same without being loosely
    equal (``birthday`` and ``date_of_birth``); such keys are compared by label. A superset
    of the entries that contradiction detection groups, so the exact test stays in Python
    and reads far fewer rows than every entry of every user.
    """
    if not user_ids:
        return []
    loose = case(
        (
            table.c.key.regexp_match("^[\\x01-\\x7f]*$"),
            func.lower(func.regexp_replace(table.c.key, "[^A-Za-z0-9]", "", "g")),
        ),
        else_=literal("~"),
    )
    source: Any = table
    group: ColumnElement[Any] = loose
    if same_keys:
        labels = (
            values(
                column("user_id", String), column("key", String), column("label", String), name=query_name("same_keys")
            )
            .data([(user, key, "~" + label) for (user, key), label in sorted(same_keys.items())])
            .alias(query_name("same_keys"))
        )
        source = table.outerjoin(labels, and_(labels.c.user_id == table.c.user_id, labels.c.key == table.c.key))
        # Labels start with "~" and hold more than it, so none equals a loose key.
        group = func.coalesce(labels.c.label, loose)
    text_value = func.coalesce(table.c.value.cast(String), "null")
    partition = [table.c.user_id, group]
    inner = (
        select(
            table,
            func.min(text_value).over(partition_by=partition).label("lowest_value"),
            func.max(text_value).over(partition_by=partition).label("highest_value"),
        )
        .select_from(source)
        .where(table.c.user_id.in_(sorted(user_ids)), ~reserved(table.c.key))
        .subquery()
    )
    columns = loadable_columns([inner.c[column.name] for column in table.c], postgres=True)  # (PostgreSQL only)
    stmt = (
        select(*columns)
        .where(inner.c.lowest_value != inner.c.highest_value)
        .order_by(inner.c.user_id, inner.c.created_at, inner.c.id)
    )
    return list(session.execute(stmt).all())


def set_conflicted(session: Session, table: Table, entries: list[tuple[str, str]], flag: bool) -> int:
    """Set ``conflicted`` on the given entries, each named by (user id, entry id), only
    where it differs; returns rows changed.

    A host whose own trigger sets ``updated_at`` on every write moves the row's time for
    this write too, though the row holds what it held: Reverie's own events of the entry
    move with it (:func:`_follow_flag`), so a restore still tells the entry from one the
    application changed, and a restored row still holds what was put back."""
    changed = 0
    postgres = session.get_bind().dialect.name == "postgresql"
    for start in range(0, len(entries), 500):
        these = and_(
            tuple_(table.c.user_id, table.c.id).in_(entries[start : start + 500]),
            func.coalesce(table.c.conflicted, False).is_not(flag),
        )
        if postgres:
            # One statement: the rows locked and their time read first, then written, the
            # time the write left returned (a time that moved is this write's alone).
            old = (
                select(table.c.user_id, table.c.id, _in_python_range(table.c.updated_at).label("was"))
                .where(these)
                .with_for_update()
                .cte(query_name("flagged"))
            )
            written = session.execute(
                update(table)
                .where(table.c.user_id == old.c.user_id, table.c.id == old.c.id)
                .values(conflicted=flag)
                .returning(table.c.user_id, table.c.id, old.c.was, stored_time(session, table))
            ).all()
            pairs = [tuple(row) for row in written]
        else:
            times = select(table.c.user_id, table.c.id, table.c.updated_at).where(these)
            before = {(u, i): t for u, i, t in session.execute(times)}
            if not before:
                continue
            session.execute(update(table).where(these).values(conflicted=flag))
            # Read again, not returned: a SQLite trigger's write comes after RETURNING.
            after = session.execute(
                select(table.c.user_id, table.c.id, table.c.updated_at).where(
                    tuple_(table.c.user_id, table.c.id).in_(sorted(before))
                )
            )
            pairs = [(u, i, before.get((u, i)), t) for u, i, t in after]
        changed += len(pairs)
        moved = [
            {"u": u, "e": i, "was": naive_utc(was), "now": naive_utc(t)}
            for u, i, was, t in pairs
            if was is not None and t is not None and naive_utc(t) != naive_utc(was)
        ]
        _follow_flag(session, moved)
    return changed


def _follow_flag(session: Session, moved: list[dict[str, Any]]) -> None:
    """Move Reverie's own events of entries whose ``updated_at`` its flag write moved
    (``was`` to ``now``, a host's trigger): a write whose time the row still held
    (``insert``, ``update``: nothing was written since it) takes the new time, and a
    restore the row still held (its ``updated_at`` no later than the restore) is dated
    the new time, so the row holds what was put back, as before the flag."""
    if not moved:
        return
    # The table's own: one statement per entry, not the ORM's bulk update by primary key.
    events: Table = Event.__table__  # type: ignore[assignment]
    of_entry = and_(events.c.user_id == bindparam("u"), events.c.entry_id == bindparam("e"))
    was, now_ = bindparam("was", type_=DateTime()), bindparam("now", type_=DateTime())
    # Not on a column that keeps whole seconds (both times on the second): there an
    # application write in the flag's second would read as Reverie's write, and a restore
    # would take it out. The entry reads as changed instead, which a restore leaves.
    fine = [m for m in moved if m["was"].microsecond or m["now"].microsecond]
    if fine:
        session.execute(
            update(events)
            .where(of_entry, or_(events.c.action == "insert", events.c.action == "update"), events.c.at == was)
            .values(at=now_),
            fine,
        )
    session.execute(
        update(events)
        .where(of_entry, events.c.action == "restore", events.c.at >= was, events.c.at < now_)
        .values(at=now_),
        moved,
    )


def one_entry(table: Table, user_id: str, entry_id: str) -> ColumnElement[bool]:
    """The user's entry ``entry_id``. An id names a row only with its user: a host whose
    memory table is distributed keys it by (user_id, id)."""
    return and_(table.c.user_id == user_id, table.c.id == entry_id)


def entries_of(table: Table, user_id: str, entry_ids: Collection[str]) -> ColumnElement[bool]:
    """The user's entries with these ids (see :func:`one_entry`)."""
    return and_(table.c.user_id == user_id, table.c.id.in_(sorted(entry_ids)))
