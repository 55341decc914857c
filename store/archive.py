"""Restore: put back, unchanged, the rows a run or a signal archived (``reverie restore``).

Three kinds of work are undone:
- rows the run or signal removed (prune, contradiction, summarize) are inserted again,
  whole, every column the host added included;
- values it overwrote (reason ``replace``) are put back on their row, in place: the
  columns an overwrite writes, nothing else;
- entries it inserted (summaries, new facts) are taken out through ``remove_entries``,
  so they are archived in turn and nothing is lost either way.

Reverie only undoes its own writes: an entry it inserted or overwrote that the
application has changed since (its ``updated_at`` is no longer the one Reverie wrote) is
left as it is and reported. A removed row whose id or upsert key is taken again is left
in the archive and reported as a conflict. Every row put back is recorded as a
``restore`` event, and counts as recalled at the restore, so it is not pruned again
before ``pruneStaleAfterDays`` have passed since; nor is it removed again by
``keep_newest`` (a contradiction it is part of is flagged instead) while it holds
what was put back. ``Restored.users`` names the users whose memory changed (``reverie
restore`` rebuilds their profiles at once).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    ColumnElement,
    DateTime,
    MetaData,
    Table,
    and_,
    func,
    select,
    text,
    tuple_,
    union,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from store import entry_state, locks
from store.db import hold_writes
from store.memories import (
    OVERWRITTEN_COLUMNS,
    SQL_NULL_KEY,
    Removed,
    archive_rows,
    base_type,
    bytes_of,
    for_text,
    host_columns,
    one_entry,
    quoted_name,
    record_events,
    remove_entries,
    sql_identifier,
    sql_string,
    stored_time,
)
from store.models import ArchivedEntry, Event, Run, Signal
from store.types import db_now, loadable_columns, naive_utc, now
from worker.errors import ArchiveExpired, NotFound

RESTORABLE = ("prune", "contradiction", "summarize", "replace")


@dataclass(frozen=True)
class Restored:
    """What a restore did. ``changed_since`` counts entries the run or signal wrote that
    the application changed afterwards: they were left in place."""

    run_id: int | None
    restored: int
    conflicts: int
    removed_inserts: int
    changed_since: int = 0
    signal_id: int | None = None
    #: The users whose memory the restore changed.
    users: tuple[str, ...] = ()


def restore_run(session: Session, table: Table, run_id: int) -> Restored:
    """Undo a run's removals, overwrites and inserts (idempotent: a second call restores nothing)."""
    if session.get(Run, run_id) is None:
        raise NotFound("run", run_id)
    return _restore(session, table, Event.run_id == run_id, ArchivedEntry.run_id == run_id, run_id=run_id)


def restore_signal(session: Session, table: Table, signal_id: int) -> Restored:
    """Undo what one signal wrote: the values it overwrote come back, the entries it
    inserted are taken out (idempotent). Works as long as the archive keeps its rows,
    even after the signal row itself is gone."""
    _known_signal(session, signal_id)
    return _restore(
        session, table, Event.signal_id == signal_id, ArchivedEntry.signal_id == signal_id, signal_id=signal_id
    )


def _known_signal(session: Session, signal_id: int) -> None:
    known = session.get(Signal, signal_id) is not None or (
        session.scalar(select(Event.id).where(Event.signal_id == signal_id).limit(1)) is not None
    )
    if not known:
        raise NotFound("signal", signal_id)


