"""Bring a database to the current schema (``reverie migrate``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, func, select

from store.db import check_connection, get_engine, safe_url, translate_errors
from worker.errors import ConfigError
from worker.settings import Settings

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "dream_alembic_version"


def _config(settings: Settings) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["settings"] = settings
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config_for_scripts()).get_current_head()
    assert head is not None
    return head


def _config_for_scripts() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def current_revision(settings: Settings) -> str | None:
    with translate_errors(settings), get_engine(settings).connect() as connection:
        return _revision(connection)


def is_newer(revision: str | None) -> bool:
    """Whether ``revision`` is one this release does not know (a newer release's)."""
    if revision is None:
        return False
    try:
        ScriptDirectory.from_config(_config_for_scripts()).get_revision(revision)
    except CommandError:
        return True
    return False


def newer_schema(settings: Settings, revision: str) -> ConfigError:
    return ConfigError(
        f"database {safe_url(settings.database_url)} is at revision {revision}, newer than this release's "
        f"{head_revision()}: a newer release of Reverie migrated it; run that release"
    )


def upgrade(settings: Settings, revision: str = "head") -> tuple[str | None, str]:
    """Apply pending migrations; returns (revision before, revision after). Idempotent.
    Refuses (:class:`ConfigError`) a PostgreSQL older than ``store.db.MIN_POSTGRESQL``,
    and a schema a newer release migrated. Several at once (each replica's start-up)
    take turns: the later ones find nothing left to do."""
    check_connection(settings)
    config = _config(settings)
    with translate_errors(settings), get_engine(settings).begin() as connection:
        _one_at_a_time(connection)
        before = _revision(connection)
        if is_newer(before):
            raise newer_schema(settings, str(before))
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    return before, current_revision(settings) or "base"


def _revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def _one_at_a_time(connection: Connection) -> None:
    """Hold, on PostgreSQL, the lock every migration takes for its transaction (SQLite
    takes one writer at a time anyway), so two never apply the same step at once."""
    if connection.dialect.name == "postgresql":
        connection.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(MIGRATE_LOCK, 0))))


MIGRATE_LOCK = "reverie:migrate"


def is_current(settings: Settings) -> bool:
    return current_revision(settings) == head_revision()


def downgrade(settings: Settings, revision: str) -> tuple[str | None, str]:
    """Take the schema back to ``revision``; returns (revision before, revision after)."""
    config = _config(settings)
    with translate_errors(settings), get_engine(settings).begin() as connection:
        _one_at_a_time(connection)
        before = _revision(connection)
        config.attributes["connection"] = connection
        command.downgrade(config, revision)
    return before, current_revision(settings) or "base"
