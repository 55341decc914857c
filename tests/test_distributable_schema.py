"""The migrated schema is one Citus can distribute: every ``dream_`` table is declared
either distributed by ``user_id`` or a reference table (store.distribution), and the
live PostgreSQL catalog holds no primary key, unique constraint, unique index or
foreign key that would stop ``create_distributed_table``/``create_reference_table``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import inspect

from store.db import dispose_engines, get_engine
from store.distribution import ANCHOR, DISTRIBUTED, DISTRIBUTION_COLUMN, NUMBERED, REFERENCE, citus_statements
from store.migrate import VERSION_TABLE, downgrade, upgrade
from store.models import Base
from tests.conftest import PG_ADMIN_URL, _base_settings, pg_url_for
from worker.settings import Settings

# Every unique key (primary key, unique constraint, unique index, partial or not) and
# every foreign key of the dream_ tables, with their columns in key order.
_UNIQUE_KEYS = """
SELECT t.relname, i.relname, ARRAY(
    SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY k(attnum, n)
    JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum ORDER BY k.n
)::text[], x.indexprs IS NOT NULL
FROM pg_index x
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_namespace s ON s.oid = t.relnamespace
WHERE x.indisunique AND s.nspname = 'public' AND t.relname LIKE 'dream\\_%%'
"""
_FOREIGN_KEYS = """
SELECT t.relname, c.conname, r.relname,
    ARRAY(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(attnum, n)
          JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum ORDER BY k.n)::text[],
    ARRAY(SELECT a.attname FROM unnest(c.confkey) WITH ORDINALITY k(attnum, n)
          JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.attnum ORDER BY k.n)::text[]