def _restore(
    session: Session,
    table: Table,
    events_of: ColumnElement[bool],
    archived_of: ColumnElement[bool],
    *,
    run_id: int | None = None,
    signal_id: int | None = None,
) -> Restored:
    # An erasure of the users under way is waited for (what it deleted is then seen
    # gone), and one that comes later waits for this to commit, then deletes what it
    # put back: the two never interleave, so a restore never brings an erased user back.
    users = session.scalars(
        union(
            select(ArchivedEntry.user_id).where(archived_of),
            select(Event.user_id).where(events_of),
        )
    ).all()
    locks.hold_off_erasure(session, list(users))
    # SQLite: no other writer from the first look to the last write (PostgreSQL locks
    # the rows it looks at), so an application edit never lands between the two.
    hold_writes(session)
    _refuse_expired(session, events_of, archived_of, run_id=run_id, signal_id=signal_id)
    writes = _Writer(session, table, run_id=run_id, signal_id=signal_id)
    removed, kept, inserted = _take_out_inserts(session, table, events_of, run_id=run_id, signal_id=signal_id)
    gone = {(r.user_id, r.entry_id) for r in removed}
    archived = session.execute(
        select(ArchivedEntry.id, ArchivedEntry.user_id, ArchivedEntry.entry_id, ArchivedEntry.reason, ArchivedEntry.row)
        .where(archived_of, ArchivedEntry.restored_at.is_(None), ArchivedEntry.reason.in_(RESTORABLE))
        .order_by(ArchivedEntry.id)
    ).all()
    first_replace, restored = _replaces(session, table, archived, inserted, gone)
    conflicts = 0
    for archive_id, user_id, entry_id, reason, raw in archived:
        data = json.loads(raw) if isinstance(raw, str) else dict(raw)
        if reason == "replace":
            ids = first_replace.get((user_id, entry_id), [])
            if not ids or archive_id != ids[0]:
                continue
            outcome = writes.put_back_value(
                data, _written_at(session, events_of, user_id, entry_id, "update"), archive_id=archive_id
            )
            if outcome == "changed":
                kept += 1
                continue
            if outcome == "put back":
                restored += ids
                continue
        if session.scalar(select(table.c.id).where(_clash(table, data)).limit(1)) is not None:
            conflicts += 1
            continue
        if not writes.insert(data, archive_id=archive_id):
            # Taken by a key the look above cannot see (the host's primary key is its
            # own to choose): the row stays in the archive.
            conflicts += 1
            continue
        restored.append(archive_id)
    if restored:
        session.execute(update(ArchivedEntry).where(ArchivedEntry.id.in_(restored)).values(restored_at=now()))
    writes.finish()
    return Restored(
        run_id=run_id,
        signal_id=signal_id,
        restored=writes.count,
        conflicts=conflicts,
        removed_inserts=len(removed),
        changed_since=kept,
        users=tuple(sorted({r.user_id for r in (*writes.done, *removed)})),
    )


def _refuse_expired(
    session: Session,
    events_of: ColumnElement[bool],
    archived_of: ColumnElement[bool],
    *,
    run_id: int | None,
    signal_id: int | None,
) -> None:
    """Refuse, changing nothing, a restore whose archived rows the retention purge
    deleted: it could not put back what was removed or overwritten, and would still take
    out what was written in their place (a summary, without the entries it replaced).

    The archived rows are locked here, so a purge that starts later waits for the
    restore to commit, and one that committed first leaves none to find: they cannot go
    between this look and the restore's read of them (the restore would otherwise take
    out the summaries and put back nothing)."""
    if session.scalars(select(ArchivedEntry.id).where(archived_of).with_for_update()).all():
        return
    changed = session.scalar(
        select(func.count()).where(events_of, Event.action.in_(("delete", "update")), Event.source != "restore")
    )
    restored = session.scalar(select(Event.id).where(events_of, Event.source == "restore").limit(1))
    # Restored before its archive rows went: there is nothing left to put back, and no harm.
    if changed and restored is None:
        raise ArchiveExpired(f"run {run_id}" if run_id is not None else f"signal {signal_id}", int(changed))


def _replaces(
    session: Session, table: Table, archived: Sequence[Any], inserted: set[tuple[str, str]], gone: set[tuple[str, str]]
) -> tuple[dict[tuple[str, str], list[int]], list[int]]:
    """The archived overwrites to put back, by entry (archive ids, oldest first: an entry
    overwritten twice by one run or signal comes back as it was before the first), and
    the ids of those never put back, done with: values of an entry the run or signal
    added and then wrote again, which goes (taken out, or left as the application
    changed it). Entries are named by (user id, entry id): the host may number its rows
    per user."""
    first_replace: dict[tuple[str, str], list[int]] = {}
    for archive_id, user_id, entry_id, reason, _ in archived:
        if reason == "replace":
            first_replace.setdefault((user_id, entry_id), []).append(archive_id)
    done: list[int] = []
    for entry in inserted & first_replace.keys():
        ids = first_replace.pop(entry)
        if entry in gone or _absent(session, table, *entry):
            done += ids
    return first_replace, done


