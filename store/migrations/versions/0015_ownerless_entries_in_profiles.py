"""Profiles show the ``self`` entries no agent owns: the profiles of users who have such
entries are marked to be built again at their next dream (their memory is unchanged, so the
fingerprint alone would keep the profiles built without them).

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from alembic import context, op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def _memory_table() -> str:
    settings = context.config.attributes.get("settings")
    return settings.memory_table if settings is not None else "usermemories"


def upgrade() -> None:
    bind = op.get_bind()
    table = bind.dialect.identifier_preparer.quote(_memory_table())
    # A fingerprint no set of rows has (-1 rows): the next build finds it changed.
    op.execute(
        "UPDATE dream_profiles SET source_rows = -1 WHERE user_id IN ("
        f"SELECT user_id FROM {table} WHERE coalesce(visibility, 'self') = 'self' "
        "AND (source_agent_id IS NULL OR source_agent_id = ''))"
    )


def downgrade() -> None:
    # Nothing to undo: profiles built since show those entries, and the next build of
    # the older code makes them as it did.
    pass
