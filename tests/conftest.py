"""Fixtures shared by every layer of the suite.

Integration tests run against the real PostgreSQL and Redis on localhost. The suite
creates one throwaway database per run (dropped at the end) and empties its tables
before each test; Redis tests get a database number of their own and flush it.
If a server is missing, the run stops with a message that says how to start it.
"""

from __future__ import annotations

import os

# litellm fetches its price map from the network at import unless told otherwise.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis as redis_lib
from psycopg import sql
from sqlalchemy import text as sql_text

from store.db import dispose_engines, session_scope
from store.migrate import upgrade
from worker.settings import Settings

PG_ADMIN_URL = os.environ.get("REVERIE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REVERIE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
REDIS_DB = int(os.environ.get("REVERIE_TEST_REDIS_DB", "11"))

HOW_TO_START = {
    "postgresql": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start "
    "(or set REVERIE_TEST_PG_ADMIN_URL to a server where this user may CREATE DATABASE)",
    "redis": 'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no '
    "(or set REVERIE_TEST_REDIS_URL)",
}


def _base_settings(**overrides: object) -> Settings:
    # _env_file=None: a developer's .env must not leak into the tests. No broker unless a
    # test asks for one, so producers under test never publish into a shared Redis.
    overrides.setdefault("broker_url", "")
    return Settings(_env_file=None, **overrides)  # type: ignore[call-arg]


def pg_url_for(database: str) -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{database}".replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this run; dropped afterwards."""
    name = f"reverie_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.exit(f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({exc}). Start it: {HOW_TO_START['postgresql']}", 3)
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = pg_url_for(name)
    upgrade(_base_settings(database_url=url))
    dispose_engines()
    yield url
    dispose_engines()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def truncate_all(url: str) -> None:
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'dream_alembic_version'"
            )
        ]
        if tables:
            conn.execute(
                sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(sql.SQL(", ").join(map(sql.Identifier, tables)))
            )


@pytest.fixture()
def pg_settings(pg_database: str) -> Iterator[Settings]:
    """Settings pointing at the run's PostgreSQL database, emptied for this test."""
    truncate_all(pg_database)
    yield _base_settings(database_url=pg_database)
    dispose_engines()


@pytest.fixture()
def sqlite_settings(tmp_path: Path) -> Iterator[Settings]:
    """Settings pointing at a new, migrated SQLite file."""
    settings = _base_settings(database_url=f"sqlite:///{tmp_path / 'reverie.db'}")
    upgrade(settings)
    yield settings
    dispose_engines()


@pytest.fixture(params=["postgresql", "sqlite"])
def store_settings(request: pytest.FixtureRequest) -> Settings:
    """Run a store test on both backends."""
    fixture = "pg_settings" if request.param == "postgresql" else "sqlite_settings"
    settings: Settings = request.getfixturevalue(fixture)
    return settings


@pytest.fixture()
def redis_url() -> Iterator[str]:
    """A Redis database number of the suite's own, flushed before and after."""
    url = f"{REDIS_URL}/{REDIS_DB}"
    client = redis_lib.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except redis_lib.exceptions.ConnectionError as exc:
        pytest.exit(f"Redis is not reachable at {REDIS_URL} ({exc}). Start it: {HOW_TO_START['redis']}", 3)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture()
def make_settings(pg_settings: Settings) -> object:
    """Build PostgreSQL settings with overrides: ``make_settings(max_cost_per_run=0.01)``."""

    def build(**overrides: object) -> Settings:
        return _base_settings(database_url=pg_settings.database_url, **overrides)

    return build


@pytest.fixture()
def zoned_settings(pg_settings: Settings) -> Iterator[Settings]:
    """A host memory table whose times are ``timestamptz``."""
    with session_scope(pg_settings) as session:
        session.execute(sql_text("CREATE TABLE zoned (LIKE usermemories INCLUDING ALL)"))
        session.execute(
            sql_text("ALTER TABLE zoned ALTER created_at TYPE timestamptz, ALTER updated_at TYPE timestamptz")
        )
    dispose_engines()
    yield pg_settings.model_copy(update={"memory_table": "zoned"})
    with session_scope(pg_settings) as session:
        session.execute(sql_text("DROP TABLE zoned"))
    dispose_engines()