def _take_out_inserts(
    session: Session, table: Table, events_of: ColumnElement[bool], *, run_id: int | None, signal_id: int | None
) -> tuple[list[Removed], int, set[tuple[str, str]]]:
    """Remove the entries the run or signal inserted and nobody changed since: their
    ``updated_at`` is the one the run or signal's last write to them left (a signal may
    write an entry it added again). Archived under that run or signal, reason
    ``restore``. Returns what was removed, how many were left in place because they
    changed, and every (user, entry) the run or signal inserted."""
    inserted = select(Event.user_id, Event.entry_id).where(events_of, Event.action == "insert")
    last_write = (
        select(Event.user_id, Event.entry_id, func.max(Event.at).label("at"))
        .where(events_of, Event.action.in_(("insert", "update")), tuple_(Event.user_id, Event.entry_id).in_(inserted))
        .group_by(Event.user_id, Event.entry_id)
        .subquery("last_write")
    )
    untouched = select(last_write.c.entry_id).where(
        last_write.c.entry_id == table.c.id,
        last_write.c.user_id == table.c.user_id,
        last_write.c.at == table.c.updated_at,
    )
    entry = tuple_(table.c.user_id, table.c.id)
    present = int(session.scalar(select(func.count()).select_from(table).where(entry.in_(inserted))) or 0)
    removed = remove_entries(
        session, table, untouched.exists(), reason="restore", source="restore", run_id=run_id, signal_id=signal_id
    )
    return removed, present - len(removed), {(u, e) for u, e in session.execute(inserted).all()}


def _absent(session: Session, table: Table, user_id: str, entry_id: str) -> bool:
    return session.scalar(select(table.c.id).where(one_entry(table, user_id, entry_id))) is None


def _written_at(
    session: Session, events_of: ColumnElement[bool], user_id: str, entry_id: str, action: str
) -> datetime | None:
    """When the run or signal last wrote this entry (the ``updated_at`` it left)."""
    return session.scalar(
        select(Event.at)
        .where(events_of, Event.user_id == user_id, Event.entry_id == entry_id, Event.action == action)
        .order_by(Event.id.desc())
    )


