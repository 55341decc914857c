"""Idempotency keys unique per user; what retention needs to purge by age.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_FINISHED_WITH_PAYLOAD = "status IN ('done', 'rejected') AND payload_purged_at IS NULL"

# SQLite rebuilds the table to change a constraint, and its triggers go with the old
# table: the default-key trigger of 0001 is put back afterwards.
_SQLITE_KEY_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS dream_signals_default_key AFTER INSERT ON dream_signals
FOR EACH ROW WHEN NEW.idempotency_key IS NULL
BEGIN
    UPDATE dream_signals SET idempotency_key = 'row-' || NEW.id WHERE id = NEW.id;
END
"""


def _rebuild_signals(drop: str, create: tuple[str, list[str]]) -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("dream_signals") as batch:
        batch.drop_constraint(drop, type_="unique")
        batch.create_unique_constraint(create[0], create[1])
    if sqlite:
        op.execute(_SQLITE_KEY_TRIGGER)


def upgrade() -> None:
    op.add_column("dream_signals", sa.Column("payload_purged_at", sa.DateTime(), nullable=True))
    _rebuild_signals(
        "uq_dream_signals_idempotency_key",
        ("uq_dream_signals_user_id_idempotency_key", ["user_id", "idempotency_key"]),
    )
    op.create_index(
        "ix_dream_signals_finished",
        "dream_signals",
        ["processed_at"],
        unique=False,
        postgresql_where=sa.text(_FINISHED_WITH_PAYLOAD),
        sqlite_where=sa.text(_FINISHED_WITH_PAYLOAD),
    )
    op.create_index("ix_dream_events_at", "dream_events", ["at"], unique=False)
    op.create_index("ix_dream_spend_updated_at", "dream_spend", ["updated_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_dream_spend_updated_at", table_name="dream_spend")
    op.drop_index("ix_dream_events_at", table_name="dream_events")
    op.drop_index("ix_dream_signals_finished", table_name="dream_signals")
    _rebuild_signals(
        "uq_dream_signals_user_id_idempotency_key",
        ("uq_dream_signals_idempotency_key", ["idempotency_key"]),
    )
    with op.batch_alter_table("dream_signals") as batch:
        batch.drop_column("payload_purged_at")
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_SQLITE_KEY_TRIGGER)
