"""Profiles: prompt-ready memory per user and agent.

Revision ID: 0009
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from store.types import utcnow

revision = "0009"
down_revision = "0006"
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "dream_profiles",
        sa.Column("user_id", sa.String(length=255), nullable=False),
        sa.Column("agent_id", sa.String(length=255), server_default="", nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("entries_included", sa.Integer(), nullable=False),
        sa.Column("entries_left_out", sa.Integer(), nullable=False),
        sa.Column(
            "layout", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=False
        ),
        sa.Column("tokenizer", sa.String(length=255), nullable=False),
        sa.Column("built_at", sa.DateTime(), server_default=utcnow(), nullable=False),
        sa.Column("source_rows", sa.Integer(), server_default="0", nullable=False),
        sa.Column("source_updated_at", sa.DateTime(), nullable=True),
        sa.Column("source_recalls", _BIG, server_default="0", nullable=False),
        sa.Column("source_conflicted", sa.Integer(), server_default="0", nullable=False),
        sa.Column("source_content", _BIG, server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("user_id", "agent_id", name=op.f("pk_dream_profiles")),
    )


def downgrade() -> None:
    op.drop_table("dream_profiles")