class _Writer:
    """Puts archived rows back, whole, and records what it did."""

    def __init__(self, session: Session, table: Table, *, run_id: int | None, signal_id: int | None) -> None:
        self.session = session
        self.table = table
        self.run_id = run_id
        self.signal_id = signal_id
        # The database's clock: a restore's time is compared with the times other hosts
        # write (a host's later write to the row makes it a row like any other again).
        self.at = db_now(session)
        self.done: list[Removed] = []
        self.recalls: list[tuple[str, str, int]] = []
        self.left: dict[str, datetime] = {}
        self.postgres = session.get_bind().dialect.name == "postgresql"
        self._live: Table | None = None
        self._host_columns: list[str] | None = None
        self._reflected: list[Any] | None = None
        self._json: dict[str, str] | None = None

    @property
    def count(self) -> int:
        return len(self.done)

    def put_back_value(self, data: dict[str, Any], written_at: datetime | None, *, archive_id: int) -> str:
        """Put an overwritten value back on its row: ``put back``, ``changed`` (the
        application wrote the row after Reverie did: left alone) or ``missing`` (the row
        is gone: the caller inserts it like a removed one).

        The row is updated in place, and only in the columns an overwrite writes
        (``OVERWRITTEN_COLUMNS``): the rows the host's own tables hang off it stay (a
        delete would take those with ``ON DELETE CASCADE``), and so does what the
        application wrote beside the value since (a recall counted, a column of its own)."""
        table = self.table
        this = one_entry(table, data["user_id"], data["id"])
        # The time as Python holds it (the application may have written ``infinity``: changed).
        shown = loadable_columns([table.c.id, table.c.updated_at, table.c.access_count], postgres=self.postgres)
        look = select(*shown).where(this).with_for_update()
        current = self.session.execute(look).first()
        if current is None:
            return "missing"
        if written_at is None or current.updated_at is None or naive_utc(current.updated_at) != naive_utc(written_at):
            return "changed"
        # The row as it was just before, kept under the run or signal (reason restore_replace).
        archive_rows(self.session, table, this, reason="restore_replace", run_id=self.run_id, signal_id=self.signal_id)
        columns = [name for name in OVERWRITTEN_COLUMNS if name in data]
        if self.postgres:
            name, names, archived = self._pg_archived(columns)
            result = self.session.execute(
                text(f"UPDATE {name} SET ({names}) = ({archived}) WHERE user_id = :user_id AND id = :id"),
                {"archive_id": archive_id, "user_id": data["user_id"], "id": data["id"]},
            )
        else:
            values = self._sqlite_values(data, columns)
            live = self._live_table()
            result = self.session.execute(
                update(live).where(one_entry(live, data["user_id"], data["id"])).values(**values)
            )
        if not result.rowcount:  # type: ignore[attr-defined]
            return "missing"  # not while the look's lock holds; never counted as put back
        # The recalls the row holds now: it keeps them (the next pass counts none as new).
        self._done(data, recalls=current.access_count, left=self._time_left(data))
        return "put back"

    def insert(self, data: dict[str, Any], *, archive_id: int) -> bool:
        """Insert an archived row whole; False when a unique key of the host's table
        already holds it, or (PostgreSQL) the host's own constraints refuse it now
        (nothing written then)."""
        if self._host_columns is None:
            # Not the columns the database makes itself (generated, or an identity it
            # always assigns): it refuses a value for them, and makes them again.
            self._host_columns = [column["name"] for column in self._columns() if not _made_by_database(column)]
        columns = [name for name in self._host_columns if name in data]
        if self.postgres:
            name, names, archived = self._pg_archived(columns)
            try:
                # In a savepoint of its own: a row the host's own constraints refuse now (a
                # foreign key whose row was deleted since) stays archived, and the others
                # go back all the same.
                with self.session.begin_nested():
                    result = self.session.execute(
                        text(f"INSERT INTO {name} ({names}) {archived} ON CONFLICT DO NOTHING"),
                        {"archive_id": archive_id},
                    )
            except IntegrityError:
                return False
        else:
            row = self._sqlite_values(data, columns)
            result = self.session.execute(sqlite_insert(self._live_table()).values(**row).on_conflict_do_nothing())
        if not result.rowcount:  # type: ignore[attr-defined]
            return False
        self._done(data, left=self._time_left(data))
        return True

    def _time_left(self, data: dict[str, Any]) -> Any:
        """The ``updated_at`` the row put back holds now, as a host's trigger may have set it
        (read, not returned: on SQLite a trigger's write comes after ``RETURNING``); None
        for a time Python does not hold (the restore's own time is recorded then)."""
        this = one_entry(self.table, data["user_id"], data["id"])
        return self.session.scalar(select(stored_time(self.session, self.table)).where(this))

    def _pg_archived(self, columns: list[str]) -> tuple[str, str, str]:
        """The table's quoted name, the columns' quoted names, and a ``SELECT`` of those
        columns of the archived row whose archive id is ``:archive_id``, read where it is
        kept (PostgreSQL turns the JSON back into the table's own column types; a number
        never goes through a float here). A JSON column is taken as the archive holds it:
        the JSON value ``null`` stays ``null``, and it is SQL NULL where the archive says
        it was (``SQL_NULL_KEY``; in an archive row written before the key, a null
        is the JSON value, where it could have been either)."""
        name = quoted_name(self.session, self.table)
        # The host's column names are whatever it chose (``:tag``, ``50% off``): quoted
        # and escaped for ``text()``.
        quote = _text_identifier
        names = ", ".join(map(quote, columns))
        json_types = self._json_types()
        tag = for_text(sql_string(SQL_NULL_KEY))
        picked = []
        for column in columns:
            if column in json_types:
                key = for_text(sql_string(column))
                picked.append(
                    f"CASE WHEN COALESCE(r.row -> {tag}, '[]'::jsonb) ? {key} THEN NULL "
                    f"ELSE CAST(r.row -> {key} AS {json_types[column]}) END"
                )
            else:
                picked.append(f"p.{quote(column)}")
        archived = (
            f"SELECT {', '.join(picked)} FROM {quoted_name(self.session, ArchivedEntry.__table__)} AS r "  # type: ignore[arg-type]
            f"CROSS JOIN LATERAL jsonb_populate_record(NULL::{name}, r.row) AS p WHERE r.id = :archive_id"
        )
        return name, names, archived

    def _columns(self) -> list[Any]:
        """The host table's columns as the catalog has them, read once per restore (its
        one transaction)."""
        if self._reflected is None:
            self._reflected = list(host_columns(self.session, self.table))
        return self._reflected

    def _json_types(self) -> dict[str, str]:
        """The JSON columns' names and their SQL types (``JSON`` or ``JSONB``), once per restore."""
        if self._json is None:
            dialect = self.session.get_bind().dialect
            kinds = {c["name"]: base_type(c["type"]) for c in self._columns()}
            self._json = {name: str(kind.compile(dialect)) for name, kind in kinds.items() if isinstance(kind, JSON)}
        return self._json

    def _done(self, data: dict[str, Any], *, recalls: int | None = None, left: Any = None) -> None:
        """Count a row put back; ``left``: the ``updated_at`` it holds now. Where that is
        later than the restore's time (a host's trigger set it as the row went back), the
        restore is recorded at it: the row holds what was put back until it is written again."""
        self.done.append(Removed(data["id"], data["user_id"], data["key"]))
        if isinstance(left, datetime) and naive_utc(left) > self.at:
            self.left[data["id"]] = naive_utc(left)
        held = data.get("access_count") if recalls is None else recalls
        self.recalls.append((data["id"], data["user_id"], int(held or 0)))

    def _sqlite_values(self, data: dict[str, Any], columns: list[str]) -> dict[str, Any]:
        """The archived row's values of ``columns`` as the live table takes them (SQLite).
        The host's own columns were archived as stored, and go back so (bytes from the
        archive's tagged form, :func:`store.memories.bytes_of`)."""
        live = self._live_table()
        row = {name: data[name] for name in columns}
        for name in columns:
            value = row[name]
            if name not in self.table.c:
                held = bytes_of(value)
                row[name] = value if held is None else held
            elif isinstance(value, str) and isinstance(live.c[name].type, DateTime):
                row[name] = datetime.fromisoformat(value)
        return row

    def finish(self) -> None:
        record_events(
            self.session,
            self.done,
            action="restore",
            source="restore",
            run_id=self.run_id,
            signal_id=self.signal_id,
            at=self.at,
            stored=self.left,
        )
        entry_state.mark_restored(self.session, self.recalls, self.at)

    def _live_table(self) -> Table:
        """The host's table as the database has it now (SQLite), its own columns taking
        their values as stored: not converted by the type they declare."""
        if self._live is None:
            self._live = Table(
                self.table.name, MetaData(), schema=self.table.schema, autoload_with=self.session.connection()
            )
            for column in self._live.c:
                if column.name not in self.table.c:
                    column.type = NullType()
        return self._live


def _made_by_database(column: Mapping[str, Any]) -> bool:
    """Whether the database makes the column's value itself: generated, or an identity
    it always assigns (it refuses a value for those)."""
    identity: Mapping[str, Any] = column.get("identity") or {}
    return bool(column.get("computed")) or bool(identity.get("always"))


def _clash(table: Table, row: dict[str, Any]) -> Any:
    same_id = one_entry(table, row["user_id"], row["id"])
    same_key = and_(table.c.user_id == row["user_id"], table.c.key == row["key"])
    if row.get("visibility") == "global":
        taken = and_(same_key, table.c.visibility == "global")
    else:
        agent = row.get("source_agent_id")
        owner = table.c.source_agent_id.is_(None) if agent is None else table.c.source_agent_id == agent
        taken = and_(same_key, table.c.visibility != "global", owner)
    return same_id | taken


def _text_identifier(name: str) -> str:
    return for_text(sql_identifier(name))
