"""Model-written profiles: a partial index, so each pass's look for profiles the model
wrote (built again where the model no longer writes them) reads only those, and
nothing where the model writes none.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

PG_MODEL_WRITTEN = "(layout ->> 'writer') = 'model'"
SQLITE_MODEL_WRITTEN = "json_extract(layout, '$.writer') = 'model'"


def upgrade() -> None:
    op.create_index(
        "ix_dream_profiles_model_written",
        "dream_profiles",
        ["user_id"],
        unique=False,
        postgresql_where=sa.text(PG_MODEL_WRITTEN),
        sqlite_where=sa.text(SQLITE_MODEL_WRITTEN),
    )


def downgrade() -> None:
    op.drop_index("ix_dream_profiles_model_written", table_name="dream_profiles")
