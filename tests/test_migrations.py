"""``reverie migrate``: the memory table's layout, the dream_ tables, idempotence,
and an existing EDDI table left exactly as it was."""

from __future__ import annotations

import hashlib
import json
import uuid

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from psycopg import sql

from store.db import dispose_engines, get_engine
from store.migrate import VERSION_TABLE, head_revision, upgrade
from store.models import Base
from tests.conftest import PG_ADMIN_URL, _base_settings, pg_url_for

EDDI_DDL = [
    """CREATE TABLE IF NOT EXISTS usermemories (
        id VARCHAR(64) PRIMARY KEY DEFAULT gen_random_uuid()::text,
        user_id VARCHAR(255) NOT NULL,
        key VARCHAR(255) NOT NULL,
        value JSONB,
        category VARCHAR(50) NOT NULL DEFAULT 'fact',
        visibility VARCHAR(20) NOT NULL DEFAULT 'self',
        source_agent_id VARCHAR(255),
        group_ids JSONB DEFAULT '[]'::jsonb,
        source_conversation_id VARCHAR(255),
        conflicted BOOLEAN DEFAULT FALSE,
        access_count INTEGER DEFAULT 0,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
    )""",
    "CREATE INDEX IF NOT EXISTS idx_um_user_vis_agent_key ON usermemories (user_id, visibility, source_agent_id, key)",
    "CREATE INDEX IF NOT EXISTS idx_um_user_updated ON usermemories (user_id, updated_at DESC)",
    "CREATE INDEX IF NOT EXISTS idx_um_user_category ON usermemories (user_id, category)",
    "CREATE UNIQUE INDEX IF NOT EXISTS idx_um_upsert_global ON usermemories (user_id, key) WHERE visibility = 'global'",
    "CREATE UNIQUE INDEX IF NOT EXISTS idx_um_upsert_agent ON usermemories (user_id, key, source_agent_id)"
    " WHERE visibility != 'global'",
    "CREATE INDEX IF NOT EXISTS idx_um_user_access_count ON usermemories (user_id, access_count DESC)",
]

EXPECTED_COLUMNS = {
    # column: (type, nullable, default)
    "id": ("character varying(64)", "NO", "(gen_random_uuid())::text"),
    "user_id": ("character varying(255)", "NO", None),
    "key": ("character varying(255)", "NO", None),
    "value": ("jsonb", "YES", None),
    "category": ("character varying(50)", "NO", "'fact'::character varying"),
    "visibility": ("character varying(20)", "NO", "'self'::character varying"),
    "source_agent_id": ("character varying(255)", "YES", None),
    "group_ids": ("jsonb", "YES", "'[]'::jsonb"),
    "source_conversation_id": ("character varying(255)", "YES", None),
    "conflicted": ("boolean", "YES", "false"),
    "access_count": ("integer", "YES", "0"),
    "created_at": ("timestamp without time zone", "YES", "CURRENT_TIMESTAMP"),
    "updated_at": ("timestamp without time zone", "YES", "CURRENT_TIMESTAMP"),
}

EXPECTED_INDEXES = {
    "usermemories_pkey": "CREATE UNIQUE INDEX usermemories_pkey ON public.usermemories USING btree (id)",
    "idx_um_user_vis_agent_key": "CREATE INDEX idx_um_user_vis_agent_key ON public.usermemories USING btree "
    "(user_id, visibility, source_agent_id, key)",
    "idx_um_user_updated": "CREATE INDEX idx_um_user_updated ON public.usermemories USING btree "
    "(user_id, updated_at DESC)",
    "idx_um_user_category": "CREATE INDEX idx_um_user_category ON public.usermemories USING btree (user_id, category)",
    "idx_um_user_access_count": "CREATE INDEX idx_um_user_access_count ON public.usermemories USING btree "
    "(user_id, access_count DESC)",
    "idx_um_upsert_global": "CREATE UNIQUE INDEX idx_um_upsert_global ON public.usermemories USING btree "
    "(user_id, key) WHERE ((visibility)::text = 'global'::text)",
    "idx_um_upsert_agent": "CREATE UNIQUE INDEX idx_um_upsert_agent ON public.usermemories USING btree "
    "(user_id, key, source_agent_id) WHERE ((visibility)::text <> 'global'::text)",
}

