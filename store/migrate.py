"""Bring a database to the current schema (``reverie migrate``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from store.db import check_connection, get_engine, translate_errors
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
        return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(settings: Settings, revision: str = "head") -> tuple[str | None, str]:
    """Apply pending migrations; returns (revision before, revision after). Idempotent.
    Refuses (:class:`ConfigError`) a PostgreSQL older than ``store.db.MIN_POSTGRESQL``."""
    check_connection(settings)
    before = current_revision(settings)
    config = _config(settings)
    with translate_errors(settings), get_engine(settings).begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    return before, current_revision(settings) or "base"


def is_current(settings: Settings) -> bool:
    return current_revision(settings) == head_revision()


def downgrade(settings: Settings, revision: str) -> tuple[str | None, str]:
    """Take the schema back to ``revision``; returns (revision before, revision after)."""
    before = current_revision(settings)
    config = _config(settings)
    with translate_errors(settings), get_engine(settings).begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)
    return before, current_revision(settings) or "base"
