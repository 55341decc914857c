"""Key-matching vectors: one row per model and key in rules form.

Revision ID: 0006
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from store.types import utcnow

revision = "0006"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('dream_key_vectors',
    sa.Column('model', sa.String(length=64), nullable=False),
    sa.Column('norm_key', sa.String(length=512), nullable=False),
    sa.Column('vector', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.PrimaryKeyConstraint('model', 'norm_key', name=op.f('pk_dream_key_vectors'))
    )


def downgrade() -> None:
    op.drop_table('dream_key_vectors')