DREAM_TABLES = {t.name for t in Base.metadata.sorted_tables}


@pytest.fixture()
def empty_pg() -> object:
    """A brand-new, empty PostgreSQL database (not the run's migrated one)."""
    name = f"reverie_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield pg_url_for(name)
    dispose_engines()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _plain(url: str) -> str:
    return url.replace("+psycopg", "")


def test_empty_database_gets_the_documented_memory_table(empty_pg: str) -> None:
    before, after = upgrade(_base_settings(database_url=empty_pg))
    assert (before, after) == (None, head_revision())
    with psycopg.connect(_plain(empty_pg)) as conn:
        columns = {
            name: (dtype, nullable, default)
            for name, dtype, nullable, default in conn.execute(
                "SELECT column_name, format_type(a.atttypid, a.atttypmod), is_nullable, column_default "
                "FROM information_schema.columns c JOIN pg_attribute a "
                "ON a.attrelid = 'usermemories'::regclass AND a.attname = c.column_name "
                "WHERE table_name = 'usermemories'"
            )
        }
        indexes = dict(conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'usermemories'"))
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert columns == EXPECTED_COLUMNS
    assert indexes == EXPECTED_INDEXES
    assert DREAM_TABLES | {VERSION_TABLE, "usermemories"} == tables


def test_migrate_twice_is_a_no_op(empty_pg: str) -> None:
    settings = _base_settings(database_url=empty_pg)
    upgrade(settings)
    assert upgrade(settings) == (head_revision(), head_revision())


def test_a_postgresql_older_than_served_is_refused_before_any_change(
    empty_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import store.db
    from worker.errors import ConfigError

    settings = _base_settings(database_url=empty_pg)
    with psycopg.connect(_plain(empty_pg)) as conn:
        number = int(conn.execute("SHOW server_version_num").fetchone()[0])  # type: ignore[index]
    assert number >= store.db.MIN_POSTGRESQL  # the server the suite runs on is served
    # As if this server were one major version short of the oldest served.
    monkeypatch.setattr(store.db, "MIN_POSTGRESQL", (number // 10000 + 1) * 10000)
    with pytest.raises(ConfigError, match=rf"PostgreSQL {number // 10000 + 1} or newer is needed; this server is"):
        upgrade(settings)
    with psycopg.connect(_plain(empty_pg)) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)


def _table_fingerprint(url: str) -> tuple[str, str, str]:
    """Rows (as text, in id order), columns and indexes of usermemories."""
    with psycopg.connect(_plain(url)) as conn:
        rows = conn.execute("SELECT t::text FROM usermemories t ORDER BY id").fetchall()
        cols = conn.execute(
            "SELECT string_agg(column_name || ':' || data_type || ':' || coalesce(column_default, ''), ',' "
            "ORDER BY ordinal_position) FROM information_schema.columns WHERE table_name = 'usermemories'"
        ).fetchone()
        idx = conn.execute(
            "SELECT string_agg(indexdef, ';' ORDER BY indexname) FROM pg_indexes WHERE tablename = 'usermemories'"
        ).fetchone()
    digest = hashlib.sha256("\n".join(r[0] for r in rows).encode()).hexdigest()
    return digest, str(cols), str(idx)


def test_existing_eddi_table_is_left_byte_for_byte(empty_pg: str) -> None:
    with psycopg.connect(_plain(empty_pg), autocommit=True) as conn:
        for statement in EDDI_DDL:
            conn.execute(statement)
        # An application that added a column of its own must keep it, too.
        conn.execute("ALTER TABLE usermemories ADD COLUMN last_accessed_at TIMESTAMP")
        conn.execute(
            "INSERT INTO usermemories (user_id, key, value, category, visibility, source_agent_id, access_count, "
            "created_at, updated_at) SELECT 'u' || (i % 7), 'k' || i, to_jsonb('v' || i), "
            "(ARRAY['fact','preference','property'])[1 + i % 3], (ARRAY['self','group','global'])[1 + i % 3], "
            "'agent-' || (i % 2), i % 5, now() - (i || ' days')::interval, now() - (i || ' hours')::interval "
            "FROM generate_series(1, 300) i"
        )
    before = _table_fingerprint(empty_pg)
    upgrade(_base_settings(database_url=empty_pg))
    upgrade(_base_settings(database_url=empty_pg))
    assert _table_fingerprint(empty_pg) == before


def test_custom_memory_table_name(empty_pg: str) -> None:
    upgrade(_base_settings(database_url=empty_pg, memory_table="agent_memory"))
    with psycopg.connect(_plain(empty_pg)) as conn:
        names = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'agent_memory'")}
    assert "idx_agent_memory_upsert_global" in names and "idx_agent_memory_upsert_agent" in names


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_models_and_migrations_agree(backend: str, request: pytest.FixtureRequest) -> None:
    settings = request.getfixturevalue("pg_settings" if backend == "postgresql" else "sqlite_settings")
    with get_engine(settings).connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={
                "include_name": lambda name, type_, parent: (
                    type_ != "table" or (str(name).startswith("dream_") and name != VERSION_TABLE)
                ),
                "compare_server_default": False,
            },
        )
        diff = compare_metadata(context, Base.metadata)
    assert diff == []


def test_sqlite_gets_every_table(sqlite_settings: object) -> None:
    from sqlalchemy import inspect

    names = set(inspect(get_engine(sqlite_settings)).get_table_names())  # type: ignore[arg-type]
    assert DREAM_TABLES | {"usermemories", VERSION_TABLE} <= names


def test_plain_sql_signal_gets_every_default(pg_settings: object) -> None:
    url = _plain(pg_settings.database_url)  # type: ignore[attr-defined]
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'u1', '{\"events\": []}') "
            "RETURNING status, attempts, idempotency_key, enqueued_at, available_at, processed_at"
        ).fetchone()
        assert row is not None
        status, attempts, key, enqueued_at, available_at, processed_at = row
        assert (status, attempts, processed_at) == ("pending", 0, None)
        assert len(key) == 64 and enqueued_at is not None and available_at is not None
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(
                "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'u1', '{\"events\":[]}')"
            )


