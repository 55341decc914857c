"""Overwrites are reversible: a value a signal overwrote is archived first and
``reverie restore --signal ID`` puts it back (run through the real command line)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, text, update

import store.archive
from store.archive import restore_signal
from store.db import dispose_engines, session_scope
from store.memories import table_for, upsert_entry
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
            select(ArchivedEntry.reason, ArchivedEntry.row, ArchivedEntry.signal_id).where(
                ArchivedEntry.reason.in_(("restore", "restore_replace"))
            )
        )
        # Under the signal, for an undo: the entry taken out, the row a value was put back on.
        assert sorted((row["value"], reason, signal) for reason, row, signal in undone) == [
            ("Oslo", "restore", overwrite),
            ("green", "restore_replace", overwrite),
        ]
        assert session.scalars(select(Event.source).where(Event.action == "restore")).all() == ["restore"]

    again = _restore(pg_settings, "--signal", str(overwrite))
    assert again.returncode == 0 and "restored 0 entries, took out 0" in again.stdout
    assert _values(pg_settings) == {"favorite_color": "blue"}


@pytest.mark.parametrize("held", ["""{"shade": 1.50, "n": null}""", "null"])
def test_an_overwritten_value_comes_back_with_every_digit_and_its_null(pg_settings: Settings, held: str) -> None:
    _said(pg_settings, "My favorite color is blue.", "c-1")
    with session_scope(pg_settings) as session:
        # The application's own value on that row, as it wrote it.
        session.execute(
            text("UPDATE usermemories SET value = CAST(:v AS jsonb) WHERE key = 'favorite_color'"), {"v": held}
        )
        before = session.execute(text("SELECT value::text FROM usermemories WHERE key = 'favorite_color'")).scalar()
    overwrite = _said(pg_settings, "My favorite color is green.", "c-2")
    assert _values(pg_settings)["favorite_color"] == "green"
    assert _restore(pg_settings, "--signal", str(overwrite)).returncode == 0
    with session_scope(pg_settings) as session:
        after = session.execute(
            text("SELECT value::text, value IS NULL FROM usermemories WHERE key = 'favorite_color'")
        ).one()
    assert tuple(after) == (before, False)


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

    table = table_for(store_settings)

    def write(value: str, signal_id: int) -> str:
        return _write(store_settings, value, signal_id, user_id="alice")

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

    settings = notes_on_entries
    table = table_for(settings)

    def write(value: str, signal_id: int) -> str:
        return _write(settings, value, signal_id, user_id="alice")

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


def test_sqlite_an_edit_landing_while_an_overwrite_is_restored_is_not_overwritten(
    sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = sqlite_settings
    table = table_for(settings)
    _write(settings, "aisle", 1)
    _write(settings, "window", 2)
    real = store.archive.archive_rows
    edits: list[threading.Thread] = []

    def archive_meanwhile(*args: Any, **kwargs: Any) -> int:
        if not edits:

            def edit() -> None:
                with session_scope(settings) as session:
                    session.execute(
                        text(
                            "UPDATE usermemories SET value = '\"edited by the application\"', "
                            "updated_at = CURRENT_TIMESTAMP WHERE user_id = 'u1'"
                        )
                    )

            edits.append(threading.Thread(target=edit))
            edits[0].start()
            edits[0].join(timeout=1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(store.archive, "archive_rows", archive_meanwhile)
    with session_scope(settings) as session:
        result = restore_signal(session, table, 2)
    edits[0].join(timeout=60)
    with session_scope(settings) as session:
        value = session.scalar(text("SELECT value FROM usermemories WHERE user_id = 'u1'"))
    # The edit waited for the restore, then landed: it is the row's value, and the
    # restore counted what it put back.
    assert "edited by the application" in str(value)
    assert result.restored == 1


def test_sqlite_a_string_value_that_looks_like_json_is_restored_as_a_string(store_settings: Settings) -> None:
    settings = store_settings
    table = table_for(settings)
    _write(settings, "0042", 1, key="pin")
    _write(settings, "true", 1, key="flag")
    for key in ("pin", "flag"):
        _write(settings, "changed", 2, key=key)
    with session_scope(settings) as session:
        restore_signal(session, table, 2)
    with session_scope(settings) as session:
        values = {r.key: r.value for r in session.execute(select(table.c.key, table.c.value))}
    assert values == {"pin": "0042", "flag": "true"}


def _write(settings: Settings, value: str, signal_id: int, *, key: str = "seat", user_id: str = "u1") -> str:
    """An entry written by a signal (u1's seat unless told); its id."""
    with session_scope(settings) as session:
        done = upsert_entry(
            session, table_for(settings), user_id=user_id, key=key, value=value, category="fact",
            source="session_end", source_agent_id="agent-a", signal_id=signal_id,
        )  # fmt: skip
    assert done.entry_id is not None
    return done.entry_id


def _value(settings: Settings) -> Any:
    table = table_for(settings)
    with session_scope(settings) as session:
        return session.scalar(select(table.c.value).where(table.c.user_id == "u1"))


def test_chain_of_overwrites_restored_newest_first(store_settings: Settings) -> None:
    s = store_settings
    _write(s, "A", 1)
    _write(s, "B", 2)
    _write(s, "C", 3)
    with session_scope(s) as session:
        assert restore_signal(session, table_for(s), 2).changed_since == 1  # C is newer: left
    for sid, expect in ((3, "B"), (2, "A")):
        with session_scope(s) as session:
            assert restore_signal(session, table_for(s), sid).restored == 1
        assert _value(s) == expect


def test_sqlite_an_application_delete_landing_while_an_overwrite_is_restored_waits_for_it(
    sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from store.models import ArchivedEntry

    s = sqlite_settings
    _write(s, "A", 1)
    _write(s, "B", 2)
    real = store.archive.archive_rows
    done: list[threading.Thread] = []
    waited: list[bool] = []

    def archive_meanwhile(*args: Any, **kwargs: Any) -> int:
        if not done:

            def gone() -> None:
                with session_scope(s) as session:
                    session.execute(text("DELETE FROM usermemories WHERE user_id = 'u1'"))

            done.append(threading.Thread(target=gone))
            done[0].start()
            done[0].join(timeout=1.0)
            waited.append(done[0].is_alive())
        return real(*args, **kwargs)

    monkeypatch.setattr(store.archive, "archive_rows", archive_meanwhile)
    with session_scope(s) as session:
        result = restore_signal(session, table_for(s), 2)
    done[0].join(timeout=60)
    with session_scope(s) as session:
        rows = session.execute(text("SELECT key, value FROM usermemories")).all()
        pending = session.execute(
            select(ArchivedEntry.reason, ArchivedEntry.restored_at).where(ArchivedEntry.signal_id == 2)
        ).all()
    # The delete waited for the restore, which put the value back (and said so); then
    # the delete landed. The restore never reports a row it did not write.
    assert waited == [True]
    assert result.restored == 1 and rows == []
    assert [r.restored_at is not None for r in pending if r.reason == "replace"] == [True]


def test_an_entry_a_signal_inserted_and_then_rewrote_is_taken_out_by_its_restore(store_settings: Settings) -> None:
    """The signal's own second write is not the application's change: the restore
    takes the entry out, as it does any entry the signal added."""
    table = table_for(store_settings)
    _write(store_settings, "A", 1)
    with session_scope(store_settings) as session:
        for value in ("Oslo", "Bergen"):
            upsert_entry(
                session, table, user_id="u1", key="home", value=value, category="fact",
                source="session_end", source_agent_id="agent-a", signal_id=2,
            )  # fmt: skip
    with session_scope(store_settings) as session:
        result = restore_signal(session, table, 2)
    assert (result.removed_inserts, result.changed_since, result.restored) == (1, 0, 0)
    with session_scope(store_settings) as session:
        assert {r.key: r.value for r in session.execute(select(table.c.key, table.c.value))} == {"seat": "A"}
    with session_scope(store_settings) as session:
        again = restore_signal(session, table, 2)
    assert (again.removed_inserts, again.changed_since, again.restored) == (0, 0, 0)


def test_a_restore_leaves_an_application_change_where_a_trigger_writes_infinity(pg_settings: Settings) -> None:
    """Times past Python's range are not compared (clamped, any two would match): a row
    whose ``updated_at`` a trigger sets to ``infinity`` reads as changed, and the
    application's own write on it is never overwritten by a restore."""
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    with session_scope(settings) as session:
        session.execute(
            text(
                "CREATE FUNCTION forever() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN NEW.updated_at := 'infinity'; RETURN NEW; END $$"
            )
        )
        session.execute(
            text("CREATE TRIGGER forever BEFORE UPDATE ON usermemories FOR EACH ROW EXECUTE FUNCTION forever()")
        )
    dispose_engines()
    try:
        _said(settings, "My favorite color is blue.", "c-1")
        overwrite = _said(settings, "My favorite color is green.", "c-2")
        with session_scope(settings) as session:
            session.execute(text("UPDATE usermemories SET value = '\"red\"' WHERE key = 'favorite_color'"))
        result = _restore(settings, "--signal", str(overwrite))
        assert result.returncode == 0, result.stderr
        with session_scope(settings) as session:
            # The key and value only: the row's time (infinity) is one Python cannot hold.
            kept = dict(session.execute(text("SELECT key, value FROM usermemories WHERE user_id = 'alice'")).all())
        assert kept == {"favorite_color": "red"}
    finally:
        dispose_engines()
        with session_scope(pg_settings) as session:
            session.execute(text("DROP TRIGGER IF EXISTS forever ON usermemories"))
            session.execute(text("DROP FUNCTION IF EXISTS forever()"))
        dispose_engines()


@contextlib.contextmanager
def host_keeping_its_own_time(pg_settings: Settings, kind: str) -> Iterator[Settings]:
    """A host table whose ``updated_at`` is not the time Reverie sent: stored to the
    millisecond (a Java host's ``TIMESTAMP(3)``), or set by the host's own trigger on
    every write (``touch_trigger``), Reverie's included."""
    with session_scope(pg_settings) as session:
        if kind == "milliseconds":
            session.execute(text("ALTER TABLE usermemories ALTER COLUMN updated_at TYPE TIMESTAMP(3)"))
        else:
            session.execute(
                text(
                    "CREATE FUNCTION touch() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN NEW.updated_at := clock_timestamp() AT TIME ZONE 'UTC'; RETURN NEW; END $$"
                )
            )
            session.execute(
                text(
                    "CREATE TRIGGER touch BEFORE INSERT OR UPDATE ON usermemories FOR EACH ROW EXECUTE FUNCTION touch()"
                )
            )
    dispose_engines()
    try:
        yield pg_settings.model_copy(update={"summarize_interactions": False})
    finally:
        dispose_engines()
        with session_scope(pg_settings) as session:
            session.execute(text("DROP TRIGGER IF EXISTS touch ON usermemories"))
            session.execute(text("DROP FUNCTION IF EXISTS touch()"))
            session.execute(text("ALTER TABLE usermemories ALTER COLUMN updated_at TYPE TIMESTAMP"))
        dispose_engines()


@pytest.fixture(params=["milliseconds", "touch_trigger"])
def host_keeps_its_own_time(request: pytest.FixtureRequest, pg_settings: Settings) -> Iterator[Settings]:
    with host_keeping_its_own_time(pg_settings, request.param) as settings:
        yield settings


@pytest.fixture
def touching_host(pg_settings: Settings) -> Iterator[Settings]:
    with host_keeping_its_own_time(pg_settings, "touch_trigger") as settings:
        yield settings


def test_a_restore_undoes_a_signal_where_the_host_keeps_its_own_updated_at(host_keeps_its_own_time: Settings) -> None:
    """The time a restore compares is the ``updated_at`` the database kept, not the one
    sent: nothing was changed since, so everything the signal wrote is undone."""
    settings = host_keeps_its_own_time
    _said(settings, "My favorite color is blue.", "c-1")
    overwrite = _said(settings, "My favorite color is green. My home city is Oslo.", "c-2")
    assert _values(settings) == {"favorite_color": "green", "home_city": "Oslo"}

    result = _restore(settings, "--signal", str(overwrite))

    assert result.returncode == 0, result.stderr
    assert f"signal {overwrite}: restored 1 entries, took out 1 it wrote" in result.stdout
    assert _values(settings) == {"favorite_color": "blue"}


def test_a_restore_takes_out_the_summaries_where_the_host_keeps_its_own_updated_at(
    host_keeps_its_own_time: Settings,
) -> None:
    from tasks.dream import dream_user
    from tests.dream_seed import entry, seed

    settings = host_keeps_its_own_time.model_copy(update={"summarize_interactions": True})
    seed(settings, [entry("alice", f"n{i}", f"note {i}", category="context") for i in range(6)])
    outcome = dream_user(settings, "alice")
    assert outcome.entries_summarized == 6 and outcome.run_id is not None
    summaries = set(_values(settings))
    assert summaries and not summaries & {f"n{i}" for i in range(6)}

    result = _restore(settings, "--run", str(outcome.run_id))

    assert result.returncode == 0, result.stderr
    assert set(_values(settings)) == {f"n{i}" for i in range(6)}


def test_reveries_own_contradiction_flag_does_not_make_a_signals_entry_the_applications(
    touching_host: Settings,
) -> None:
    """A dream flags a contradiction on the signal's entry; the host's trigger moves the
    row's ``updated_at`` for that write too. It is still the signal's entry, with nothing
    the application wrote: ``restore --signal`` takes it out."""
    from tasks.dream import dream_user
    from tests.dream_seed import entry, seed

    settings = touching_host
    signal = _said(settings, "My favorite color is green.", "c-1")
    seed(settings, [entry("alice", "favorite_color", "red", agent="agent-b")])
    outcome = dream_user(settings, "alice")
    assert outcome.contradictions_found == 1
    with session_scope(settings) as session:
        flagged = session.execute(text("SELECT value FROM usermemories WHERE conflicted")).scalars().all()
    assert sorted(flagged) == ["green", "red"]

    result = _restore(settings, "--signal", str(signal))

    assert result.returncode == 0, result.stderr
    assert f"signal {signal}: restored 0 entries, took out 1 it wrote" in result.stdout
    assert [row.value for row in memories(settings, "alice")] == ["red"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_restore_under_keep_newest_sticks_where_the_hosts_trigger_touches_every_write(
    touching_host: Settings, chunked: bool
) -> None:
    """The row put back, and Reverie's contradiction flag on it, both move its
    ``updated_at`` (the host's trigger): it still holds what was put back, so the next
    dreams flag it and never archive it again."""
    from store.archive import restore_run
    from tasks.dream import dream_user, dream_users
    from tests.dream_seed import entries_of, entry, seed

    settings = touching_host.model_copy(update={"contradiction_resolution": "keep_newest"})

    def dream() -> None:
        if chunked:
            dream_users(settings, ["u1"])
        else:
            dream_user(settings, "u1")

    older, newer = seed(
        settings,
        [entry("u1", "city", "Berlin", agent="a", age_days=10), entry("u1", "City", "Paris", agent="b", age_days=1)],
    )
    outcome = dream_user(settings, "u1")
    assert outcome.contradictions_resolved == 1 and set(entries_of(settings, "u1")) == {newer["id"]}
    assert outcome.run_id is not None
    with session_scope(settings) as session:
        restored = restore_run(session, table_for(settings), outcome.run_id)
    assert restored.restored == 1

    dream()
    dream()

    rows = entries_of(settings, "u1")
    assert set(rows) == {older["id"], newer["id"]}
    assert {r["conflicted"] for r in rows.values()} == {True}


def test_on_a_whole_second_column_an_application_write_in_the_flags_second_is_left_by_the_restore(
    pg_settings: Settings,
) -> None:
    """A column that keeps whole seconds cannot tell an application write in the same
    second as Reverie's flag from the flag: the flag's time is not followed there, and
    the restore leaves the entry (the application's value stays)."""
    from tasks.dream import dream_user
    from tests.dream_seed import entry, seed

    database = pg_settings.database_url.rsplit("/", 1)[1]

    def clock_reads(at: str) -> None:
        # Every new connection's writes are stamped ``at`` by the host's trigger.
        dispose_engines()
        with session_scope(pg_settings) as session:
            session.execute(text(f"ALTER DATABASE \"{database}\" SET reverie_test.at = '{at}'"))
        dispose_engines()

    with session_scope(pg_settings) as session:
        session.execute(text("ALTER TABLE usermemories ALTER COLUMN updated_at TYPE TIMESTAMP(0)"))
        session.execute(
            text(
                "CREATE FUNCTION stamp() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN NEW.updated_at := current_setting('reverie_test.at')::timestamp; RETURN NEW; END $$"
            )
        )
        session.execute(
            text("CREATE TRIGGER stamp BEFORE INSERT OR UPDATE ON usermemories FOR EACH ROW EXECUTE FUNCTION stamp()")
        )
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    try:
        clock_reads("2026-11-28 10:00:01")
        signal = _said(settings, "My favorite color is green.", "c-1")
        seed(settings, [entry("alice", "favorite_color", "red", agent="agent-b")])
        clock_reads("2026-11-28 10:00:02")
        assert dream_user(settings, "alice").contradictions_found == 1
        # The application's write, in the flag's second.
        with session_scope(settings) as session:
            session.execute(text("UPDATE usermemories SET value = '\"blue\"' WHERE value = '\"green\"'"))

        result = _restore(settings, "--signal", str(signal))

        assert result.returncode == 0, result.stderr
        assert "took out 0 it wrote, 1 it wrote left in place" in result.stdout
        assert sorted(row.value for row in memories(settings, "alice")) == ["blue", "red"]
    finally:
        dispose_engines()
        with session_scope(pg_settings) as session:
            session.execute(text("DROP TRIGGER IF EXISTS stamp ON usermemories"))
            session.execute(text("DROP FUNCTION IF EXISTS stamp()"))
            session.execute(text("ALTER TABLE usermemories ALTER COLUMN updated_at TYPE TIMESTAMP"))
            session.execute(text(f'ALTER DATABASE "{database}" RESET reverie_test.at'))
        dispose_engines()
