"""Overwrites are reversible: a value a signal overwrote is archived first and
``reverie restore --signal ID`` puts it back (run through the real command line)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, text, update

from store.db import dispose_engines, session_scope
from store.memories import table_for
from store.models import ArchivedEntry, Event
from store.types import now
from tasks.signals import process_pending
from tests.test_cli import assert_one_line_error, run
from tests.test_session_end import memories, transcript
from worker.producer import enqueue_signal
from worker.settings import Settings


def _said(settings: Settings, sentence: str, conversation: str) -> int:
    enqueued = enqueue_signal(
        "session_end", "alice", transcript(("user", sentence), conversation=conversation), settings=settings
    )
    assert process_pending(settings).processed == 1
    return int(enqueued.signal_id)


def _values(settings: Settings) -> dict[str, Any]:
    return {row.key: row.value for row in memories(settings, "alice")}


def _restore(settings: Settings, *args: str) -> Any:
    return run(["restore", *args], env={"REVERIE_DATABASE_URL": settings.database_url})


def test_a_value_a_signal_overwrote_comes_back_with_restore_signal(pg_settings: Settings) -> None:
    _said(pg_settings, "My favorite color is blue.", "c-1")
    overwrite = _said(pg_settings, "My favorite color is green. My home city is Oslo.", "c-2")
    assert _values(pg_settings) == {"favorite_color": "green", "home_city": "Oslo"}
    with session_scope(pg_settings) as session:
        archived = session.execute(
            select(ArchivedEntry.reason, ArchivedEntry.row).where(ArchivedEntry.signal_id == overwrite)
        ).all()
    assert [(reason, row["value"]) for reason, row in archived] == [("replace", "blue")]

    result = _restore(pg_settings, "--signal", str(overwrite))
    assert result.returncode == 0, result.stderr
    assert f"signal {overwrite}: restored 1 entries, took out 1 it wrote" in result.stdout
    # The overwritten value is back on its row, the entry the signal added is gone, and
    # both of the signal's values are archived in turn.
    assert _values(pg_settings) == {"favorite_color": "blue"}
    with session_scope(pg_settings) as session:
        undone = session.execute(
            select(ArchivedEntry.reason, ArchivedEntry.row).where(ArchivedEntry.reason == "restore")
        )
        assert sorted(row["value"] for _, row in undone) == ["Oslo", "green"]
        assert session.scalars(select(Event.source).where(Event.action == "restore")).all() == ["restore"]

    again = _restore(pg_settings, "--signal", str(overwrite))
    assert again.returncode == 0 and "restored 0 entries, took out 0" in again.stdout
    assert _values(pg_settings) == {"favorite_color": "blue"}


def test_restore_signal_leaves_a_value_the_application_changed_since(pg_settings: Settings) -> None:
    _said(pg_settings, "My favorite color is blue.", "c-1")
    overwrite = _said(pg_settings, "My favorite color is green.", "c-2")
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        session.execute(update(table).where(table.c.key == "favorite_color").values(value="red", updated_at=now()))

    result = _restore(pg_settings, "--signal", str(overwrite))
    assert result.returncode == 0, result.stderr
    assert "restored 0 entries" in result.stdout
    assert "1 it wrote left in place (changed by the application since)" in result.stdout
    assert _values(pg_settings) == {"favorite_color": "red"}


def test_restore_needs_exactly_one_of_run_and_signal(pg_settings: Settings) -> None:
    assert_one_line_error(_restore(pg_settings), "--run", "--signal")
    assert_one_line_error(_restore(pg_settings, "--run", "1", "--signal", "1"), "--run", "--signal")
    unknown = _restore(pg_settings, "--signal", "424242")
    assert_one_line_error(unknown, "424242")


def test_restore_signal_puts_back_the_whole_row_on_both_backends(store_settings: Settings) -> None:
    from store.archive import restore_signal
    from store.memories import upsert_entry

    table = table_for(store_settings)

    def write(value: str, signal_id: int) -> str:
        with session_scope(store_settings) as session:
            done = upsert_entry(
                session, table, user_id="alice", key="seat", value=value, category="fact", source="session_end",
                source_agent_id="agent-a", signal_id=signal_id,
            )  # fmt: skip
        assert done.entry_id is not None
        return done.entry_id

    entry_id = write("aisle", 1)
    before = {row.key: row._asdict() for row in memories(store_settings, "alice")}
    assert write("window", 2) == entry_id
    with session_scope(store_settings) as session:
        result = restore_signal(session, table, 2)
    assert (result.restored, result.removed_inserts, result.changed_since) == (1, 0, 0)
    assert {row.key: row._asdict() for row in memories(store_settings, "alice")} == before


@pytest.fixture()
def notes_on_entries(store_settings: Settings) -> Iterator[Settings]:
    """A table of the host's own that hangs rows off memory entries, deleted with them
    (``ON DELETE CASCADE``)."""
    with session_scope(store_settings) as session:
        session.execute(
            text(
                "CREATE TABLE entry_notes (note_id INTEGER PRIMARY KEY, "
                "entry_id VARCHAR(64) NOT NULL REFERENCES usermemories (id) ON DELETE CASCADE, note TEXT)"
            )
        )
    try:
        yield store_settings
    finally:
        dispose_engines()
        with session_scope(store_settings) as session:
            session.execute(text("DROP TABLE entry_notes"))
        dispose_engines()


def test_restoring_an_overwrite_keeps_the_host_rows_that_hang_off_the_entry(notes_on_entries: Settings) -> None:
    from store.archive import restore_signal
    from store.memories import upsert_entry

    settings = notes_on_entries
    table = table_for(settings)

    def write(value: str, signal_id: int) -> str:
        with session_scope(settings) as session:
            done = upsert_entry(
                session, table, user_id="alice", key="seat", value=value, category="fact", source="session_end",
                source_agent_id="agent-a", signal_id=signal_id,
            )  # fmt: skip
        assert done.entry_id is not None
        return done.entry_id

    entry_id = write("aisle", 1)
    with session_scope(settings) as session:
        session.execute(text("INSERT INTO entry_notes VALUES (1, :e, 'asked twice')"), {"e": entry_id})
    assert write("window", 2) == entry_id
    with session_scope(settings) as session:
        result = restore_signal(session, table, 2)
    assert result.restored == 1
    assert _values(settings) == {"seat": "aisle"}
    with session_scope(settings) as session:
        notes = session.execute(text("SELECT entry_id, note FROM entry_notes")).all()
    # The entry was put back in place: the host's rows that hang off it are still there.
    assert [tuple(n) for n in notes] == [(entry_id, "asked twice")]
