"""Alembic environment: the connection and settings come from ``store.migrate``."""

from __future__ import annotations

from alembic import context

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
    context.run_migrations()
