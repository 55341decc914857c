"""Restore events: a partial index, so finding the entries a restore put back (which
pruning, ``keep_newest`` and summarizing leave alone) reads only those events, not
every event of the chunk's users.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

RESTORE = "action = 'restore'"


def upgrade() -> None:
    op.create_index(
        "ix_dream_events_restore",
        "dream_events",
        ["user_id", "entry_id"],
        unique=False,
        postgresql_where=sa.text(RESTORE),
        sqlite_where=sa.text(RESTORE),
    )


def downgrade() -> None:
    op.drop_index("ix_dream_events_restore", table_name="dream_events")
