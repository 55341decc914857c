"""EDDI's DDL for the host's memory table, for a name that must be quoted in SQL.

A name with capitals (``UserMemories``) is a different table from its lowercase
spelling unless every statement quotes it. The schema's first revision spells the name
bare, so such a table is created here, quoted, before the revisions run; they then find
it present and leave it alone, as they do any table the host already has.
"""

from __future__ import annotations

from sqlalchemy import Connection, inspect


def needs_quoting(connection: Connection, name: str) -> bool:
    return str(connection.dialect.identifier_preparer.quote(name)) != name


def create_quoted_memory_table_if_absent(connection: Connection, name: str) -> bool:
    """Create the memory table ``name`` with EDDI's layout and indexes when the name
    needs quoting and no such table exists. Returns whether it created the table."""
    if not needs_quoting(connection, name) or inspect(connection).has_table(name):
        return False
    for statement in _ddl(connection, name):
        connection.exec_driver_sql(statement)
    return True


def _ddl(connection: Connection, name: str) -> list[str]:
    preparer = connection.dialect.identifier_preparer
    table = preparer.quote(name)

    def index(suffix: str) -> str:
        return preparer.quote(f"idx_{name}_{suffix}")

    if connection.dialect.name == "postgresql":
        id_default, json_type, empty_list = "gen_random_uuid()::text", "JSONB", "'[]'::jsonb"
    else:
        id_default, json_type, empty_list = "(lower(hex(randomblob(16))))", "JSON", "'[]'"
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
            id VARCHAR(64) PRIMARY KEY DEFAULT {id_default},
            user_id VARCHAR(255) NOT NULL,
            key VARCHAR(255) NOT NULL,
            value {json_type},
            category VARCHAR(50) NOT NULL DEFAULT 'fact',
            visibility VARCHAR(20) NOT NULL DEFAULT 'self',
            source_agent_id VARCHAR(255),
            group_ids {json_type} DEFAULT {empty_list},
            source_conversation_id VARCHAR(255),
            conflicted BOOLEAN DEFAULT FALSE,
            access_count INTEGER DEFAULT 0,
            created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
            updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
        )""",
        f"CREATE INDEX IF NOT EXISTS {index('user_vis_agent_key')} ON {table} "
        "(user_id, visibility, source_agent_id, key)",
        f"CREATE INDEX IF NOT EXISTS {index('user_updated')} ON {table} (user_id, updated_at DESC)",
        f"CREATE INDEX IF NOT EXISTS {index('user_category')} ON {table} (user_id, category)",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {index('upsert_global')} ON {table} (user_id, key) "
        "WHERE visibility = 'global'",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {index('upsert_agent')} ON {table} (user_id, key, source_agent_id) "
        "WHERE visibility != 'global'",
        f"CREATE INDEX IF NOT EXISTS {index('user_access_count')} ON {table} (user_id, access_count DESC)",
    ]