def test_upgrading_marks_for_a_rebuild_the_profiles_of_users_with_entries_no_agent_owns(empty_pg: str) -> None:
    # Profiles built before they showed the entries no agent owns: the memory did not
    # change, so only the mark makes the next dream build them again, with those entries.
    from tasks.dream import dream_users
    from tests.dream_seed import entry, seed

    settings = _base_settings(database_url=empty_pg)
    upgrade(settings, "0014")
    seed(
        settings,
        [
            entry("u-ownerless", "city", "Lisbon", visibility="self", agent=None),
            entry("u-ownerless", "pet", "cat", visibility="self", agent="agent-a"),
            entry("u-owned", "city", "Rome", visibility="self", agent="agent-a"),
        ],
    )
    assert {o.user_id: o.profiles_built for o in dream_users(settings, ["u-ownerless", "u-owned"])} == {
        "u-ownerless": 2,
        "u-owned": 2,
    }
    upgrade(settings)
    with psycopg.connect(_plain(empty_pg)) as conn:
        marked = conn.execute("SELECT DISTINCT user_id FROM dream_profiles WHERE source_rows = -1").fetchall()
    assert marked == [("u-ownerless",)]
    again = {o.user_id: o.profiles_built for o in dream_users(settings, ["u-ownerless", "u-owned"])}
    assert again == {"u-ownerless": 2, "u-owned": 0}


