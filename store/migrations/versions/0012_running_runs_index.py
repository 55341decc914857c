"""Runs still marked running: an index, so the run that takes a user over closes the
ledger rows a stopped worker left open without reading the user's whole history.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

RUNNING = "status = 'running'"


def upgrade() -> None:
    op.create_index(
        "ix_dream_runs_running",
        "dream_runs",
        ["user_id"],
        unique=False,
        postgresql_where=sa.text(RUNNING),
        sqlite_where=sa.text(RUNNING),
    )


def downgrade() -> None:
    op.drop_index("ix_dream_runs_running", table_name="dream_runs")
