"""Users sent a run that has not started yet: an index for counting the work in flight.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

IN_FLIGHT = "dispatched_at IS NOT NULL AND (last_dream_at IS NULL OR last_dream_at < dispatched_at)"


def upgrade() -> None:
    op.create_index(
        "ix_dream_user_state_in_flight",
        "dream_user_state",
        ["dispatched_at"],
        unique=False,
        postgresql_where=sa.text(IN_FLIGHT),
        sqlite_where=sa.text(IN_FLIGHT),
    )


def downgrade() -> None:
    op.drop_index("ix_dream_user_state_in_flight", table_name="dream_user_state")