def test_the_commands_that_write_refuse_a_schema_an_earlier_release_left(empty_pg: str) -> None:
    """Mid-rollout, before `reverie migrate` ran: a cron pass must not write with this
    release's statements on the earlier schema."""
    from tests.test_cli import assert_one_line_error, run

    settings = _base_settings(database_url=empty_pg)
    upgrade(settings, "0012")
    dispose_engines()
    with psycopg.connect(_plain(empty_pg), autocommit=True) as conn:
        conn.execute("INSERT INTO usermemories (id, user_id, key, value) VALUES ('e1', 'u', 'k', '\"v\"')")
    env = {"REVERIE_DATABASE_URL": empty_pg}
    for args in (["health"], ["run", "--all"], ["restore", "--run", "1"], ["erase-user", "u", "--yes"]):
        result = run(args, env=env)
        assert result.returncode == 1, args
        assert_one_line_error(result, "is at revision 0012, not ", "run reverie migrate")
    with psycopg.connect(_plain(empty_pg)) as conn:
        assert conn.execute("SELECT count(*) FROM usermemories").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM dream_runs").fetchone() == (0,)


def test_migrate_and_health_name_a_schema_a_newer_release_migrated(empty_pg: str) -> None:
    # Not "unexpected CommandError", nor "run reverie migrate": the schema is ahead of this release.
    from tests.test_cli import assert_one_line_error, run

    upgrade(_base_settings(database_url=empty_pg))
    dispose_engines()
    with psycopg.connect(_plain(empty_pg), autocommit=True) as conn:
        conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = '9999'")
    env = {"REVERIE_DATABASE_URL": empty_pg}
    # The commands that write too (a cron `reverie run` after a rollback): nothing written.
    for args in (["migrate"], ["health"], ["run", "--all"], ["restore", "--run", "1"], ["erase-user", "u", "--yes"]):
        result = run(args, env=env)
        assert_one_line_error(result, "at revision 9999, newer than this release's", "run that release")
        assert "unexpected" not in result.stderr and "run reverie migrate" not in result.stderr
    with psycopg.connect(_plain(empty_pg)) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone() == ("9999",)


def test_migrations_started_at_once_all_succeed_and_apply_once(empty_pg: str) -> None:
    """Each replica's start-up (an init container per pod) runs `reverie migrate`: the
    ones that come second wait for the first, then find nothing left to do."""
    import os
    import subprocess

    from tests.test_cli import REVERIE

    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env["REVERIE_DATABASE_URL"] = empty_pg
    started = [
        subprocess.Popen([*REVERIE, "migrate"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in started]

    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    with psycopg.connect(_plain(empty_pg)) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(head_revision(),)]


def test_a_user_id_longer_than_reveries_tables_hold_is_left_alone_and_the_others_dream(empty_pg: str) -> None:
    """A host's `text` user_id may hold an id over 255 characters: that user is never
    scheduled nor dreamed, and migrate and every pass go on for the others (one such
    row stopped them all with a database error)."""
    from tests.test_cli import run

    with psycopg.connect(_plain(empty_pg), autocommit=True) as conn:
        for ddl in EDDI_DDL:
            conn.execute(ddl.replace("user_id VARCHAR(255)", "user_id TEXT"))
        conn.execute(
            "INSERT INTO usermemories (user_id, key, value) VALUES ('w2', 'k', '\"v\"'), (%s, 'k', '\"v\"')",
            ("u" * 300,),
        )
    env = {"REVERIE_DATABASE_URL": empty_pg}
    migrated = run(["migrate"], env=env)
    assert migrated.returncode == 0, migrated.stderr
    for args in (["run", "--json"], ["run", "--all", "--json"]):
        result = run(args, env=env)
        assert result.returncode == 0, (args, result.stderr)
    assert json.loads(result.stdout)["users_processed"] == 1
    with psycopg.connect(_plain(empty_pg)) as conn:
        assert conn.execute("SELECT user_id FROM dream_user_state").fetchall() == [("w2",)]
