"""Alembic environment: the connection and settings come from ``store.migrate``."""

from __future__ import annotations

from alembic import context

from store.memory_ddl import create_quoted_memory_table_if_absent
from store.models import Base

config = context.config
connection = config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table="dream_alembic_version",
    render_as_batch=connection.dialect.name == "sqlite",
    # The memory table is the host's: never compared, never altered.
    include_name=lambda name, type_, parent: type_ != "table" or str(name).startswith("dream_"),
)
with context.begin_transaction():
    settings = config.attributes.get("settings")
    if settings is not None:
        # Before the revisions, which spell the memory table's name bare (see store.memory_ddl).
        create_quoted_memory_table_if_absent(connection, settings.memory_table)
    context.run_migrations()
