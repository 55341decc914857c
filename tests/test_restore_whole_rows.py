"""The archive keeps whole rows, the host's own columns included, on every removal path;
``reverie restore`` puts every column back, the restored rows survive the next pass,
and a restore never takes out an entry the application changed since Reverie wrote it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, text, update

from store.archive import restore_run
from store.db import dispose_engines, session_scope
from store.memories import remove_entries, table_for
from store.models import ArchivedEntry, EntryState, Event
from store.types import now
from tasks.dream import dream_user, dream_users
from tests.dream_seed import entries_of, entry, seed
from worker.settings import Settings


@pytest.fixture()
def host_settings(store_settings: Settings) -> Iterator[Settings]:
    """The memory table with a column the host application added (``tenant_ref``)."""
    with session_scope(store_settings) as session:
        session.execute(text("ALTER TABLE usermemories ADD COLUMN tenant_ref VARCHAR(40) DEFAULT 'none'"))
    dispose_engines()
    yield store_settings
    if store_settings.database_url.startswith("postgresql"):
        with session_scope(store_settings) as session:
            session.execute(text("ALTER TABLE usermemories DROP COLUMN tenant_ref"))
        dispose_engines()


def _tenants(settings: Settings, user_id: str) -> dict[str, str | None]:
    with session_scope(settings) as session:
        rows = session.execute(text("SELECT key, tenant_ref FROM usermemories WHERE user_id = :u"), {"u": user_id})
        return {row.key: row.tenant_ref for row in rows}


def _set_tenants(settings: Settings, user_id: str) -> None:
    with session_scope(settings) as session:
        session.execute(
            text("UPDATE usermemories SET tenant_ref = 'tenant-' || key WHERE user_id = :u"), {"u": user_id}
        )


def _archived(settings: Settings, user_id: str) -> dict[str, dict[str, Any]]:
    with session_scope(settings) as session:
        rows = session.scalars(select(ArchivedEntry.row).where(ArchivedEntry.user_id == user_id))
        out = [json.loads(r) if isinstance(r, str) else r for r in rows]
    return {r["key"]: r for r in out}


def test_prune_resolution_and_summary_archive_the_host_columns_and_restore_brings_them_back(
    host_settings: Settings,
) -> None:
    settings = host_settings.model_copy(update={"contradiction_resolution": "keep_newest"})
    seed(
        settings,
        [
            entry("u1", "stale", "old", age_days=300),
            entry("u1", "city", "Berlin", agent="a", age_days=10),
            entry("u1", "City", "Paris", agent="b", age_days=1),
            *[entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)],
        ],
    )
    _set_tenants(settings, "u1")
    before = _tenants(settings, "u1")
    outcome = dream_user(settings, "u1")
    assert (outcome.entries_pruned, outcome.contradictions_resolved, outcome.entries_summarized) == (1, 1, 5)
    assert outcome.run_id is not None

    archived = _archived(settings, "u1")
    # Each removal path: prune, keep_newest and summarization.
    for key in ("stale", "city", *(f"n{i}" for i in range(5))):
        assert archived[key]["tenant_ref"] == f"tenant-{key}", key

    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), outcome.run_id)
    assert (result.restored, result.conflicts, result.removed_inserts, result.changed_since) == (7, 0, 2, 0)
    assert _tenants(settings, "u1") == before


def test_the_chunked_prune_archives_the_host_columns_of_each_users_rows(host_settings: Settings) -> None:
    seed(host_settings, [entry(u, "stale", f"old {u}", age_days=300) for u in ("u1", "u2")])
    for user_id in ("u1", "u2"):
        _set_tenants(host_settings, user_id)
    outcomes = dream_users(host_settings, ["u1", "u2"])
    assert [o.entries_pruned for o in outcomes] == [1, 1]
    for outcome in outcomes:
        assert _archived(host_settings, outcome.user_id)["stale"]["tenant_ref"] == "tenant-stale"
        assert outcome.run_id is not None
        with session_scope(host_settings) as session:
            assert restore_run(session, table_for(host_settings), outcome.run_id).restored == 1
    assert _tenants(host_settings, "u1") == _tenants(host_settings, "u2") == {"stale": "tenant-stale"}


def test_a_replaced_row_keeps_its_host_columns_in_the_archive(host_settings: Settings) -> None:
    from store.memories import upsert_entry

    seed(host_settings, [entry("u1", "seat", "aisle")])
    _set_tenants(host_settings, "u1")
    with session_scope(host_settings) as session:
        done = upsert_entry(
            session, table_for(host_settings), user_id="u1", key="seat", value="window", category="fact",
            source="session_end", source_agent_id="agent-a", signal_id=7,
        )  # fmt: skip
    assert done.action == "update"
    assert _archived(host_settings, "u1")["seat"]["tenant_ref"] == "tenant-seat"
    assert _tenants(host_settings, "u1") == {"seat": "tenant-seat"}


def test_restored_rows_survive_the_next_pass_and_the_restore_is_an_event(store_settings: Settings) -> None:
    settings = store_settings.model_copy(update={"summarize_interactions": False})
    rows = seed(settings, [entry("u1", "hotel", "Ibis", age_days=300), entry("u1", "meal", "veg", age_days=200)])
    first = dream_user(settings, "u1")
    assert first.entries_pruned == 2 and first.run_id is not None
    with session_scope(settings) as session:
        assert restore_run(session, table_for(settings), first.run_id).restored == 2
    restored = entries_of(settings, "u1")
    # The host's updated_at is left as it was.
    assert {r["updated_at"] for r in restored.values()} == {r["updated_at"] for r in rows}

    second = dream_user(settings, "u1")
    assert second.status == "succeeded" and second.entries_pruned == 0
    assert entries_of(settings, "u1") == restored
    with session_scope(settings) as session:
        events = session.execute(
            select(Event.entry_id, Event.source, Event.run_id).where(Event.action == "restore")
        ).all()
    assert sorted(events) == sorted((r["id"], "restore", first.run_id) for r in rows)


def test_restored_row_is_pruned_again_once_its_grace_has_passed(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [entry("u1", "hotel", "Ibis", age_days=300)])
    first = dream_user(settings, "u1")
    assert first.run_id is not None
    with session_scope(settings) as session:
        restore_run(session, table_for(settings), first.run_id)
        # The restore happened longer ago than pruneStaleAfterDays.
        session.execute(update(EntryState).values(last_recalled_at=now().replace(year=now().year - 1)))
    assert dream_user(settings, "u1").entries_pruned == 1


def test_restore_leaves_a_summary_the_application_edited_and_reports_it(store_settings: Settings) -> None:
    seed(store_settings, [entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)])
    outcome = dream_user(store_settings, "u1")
    assert outcome.entries_summarized == 5 and outcome.run_id is not None
    summaries = entries_of(store_settings, "u1")
    assert len(summaries) == 2
    edited, untouched = sorted(summaries)
    table = table_for(store_settings)
    with session_scope(store_settings) as session:
        session.execute(update(table).where(table.c.id == edited).values(value="edited by the user", updated_at=now()))

    with session_scope(store_settings) as session:
        result = restore_run(session, table, outcome.run_id)
    assert (result.removed_inserts, result.changed_since, result.restored) == (1, 1, 5)
    after = entries_of(store_settings, "u1")
    assert edited in after and after[edited]["value"] == "edited by the user"
    assert untouched not in after
    assert {r["key"] for r in after.values()} == {summaries[edited]["key"], *(f"n{i}" for i in range(5))}
    # Nothing of the edit went into the archive: it was never removed.
    with session_scope(store_settings) as session:
        assert session.scalar(select(ArchivedEntry.id).where(ArchivedEntry.entry_id == edited)) is None


def test_restore_removal_archives_host_columns_of_the_rows_it_takes_out(host_settings: Settings) -> None:
    seed(host_settings, [entry("u1", "x", "1")])
    _set_tenants(host_settings, "u1")
    table = table_for(host_settings)
    with session_scope(host_settings) as session:
        gone = remove_entries(session, table, table.c.user_id == "u1", reason="prune", source="prune")
    assert len(gone) == 1
    assert _archived(host_settings, "u1")["x"]["tenant_ref"] == "tenant-x"


def test_a_restore_leaves_the_columns_the_database_makes_to_the_database(pg_settings: Settings) -> None:
    # A host column generated from the key: PostgreSQL refuses a value for it, so putting
    # the row back with every archived column failed, and the whole restore with it.
    with session_scope(pg_settings) as session:
        session.execute(
            text("ALTER TABLE usermemories ADD COLUMN key_len int GENERATED ALWAYS AS (length(key)) STORED")
        )
    dispose_engines()
    try:
        seed(pg_settings, [entry("u1", "stale", "old", age_days=300), entry("u1", "city", "Berlin")])
        outcome = dream_user(pg_settings, "u1")
        assert outcome.entries_pruned == 1 and outcome.run_id is not None
        with session_scope(pg_settings) as session:
            result = restore_run(session, table_for(pg_settings), outcome.run_id)
        assert (result.restored, result.conflicts) == (1, 0)
        with session_scope(pg_settings) as session:
            rows = session.execute(text("SELECT key, key_len FROM usermemories WHERE user_id = 'u1' ORDER BY key"))
            assert [tuple(r) for r in rows] == [("city", 4), ("stale", 5)]
    finally:
        with session_scope(pg_settings) as session:
            session.execute(text("ALTER TABLE usermemories DROP COLUMN key_len"))
        dispose_engines()


def test_restoring_an_overwrite_keeps_what_the_application_wrote_since_beside_the_value(
    host_settings: Settings,
) -> None:
    """The application records a recall and sets its own column after Reverie's
    overwrite, leaving ``updated_at`` alone: the restore puts back the value Reverie
    overwrote and keeps both."""
    from store.archive import restore_signal
    from store.memories import upsert_entry

    table = table_for(host_settings)
    seed(host_settings, [entry("u1", "seat", "aisle", access_count=2)])
    before = entries_of(host_settings, "u1")
    with session_scope(host_settings) as session:
        done = upsert_entry(
            session, table, user_id="u1", key="seat", value="window", category="preference",
            source="session_end", source_agent_id="agent-a", signal_id=7,
        )  # fmt: skip
    assert done.action == "update"
    with session_scope(host_settings) as session:
        session.execute(text("UPDATE usermemories SET access_count = 9, tenant_ref = 'tenant-9' WHERE user_id = 'u1'"))

    with session_scope(host_settings) as session:
        assert restore_signal(session, table, 7).restored == 1
    (after,) = entries_of(host_settings, "u1").values()
    (was,) = before.values()
    put_back = ("value", "category", "updated_at")
    assert [after[name] for name in put_back] == [was[name] for name in put_back]
    assert after["access_count"] == 9
    assert _tenants(host_settings, "u1") == {"seat": "tenant-9"}
    # The restore records the recalls the row holds as seen: the next pass counts none as new.
    with session_scope(host_settings) as session:
        assert session.scalar(select(EntryState.access_count_seen).where(EntryState.user_id == "u1")) == 9


@pytest.fixture()
def typed_host_settings(store_settings: Settings) -> Iterator[Settings]:
    """The memory table with host columns of the types JSON has no form of: a day, a
    time of day, an exact decimal and bytes."""
    binary = "BYTEA" if store_settings.database_url.startswith("postgresql") else "BLOB"
    added = ["born DATE", "wake TIME", "score NUMERIC(10, 2)", f"photo {binary}"]
    with session_scope(store_settings) as session:
        for column in added:
            session.execute(text(f"ALTER TABLE usermemories ADD COLUMN {column}"))
    dispose_engines()
    yield store_settings
    if store_settings.database_url.startswith("postgresql"):
        with session_scope(store_settings) as session:
            for column in added:
                session.execute(text(f"ALTER TABLE usermemories DROP COLUMN {column.split()[0]}"))
        dispose_engines()


def _typed_columns(settings: Settings) -> list[tuple[Any, ...]]:
    with session_scope(settings) as session:
        found = session.execute(text("SELECT key, born, wake, score, photo FROM usermemories ORDER BY key"))
        return [tuple(row) for row in found]


def test_host_columns_of_every_type_are_archived_and_put_back_as_they_were(typed_host_settings: Settings) -> None:
    settings = typed_host_settings
    seed(settings, [entry("u1", "stale", "old", age_days=300), entry("u1", "bare", "kept", age_days=300)])
    with session_scope(settings) as session:
        session.execute(
            text(
                "UPDATE usermemories SET born = '1990-05-17', wake = '07:30:00', score = 12.50, photo = :photo "
                "WHERE key = 'stale'"
            ),
            {"photo": b"\x00\xff\x10"},
        )
    before = _typed_columns(settings)
    assert before[1][1:] != (None, None, None, None)
    outcome = dream_user(settings, "u1")
    assert outcome.entries_pruned == 2 and outcome.run_id is not None
    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), outcome.run_id)
    assert (result.restored, result.conflicts) == (2, 0)
    assert _typed_columns(settings) == before


@pytest.fixture()
def bytea_sqlite(sqlite_settings: Settings) -> Iterator[Settings]:
    with session_scope(sqlite_settings) as session:
        # The same DDL a host uses for PostgreSQL (BYTEA), and an untyped column.
        session.execute(text("ALTER TABLE usermemories ADD COLUMN photo BYTEA"))
        session.execute(text("ALTER TABLE usermemories ADD COLUMN blob_any"))
    dispose_engines()
    yield sqlite_settings


def _photos(settings: Settings) -> list[tuple[Any, ...]]:
    return _stored(
        settings, "SELECT key, photo, typeof(photo), blob_any, typeof(blob_any) FROM usermemories ORDER BY key"
    )


def _stored(settings: Settings, sql: str) -> list[tuple[Any, ...]]:
    """The rows of ``sql``, as SQLite stores them (with their storage classes)."""
    with session_scope(settings) as session:
        return [tuple(r) for r in session.execute(text(sql))]


def test_sqlite_bytes_in_a_bytea_or_untyped_host_column_survive_prune_and_restore(bytea_sqlite: Settings) -> None:
    settings = bytea_sqlite
    seed(settings, [entry("u1", "stale", "old", age_days=300)])
    with session_scope(settings) as session:
        session.execute(text("UPDATE usermemories SET photo = :p, blob_any = :p"), {"p": b"\x00\xff\x10"})
    before = _photos(settings)
    outcome = dream_user(settings, "u1")
    assert outcome.entries_pruned == 1 and outcome.run_id is not None
    with session_scope(settings) as session:
        assert restore_run(session, table_for(settings), outcome.run_id).restored == 1
    after = _photos(settings)
    assert after == before


@pytest.fixture()
def blob_sqlite(sqlite_settings: Settings) -> Iterator[Settings]:
    with session_scope(sqlite_settings) as session:
        session.execute(text("ALTER TABLE usermemories ADD COLUMN attachment BLOB"))
    dispose_engines()
    yield sqlite_settings


def test_sqlite_text_in_a_blob_host_column_is_restored(blob_sqlite: Settings) -> None:
    settings = blob_sqlite
    seed(settings, [entry("u1", "stale", "old", age_days=300), entry("u2", "stale", "old", age_days=300)])
    with session_scope(settings) as session:
        # SQLite keeps what it is given: a BLOB column may hold text.
        session.execute(text("UPDATE usermemories SET attachment = 'see-notes' WHERE user_id = 'u1'"))
        session.execute(text("UPDATE usermemories SET attachment = '\\x41' WHERE user_id = 'u2'"))
    before = _att(settings)
    run_ids = []
    for user in ("u1", "u2"):
        outcome = dream_user(settings, user)
        assert outcome.entries_pruned == 1
        run_ids.append(outcome.run_id)
    for run_id in run_ids:
        assert run_id is not None
        with session_scope(settings) as session:
            assert restore_run(session, table_for(settings), run_id).restored == 1
    after = _att(settings)
    assert after == before


def _att(settings: Settings) -> list[tuple[Any, ...]]:
    return _stored(settings, "SELECT user_id, attachment, typeof(attachment) FROM usermemories ORDER BY user_id")


def test_restore_puts_json_values_back_exactly_digits_and_nulls_alike(pg_settings: Settings) -> None:
    """The host's values as PostgreSQL holds them: a number's every digit, ``100.50``
    with its zero, the JSON value ``null`` and SQL NULL (two things) come back from the
    archive as they were, through the real command line."""
    from tests.test_cli import run

    values = {
        "pi": "'3.14159265358979323846264338327950288'::jsonb",
        "price": """'{"p": 100.50, "q": [1.0, 2e3]}'::jsonb""",
        "json_null": "'null'::jsonb",
        "sql_null": "NULL",
        "text": """'"Bob"'::jsonb""",
    }
    with session_scope(pg_settings) as session:
        for key, value in values.items():
            groups = "NULL" if key == "sql_null" else "'null'::jsonb" if key == "json_null" else "'[\"g\"]'::jsonb"
            session.execute(
                text(
                    "INSERT INTO usermemories (id, user_id, key, value, group_ids, created_at, updated_at) "
                    f"VALUES (:id, 'u1', :key, {value}, {groups}, now() - interval '300 days', "
                    "now() - interval '300 days')"
                ),
                {"id": f"e-{key}", "key": key},
            )

    def stored() -> dict[str, tuple[Any, ...]]:
        with session_scope(pg_settings) as session:
            rows = session.execute(
                text(
                    "SELECT key, value::text, value IS NULL, group_ids::text, group_ids IS NULL "
                    "FROM usermemories WHERE user_id = 'u1'"
                )
            )
            return {row[0]: tuple(row[1:]) for row in rows}

    before = stored()
    assert before["pi"][0] == "3.14159265358979323846264338327950288"
    assert before["price"][0] == '{"p": 100.50, "q": [1.0, 2000]}'
    outcome = dream_user(pg_settings.model_copy(update={"summarize_interactions": False}), "u1")
    assert outcome.entries_pruned == len(values) and stored() == {}
    done = run(["restore", "--run", str(outcome.run_id)], env={"REVERIE_DATABASE_URL": pg_settings.database_url})
    assert done.returncode == 0, done.stderr
    assert stored() == before


def test_a_json_column_the_host_adds_or_drops_while_reverie_runs(pg_settings: Settings) -> None:
    """In one process (a worker's pooled connections): a JSON column added since holds
    SQL NULL through a prune and a restore, and one dropped since fails no dream."""
    from store.memories import json_column_names

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [entry("u1", "warm", "up", age_days=300)])
    assert dream_user(settings, "u1").entries_pruned == 1  # the connections know the table as it was
    with session_scope(settings) as session:
        # On one connection, before and after: what the catalog says now, every time.
        assert "later" not in json_column_names(session, table_for(settings))
        session.execute(text("ALTER TABLE usermemories ADD COLUMN later jsonb"))
        assert "later" in json_column_names(session, table_for(settings))
    try:
        seed(settings, [entry("u2", "stale", "old", age_days=300)])
        pruned = dream_user(settings, "u2")
        assert pruned.entries_pruned == 1 and pruned.run_id is not None
        with session_scope(settings) as session:
            restore_run(session, table_for(settings), pruned.run_id)
            back = session.execute(text("SELECT later IS NULL FROM usermemories WHERE user_id = 'u2'")).scalar()
        assert back is True
    finally:
        with session_scope(settings) as session:
            session.execute(text("ALTER TABLE usermemories DROP COLUMN later"))
    seed(settings, [entry("u3", "stale", "old", age_days=300)])
    assert dream_user(settings, "u3").status == "succeeded"


def test_a_host_column_of_a_domain_over_jsonb_keeps_json_null_apart_from_sql_null(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    with session_scope(settings) as session:
        session.execute(text("CREATE DOMAIN jdom AS jsonb"))
        session.execute(text("CREATE DOMAIN jdom2 AS jdom"))
        session.execute(text("ALTER TABLE usermemories ADD COLUMN attrs jdom, ADD COLUMN deeper jdom2"))
    try:
        seed(settings, [entry("u1", "json_null", "a", age_days=300), entry("u1", "sql_null", "b", age_days=300)])
        with session_scope(settings) as session:
            session.execute(text("UPDATE usermemories SET attrs = 'null', deeper = 'null' WHERE key = 'json_null'"))
        pruned = dream_user(settings, "u1")
        assert pruned.entries_pruned == 2 and pruned.run_id is not None
        with session_scope(settings) as session:
            restore_run(session, table_for(settings), pruned.run_id)
            found = session.execute(
                text("SELECT key, attrs IS NULL, deeper IS NULL FROM usermemories WHERE user_id = 'u1'")
            ).all()
            back = {key: (attrs, deeper) for key, attrs, deeper in found}
        assert back == {"json_null": (False, False), "sql_null": (True, True)}
    finally:
        with session_scope(settings) as session:
            session.execute(text("ALTER TABLE usermemories DROP COLUMN attrs, DROP COLUMN deeper"))
            session.execute(text("DROP DOMAIN jdom2"))
            session.execute(text("DROP DOMAIN jdom"))


def test_an_archive_row_from_before_the_null_tag_restores_its_null_as_the_json_value(pg_settings: Settings) -> None:
    """An archive row written by an older release (no tag naming SQL NULL columns): a
    null in it, which could have been either, comes back as the JSON value ``null``."""
    from store.memories import SQL_NULL_KEY

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [entry("u1", "stale", "old", age_days=300)])
    with session_scope(settings) as session:
        session.execute(text("UPDATE usermemories SET value = NULL WHERE user_id = 'u1'"))
    outcome = dream_user(settings, "u1")
    assert outcome.entries_pruned == 1 and outcome.run_id is not None
    with session_scope(settings) as session:
        assert session.execute(text("SELECT row ? :k FROM dream_archive"), {"k": SQL_NULL_KEY}).scalar() is True
        session.execute(text("UPDATE dream_archive SET row = row - CAST(:k AS text)"), {"k": SQL_NULL_KEY})
        restore_run(session, table_for(settings), outcome.run_id)
        back = session.execute(text("SELECT value IS NULL, value::text FROM usermemories WHERE user_id = 'u1'"))
        assert tuple(back.one()) == (False, "null")


#: Host column names SQL text can mistake for something else: a bind parameter
#: (``:name``), a driver's placeholder (``%s``, ``%(x)s``), a quote, a backslash.
ODD_COLUMNS = (":tag", "50% off", "%(x)s", "a:b", 'say "hi"', "it's", "back\\slash", "?", "::x")


def _odd(column: str) -> str:
    """The column's name quoted, in SQL text (``text()``: a colon escaped)."""
    return '"' + column.replace('"', '""').replace(":", "\\:") + '"'


@pytest.fixture()
def odd_host_settings(store_settings: Settings) -> Iterator[Settings]:
    """The memory table with host columns whose names SQL text can misread."""
    with session_scope(store_settings) as session:
        for column in ODD_COLUMNS:
            kind = "JSONB" if column.startswith("%") else "TEXT"  # a JSON column is named in the archive's rows
            session.execute(text(f"ALTER TABLE usermemories ADD COLUMN {_odd(column)} {kind}"))
    dispose_engines()
    yield store_settings
    if store_settings.database_url.startswith("postgresql"):
        with session_scope(store_settings) as session:
            for column in ODD_COLUMNS:
                session.execute(text(f"ALTER TABLE usermemories DROP COLUMN {_odd(column)}"))
        dispose_engines()


def test_host_columns_with_odd_names_are_archived_and_put_back(odd_host_settings: Settings) -> None:
    settings = odd_host_settings
    seed(settings, [entry("u1", "stale", "old", age_days=300), entry("u2", "stale", "old", age_days=300)])
    with session_scope(settings) as session:
        for index, column in enumerate(ODD_COLUMNS):
            value = f"value {index}" if not column.startswith("%") else json.dumps(f"value {index}")
            session.execute(text(f"UPDATE usermemories SET {_odd(column)} = :v"), {"v": value})
    columns = ", ".join(map(_odd, ODD_COLUMNS))

    def stored() -> list[tuple[Any, ...]]:
        with session_scope(settings) as session:
            return [tuple(r) for r in session.execute(text(f"SELECT user_id, {columns} FROM usermemories ORDER BY 1"))]

    before = stored()
    assert len(before) == 2 and None not in before[0] + before[1]
    outcomes = [dream_user(settings, "u1"), *dream_users(settings, ["u2"])]
    assert [o.entries_pruned for o in outcomes] == [1, 1]
    assert stored() == []
    for outcome in outcomes:
        assert outcome.run_id is not None
        with session_scope(settings) as session:
            assert restore_run(session, table_for(settings), outcome.run_id).restored == 1
    assert stored() == before


def test_restoring_an_overwrite_the_application_dated_infinity_leaves_it(pg_settings: Settings) -> None:
    # The application wrote after Reverie: the restore leaves its row (the driver reads
    # no infinite time: the restore failed instead).
    from store.archive import restore_signal
    from store.memories import upsert_entry

    table = table_for(pg_settings)
    seed(pg_settings, [entry("u1", "seat", "aisle")])
    with session_scope(pg_settings) as session:
        upsert_entry(
            session, table, user_id="u1", key="seat", value="window", category="preference",
            source="session_end", source_agent_id="agent-a", signal_id=7,
        )  # fmt: skip
        session.execute(text("UPDATE usermemories SET updated_at = 'infinity' WHERE user_id = 'u1'"))
    with session_scope(pg_settings) as session:
        result = restore_signal(session, table, 7)
    assert (result.restored, result.changed_since) == (0, 1)
    with session_scope(pg_settings) as session:
        held = session.execute(text("SELECT value #>> '{}', updated_at::text FROM usermemories")).all()
    assert [tuple(row) for row in held] == [("window", "infinity")]


def test_a_row_the_hosts_foreign_key_refuses_now_stays_archived_and_the_others_go_back(
    pg_settings: Settings,
) -> None:
    """A host column references a table of the host's; one row's parent was deleted
    since the prune. That row stays in the archive (a conflict, to restore once the
    parent is back); the others are put back, not the whole restore refused."""
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    with session_scope(settings) as session:
        session.execute(text("CREATE TABLE conversations (id text PRIMARY KEY)"))
        session.execute(text("INSERT INTO conversations VALUES ('cv1'), ('cv2')"))
        session.execute(
            text("ALTER TABLE usermemories ADD COLUMN conv text REFERENCES conversations (id) ON DELETE SET NULL")
        )
    try:
        seed(settings, [entry("u1", f"k{i}", f"v{i}", age_days=300) for i in range(3)])
        with session_scope(settings) as session:
            session.execute(text("UPDATE usermemories SET conv = 'cv1' WHERE key = 'k0'"))
            session.execute(text("UPDATE usermemories SET conv = 'cv2' WHERE key = 'k1'"))
        pruned = dream_user(settings, "u1")
        assert pruned.entries_pruned == 3 and pruned.run_id is not None
        with session_scope(settings) as session:
            session.execute(text("DELETE FROM conversations WHERE id = 'cv2'"))
        with session_scope(settings) as session:
            result = restore_run(session, table_for(settings), pruned.run_id)
        assert (result.restored, result.conflicts) == (2, 1)
        with session_scope(settings) as session:
            back = dict(session.execute(text("SELECT key, conv FROM usermemories WHERE user_id = 'u1'")).all())
            waiting = session.execute(
                text("SELECT entry_id FROM dream_archive WHERE restored_at IS NULL AND reason = 'prune'")
            ).all()
        assert back == {"k0": "cv1", "k2": None}
        assert len(waiting) == 1
    finally:
        with session_scope(settings) as session:
            session.execute(text("ALTER TABLE usermemories DROP COLUMN conv"))
            session.execute(text("DROP TABLE conversations"))