FROM pg_constraint c
JOIN pg_class t ON t.oid = c.conrelid
JOIN pg_class r ON r.oid = c.confrelid
JOIN pg_namespace s ON s.oid = t.relnamespace
WHERE c.contype = 'f' AND s.nspname = 'public' AND (t.relname LIKE 'dream\\_%%' OR r.relname LIKE 'dream\\_%%')
"""
_TABLES = "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'dream\\_%%'"


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def blockers(url: str) -> list[str]:
    """Everything in the live schema that would stop the declared distribution."""
    found: list[str] = []
    with psycopg.connect(_plain(url)) as conn:
        tables = {row[0] for row in conn.execute(_TABLES)}
        for table in sorted(tables - DISTRIBUTED - REFERENCE):
            found.append(f"{table}: declared neither distributed nor reference")
        for table in sorted(tables & DISTRIBUTED & REFERENCE):
            found.append(f"{table}: declared both distributed and reference")
        for table, index, columns, on_expressions in conn.execute(_UNIQUE_KEYS):
            if table not in DISTRIBUTED:
                continue
            if on_expressions or DISTRIBUTION_COLUMN not in columns:
                found.append(f"{table}: unique key {index} ({', '.join(columns)}) lacks {DISTRIBUTION_COLUMN}")
        for table, name, referred, columns, referred_columns in conn.execute(_FOREIGN_KEYS):
            if table in REFERENCE and referred not in REFERENCE:
                found.append(f"{table}: reference table's foreign key {name} points at {referred}")
            elif table in DISTRIBUTED and referred in DISTRIBUTED:
                pairs = set(zip(columns, referred_columns, strict=True))
                if (DISTRIBUTION_COLUMN, DISTRIBUTION_COLUMN) not in pairs:
                    found.append(f"{table}: foreign key {name} to {referred} does not pair {DISTRIBUTION_COLUMN}")
            elif table in DISTRIBUTED and referred not in REFERENCE:
                found.append(f"{table}: foreign key {name} points at {referred}, neither distributed nor reference")
            elif table not in DISTRIBUTED | REFERENCE:
                found.append(f"{table}: foreign key {name} into {referred} from an undeclared table")
    return found


@pytest.fixture()
def fresh_pg() -> Iterator[Settings]:
    """A brand-new PostgreSQL database, not yet migrated."""
    name = f"reverie_dist_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield _base_settings(database_url=pg_url_for(name))
    finally:
        dispose_engines()
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_every_dream_table_is_declared_exactly_once() -> None:
    assert not DISTRIBUTED & REFERENCE
    assert {t.name for t in Base.metadata.sorted_tables} | {VERSION_TABLE} == DISTRIBUTED | REFERENCE
    assert NUMBERED <= DISTRIBUTED
    for table in Base.metadata.sorted_tables:
        if table.name in DISTRIBUTED:
            assert DISTRIBUTION_COLUMN in table.c, table.name


def test_migrated_schema_has_nothing_that_blocks_distribution(fresh_pg: Settings) -> None:
    upgrade(fresh_pg)
    assert blockers(fresh_pg.database_url) == []


def test_the_check_sees_what_would_block_distribution(fresh_pg: Settings) -> None:
    # The schema before this revision had keys on id alone: the check names them.
    upgrade(fresh_pg, "0009")
    found = blockers(fresh_pg.database_url)
    for table in NUMBERED:
        assert any(f.startswith(f"{table}: unique key pk_{table} (id)") for f in found), (table, found)
    assert any("dream_entry_state: unique key pk_dream_entry_state (entry_id)" in f for f in found)
    assert any("fk_dream_archive_run_id_dream_runs" in f for f in found)
    upgrade(fresh_pg)
    # And on the current schema it still sees each kind of blocker when one appears.
    with psycopg.connect(_plain(fresh_pg.database_url), autocommit=True) as conn:
        conn.execute("CREATE UNIQUE INDEX probe_runs_started ON dream_runs (started_at) WHERE status = 'running'")
        conn.execute("CREATE UNIQUE INDEX probe_events_lower ON dream_events (lower(key), user_id)")
        conn.execute("CREATE TABLE dream_probe (id bigint PRIMARY KEY)")
        conn.execute(
            "ALTER TABLE dream_policies ADD COLUMN run_user text, ADD COLUMN run_id bigint, "
            "ADD CONSTRAINT fk_probe FOREIGN KEY (run_user, run_id) REFERENCES dream_runs (user_id, id)"
        )
        conn.execute(
            "ALTER TABLE dream_events ADD CONSTRAINT fk_probe_events FOREIGN KEY (signal_id) "
            "REFERENCES dream_reservations (id)"
        )
        conn.execute("ALTER TABLE dream_signals ADD CONSTRAINT uq_probe UNIQUE (kind, id)")
    found = blockers(fresh_pg.database_url)
    assert any("probe_runs_started" in f for f in found)
    assert any("probe_events_lower" in f for f in found)
    assert "dream_probe: declared neither distributed nor reference" in found
    assert any("dream_policies: reference table's foreign key fk_probe" in f for f in found)
    assert any("uq_probe" in f for f in found)
    # A distributed table may point at a reference table.
    assert not any("fk_probe_events" in f for f in found)


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_primary_keys_match_the_models(backend: str, request: pytest.FixtureRequest) -> None:
    # Alembic's comparison (tests/test_migrations.py) does not look at primary keys.
    settings = request.getfixturevalue("pg_settings" if backend == "postgresql" else "sqlite_settings")
    inspector = inspect(get_engine(settings))
    for table in Base.metadata.sorted_tables:
        live = inspector.get_pk_constraint(table.name)["constrained_columns"]
        declared = [c.name for c in table.primary_key.columns]
        expected = ["id"] if backend == "sqlite" and table.name in NUMBERED else declared
        assert live == expected, table.name


def _count(conn: psycopg.Connection[tuple[object, ...]], table: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    assert row is not None
    return int(str(row[0]))


def test_upgrade_and_downgrade_keep_the_data(fresh_pg: Settings) -> None:
    upgrade(fresh_pg, "0009")
    with psycopg.connect(_plain(fresh_pg.database_url), autocommit=True) as conn:
        conn.execute("INSERT INTO dream_runs (user_id) SELECT 'u' || i FROM generate_series(1, 20) i")
        conn.execute(
            "INSERT INTO dream_archive (run_id, user_id, entry_id, reason, row) "
            "SELECT id, user_id, 'e' || id, 'prune', '{}'::jsonb FROM dream_runs"
        )
        conn.execute("INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'u1', '{\"events\": []}')")
        conn.execute("INSERT INTO dream_entry_state (entry_id, user_id) VALUES ('e1', 'u1'), ('e2', 'u2')")
        conn.execute(
            "INSERT INTO dream_events (user_id, entry_id, key, action, source) VALUES ('u1', 'e1', 'k', 'x', 's')"
        )
    upgrade(fresh_pg)
    with psycopg.connect(_plain(fresh_pg.database_url), autocommit=True) as conn:
        assert [_count(conn, t) for t in ("dream_runs", "dream_archive", "dream_signals", "dream_entry_state")] == [
            20,
            20,
            1,
            2,
        ]
        # The new key lets two users hold state for one entry id, and the cascade holds.
        conn.execute("INSERT INTO dream_entry_state (entry_id, user_id, last_recalled_at) VALUES ('e1', 'u2', now())")
        conn.execute("DELETE FROM dream_runs WHERE user_id = 'u1'")
        assert _count(conn, "dream_archive") == 19
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute(
                "INSERT INTO dream_archive (run_id, user_id, entry_id, reason, row) "
                "SELECT id, 'someone-else', 'e', 'prune', '{}'::jsonb FROM dream_runs LIMIT 1"
            )
    assert blockers(fresh_pg.database_url) == []
    downgrade(fresh_pg, "0009")
    with psycopg.connect(_plain(fresh_pg.database_url), autocommit=True) as conn:
        assert [_count(conn, t) for t in ("dream_runs", "dream_archive", "dream_signals", "dream_events")] == [
            19,
            19,
            1,
            1,
        ]
        # One state row per entry id: the one recalled last.
        states = conn.execute("SELECT entry_id, user_id FROM dream_entry_state ORDER BY entry_id").fetchall()
        assert states == [("e1", "u2"), ("e2", "u2")]
    upgrade(fresh_pg)
    assert blockers(fresh_pg.database_url) == []


def test_sqlite_upgrade_and_downgrade_keep_the_data(tmp_path: object) -> None:
    settings = _base_settings(database_url=f"sqlite:///{tmp_path}/reverie.db")
    upgrade(settings, "0009")
    engine = get_engine(settings)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO dream_runs (user_id) VALUES ('u1'), ('u2')")
        conn.exec_driver_sql(
            "INSERT INTO dream_archive (run_id, user_id, entry_id, reason, row) "
            "SELECT id, user_id, 'e' || id, 'prune', '{}' FROM dream_runs"
        )
    upgrade(settings)
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM dream_archive").scalar() == 2
        conn.exec_driver_sql("INSERT INTO dream_runs (user_id) VALUES ('u3')")
        assert conn.exec_driver_sql("SELECT max(id) FROM dream_runs").scalar() == 3
        conn.exec_driver_sql("DELETE FROM dream_runs WHERE user_id = 'u1'")
        assert conn.exec_driver_sql("SELECT count(*) FROM dream_archive").scalar() == 1
    downgrade(settings, "0009")
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM dream_archive").scalar() == 1
        assert conn.exec_driver_sql("SELECT count(*) FROM dream_runs").scalar() == 2
    upgrade(settings)
    dispose_engines()


def test_citus_calls_come_in_an_order_citus_accepts() -> None:
    statements = citus_statements()
    reference = [i for i, s in enumerate(statements) if "create_reference_table" in s]
    distributed = [i for i, s in enumerate(statements) if "create_distributed_table" in s]
    assert len(reference) == len(REFERENCE) and len(distributed) == len(DISTRIBUTED)
    assert max(reference) < min(distributed)
    assert f"create_distributed_table('{ANCHOR}', 'user_id')" in statements[min(distributed)]
    assert all(f"colocate_with => '{ANCHOR}'" in statements[i] for i in distributed[1:])
    order = [s.split("'")[1] for s in statements]
    assert order.index("dream_runs") < order.index("dream_archive")
