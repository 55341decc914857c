"""Cost cap: per-user and per-signal budget lines, and the reservations in flight.

Revision ID: 0004
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from store.types import utcnow

revision = "0004"
down_revision = "0002"
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("dream_spend") as batch:
        batch.drop_constraint(op.f("ck_dream_spend_scope"), type_="check")
        batch.create_check_constraint(op.f("ck_dream_spend_scope"), "scope IN ('run', 'day', 'user', 'signal')")
    op.create_table(
        "dream_reservations",
        sa.Column("id", _BIG, autoincrement=True, nullable=False),
        sa.Column("lines", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=False),
        sa.Column("amount_nano", _BIG, nullable=False),
        sa.Column("deadline", sa.DateTime(), nullable=False),
        sa.Column("created_at", sa.DateTime(), server_default=utcnow(), nullable=False),
        sa.CheckConstraint("amount_nano >= 0", name=op.f("ck_dream_reservations_non_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dream_reservations")),
    )
    op.create_index("ix_dream_reservations_deadline", "dream_reservations", ["deadline"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_dream_reservations_deadline", table_name="dream_reservations")
    op.drop_table("dream_reservations")
    with op.batch_alter_table("dream_spend") as batch:
        batch.drop_constraint(op.f("ck_dream_spend_scope"), type_="check")
        batch.create_check_constraint(op.f("ck_dream_spend_scope"), "scope IN ('run', 'day')")
