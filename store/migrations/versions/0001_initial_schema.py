"""Initial schema: the memory table if absent, and Reverie's dream_ tables.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from store.types import utcnow

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _settings_memory_table() -> str:
    settings = context.config.attributes.get("settings")
    return settings.memory_table if settings is not None else "usermemories"


def _memory_table_ddl(name: str, dialect: str) -> list[str]:
    """EDDI's own DDL for the memory table (PostgresUserMemoryStore), verbatim in shape."""
    prefix = "idx_um" if name == "usermemories" else f"idx_{name}"
    if dialect == "postgresql":
        id_default, json_type, empty_list = "gen_random_uuid()::text", "JSONB", "'[]'::jsonb"
    else:
        id_default, json_type, empty_list = "(lower(hex(randomblob(16))))", "JSON", "'[]'"
    return [
        f"""CREATE TABLE IF NOT EXISTS {name} (
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
        f"CREATE INDEX IF NOT EXISTS {prefix}_user_vis_agent_key ON {name} (user_id, visibility, source_agent_id, key)",
        f"CREATE INDEX IF NOT EXISTS {prefix}_user_updated ON {name} (user_id, updated_at DESC)",
        f"CREATE INDEX IF NOT EXISTS {prefix}_user_category ON {name} (user_id, category)",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {prefix}_upsert_global ON {name} (user_id, key) WHERE visibility = 'global'",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {prefix}_upsert_agent ON {name} (user_id, key, source_agent_id) WHERE visibility != 'global'",
        f"CREATE INDEX IF NOT EXISTS {prefix}_user_access_count ON {name} (user_id, access_count DESC)",
    ]


def _create_memory_table_if_absent() -> None:
    # The host application owns this table: create it only where it is missing,
    # and never touch an existing one (not even its indexes).
    bind = op.get_bind()
    name = _settings_memory_table()
    if sa.inspect(bind).has_table(name):
        return
    for statement in _memory_table_ddl(name, bind.dialect.name):
        op.execute(statement)


# A producer that INSERTs a signal without an idempotency key gets the same default
# the Python helper relies on: sha256 over kind, user and the canonical (jsonb) payload.
_PG_KEY_FUNCTION = """
CREATE OR REPLACE FUNCTION dream_signals_default_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.idempotency_key IS NULL THEN
        NEW.idempotency_key := encode(sha256(convert_to(
            NEW.kind || E'\\n' || NEW.user_id || E'\\n' || NEW.payload::text, 'UTF8')), 'hex');
    END IF;
    RETURN NEW;
END
$$
"""
_PG_KEY_TRIGGER = """
CREATE TRIGGER dream_signals_default_key BEFORE INSERT ON dream_signals
FOR EACH ROW EXECUTE FUNCTION dream_signals_default_key()
"""
# SQLite has no sha256: a key unique to the row keeps the column filled.
_SQLITE_KEY_TRIGGER = """
CREATE TRIGGER dream_signals_default_key AFTER INSERT ON dream_signals
FOR EACH ROW WHEN NEW.idempotency_key IS NULL
BEGIN
    UPDATE dream_signals SET idempotency_key = 'row-' || NEW.id WHERE id = NEW.id;
END
"""


def _signal_key_default() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_KEY_FUNCTION)
        op.execute(_PG_KEY_TRIGGER)
    else:
        op.execute(_SQLITE_KEY_TRIGGER)


def upgrade() -> None:
    _create_memory_table_if_absent()
    op.create_table('dream_activity',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('agent_id', sa.String(length=255), server_default='', nullable=False),
    sa.Column('action', sa.String(length=255), nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('attributes', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('signal_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_activity'))
    )
    op.create_index('ix_dream_activity_user_id_action_at', 'dream_activity', ['user_id', 'action', 'at'], unique=False)
    op.create_table('dream_contradictions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('norm_key', sa.String(length=255), nullable=False),
    sa.Column('entry_ids', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='open', nullable=False),
    sa.Column('resolution', sa.String(length=16), server_default='flag', nullable=False),
    sa.Column('found_run_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('found_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('closed_at', sa.DateTime(), nullable=True),
    sa.CheckConstraint("status IN ('open', 'closed')", name=op.f('ck_dream_contradictions_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_contradictions'))
    )
    op.create_index('ix_dream_contradictions_user_id', 'dream_contradictions', ['user_id'], unique=False)
    op.create_index('uq_dream_contradictions_open', 'dream_contradictions', ['user_id', 'norm_key'], unique=True, postgresql_where=sa.text("status = 'open'"), sqlite_where=sa.text("status = 'open'"))
    op.create_table('dream_entry_state',
    sa.Column('entry_id', sa.String(length=64), nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('access_count_seen', sa.Integer(), server_default='0', nullable=False),
    sa.Column('last_recalled_at', sa.DateTime(), nullable=True),
    sa.Column('seen_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.PrimaryKeyConstraint('entry_id', name=op.f('pk_dream_entry_state'))
    )
    op.create_index('ix_dream_entry_state_user_id', 'dream_entry_state', ['user_id'], unique=False)
    op.create_table('dream_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('entry_id', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('action', sa.String(length=16), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('signal_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('run_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_events'))
    )
    op.create_index('ix_dream_events_run_id', 'dream_events', ['run_id'], unique=False)
    op.create_index('ix_dream_events_signal_id', 'dream_events', ['signal_id'], unique=False)
    op.create_index('ix_dream_events_user_id', 'dream_events', ['user_id'], unique=False)
    op.create_table('dream_observations',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('agent_id', sa.String(length=255), server_default='', nullable=False),
    sa.Column('key', sa.String(length=100), nullable=False),
    sa.Column('value', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('evidence', sa.Text(), nullable=True),
    sa.Column('seen_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('signal_ids', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('first_seen_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('promoted_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_observations'))
    )
    op.create_index('uq_dream_observations_candidate', 'dream_observations', ['user_id', 'agent_id', 'key'], unique=True)
    op.create_table('dream_policies',
    sa.Column('agent_id', sa.String(length=255), nullable=False),
    sa.Column('config', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('updated_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.PrimaryKeyConstraint('agent_id', name=op.f('pk_dream_policies'))
    )
    op.create_table('dream_runs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('scope', sa.String(length=32), server_default='user', nullable=False),
    sa.Column('trigger', sa.String(length=16), server_default='manual', nullable=False),
    sa.Column('status', sa.String(length=16), server_default='running', nullable=False),
    sa.Column('started_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('entries_pruned', sa.Integer(), server_default='0', nullable=False),
    sa.Column('contradictions_found', sa.Integer(), server_default='0', nullable=False),
    sa.Column('contradictions_resolved', sa.Integer(), server_default='0', nullable=False),
    sa.Column('entries_summarized', sa.Integer(), server_default='0', nullable=False),
    sa.Column('entries_written', sa.Integer(), server_default='0', nullable=False),
    sa.Column('groups_deferred', sa.Integer(), server_default='0', nullable=False),
    sa.Column('cost_nano', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default='0', nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.CheckConstraint("status IN ('running', 'succeeded', 'failed', 'skipped')", name=op.f('ck_dream_runs_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_runs'))
    )
    op.create_index('ix_dream_runs_started_at', 'dream_runs', ['started_at'], unique=False)
    op.create_index('ix_dream_runs_user_id_started_at', 'dream_runs', ['user_id', 'started_at'], unique=False)
    op.create_table('dream_signals',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('agent_id', sa.String(length=255), nullable=True),
    sa.Column('payload', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('status', sa.String(length=16), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('enqueued_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('available_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('claimed_until', sa.DateTime(), nullable=True),
    sa.Column('claim_token', sa.String(length=36), nullable=True),
    sa.Column('processed_at', sa.DateTime(), nullable=True),
    sa.CheckConstraint("status IN ('pending', 'processing', 'done', 'rejected', 'failed', 'dead')", name=op.f('ck_dream_signals_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_signals')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_dream_signals_idempotency_key'))
    )
    op.create_index('ix_dream_signals_leased', 'dream_signals', ['claimed_until'], unique=False, postgresql_where=sa.text("status = 'processing'"), sqlite_where=sa.text("status = 'processing'"))
    op.create_index('ix_dream_signals_ready', 'dream_signals', ['available_at'], unique=False, postgresql_where=sa.text("status IN ('pending', 'failed')"), sqlite_where=sa.text("status IN ('pending', 'failed')"))
    op.create_index('ix_dream_signals_status_kind', 'dream_signals', ['status', 'kind'], unique=False)
    op.create_index('ix_dream_signals_user_id', 'dream_signals', ['user_id'], unique=False)
    op.create_table('dream_spend',
    sa.Column('scope', sa.String(length=8), nullable=False),
    sa.Column('scope_key', sa.String(length=64), nullable=False),
    sa.Column('limit_nano', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('reserved_nano', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default='0', nullable=False),
    sa.Column('spent_nano', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default='0', nullable=False),
    sa.Column('updated_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.CheckConstraint("scope IN ('run', 'day')", name=op.f('ck_dream_spend_scope')),
    sa.CheckConstraint('reserved_nano + spent_nano <= limit_nano', name=op.f('ck_dream_spend_within_limit')),
    sa.CheckConstraint('reserved_nano >= 0 AND spent_nano >= 0', name=op.f('ck_dream_spend_non_negative')),
    sa.PrimaryKeyConstraint('scope', 'scope_key', name=op.f('pk_dream_spend'))
    )
    op.create_table('dream_user_state',
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('next_dream_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('last_dream_at', sa.DateTime(), nullable=True),
    sa.Column('dirty_since', sa.DateTime(), nullable=True),
    sa.Column('locked_until', sa.DateTime(), nullable=True),
    sa.Column('lock_token', sa.String(length=36), nullable=True),
    sa.Column('dispatched_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('user_id', name=op.f('pk_dream_user_state'))
    )
    op.create_index('ix_dream_user_state_dirty', 'dream_user_state', ['dirty_since'], unique=False, postgresql_where=sa.text('dirty_since IS NOT NULL'), sqlite_where=sa.text('dirty_since IS NOT NULL'))
    op.create_index('ix_dream_user_state_next_dream_at', 'dream_user_state', ['next_dream_at'], unique=False)
    op.create_table('dream_archive',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('signal_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('entry_id', sa.String(length=64), nullable=False),
    sa.Column('reason', sa.String(length=32), nullable=False),
    sa.Column('row', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('archived_at', sa.DateTime(), server_default=utcnow(), nullable=False),
    sa.Column('restored_at', sa.DateTime(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['dream_runs.id'], name=op.f('fk_dream_archive_run_id_dream_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dream_archive'))
    )
    op.create_index('ix_dream_archive_archived_at', 'dream_archive', ['archived_at'], unique=False)
    op.create_index('ix_dream_archive_run_id', 'dream_archive', ['run_id'], unique=False)
    op.create_index('ix_dream_archive_signal_id', 'dream_archive', ['signal_id'], unique=False)
    op.create_index('ix_dream_archive_user_id', 'dream_archive', ['user_id'], unique=False)
    _signal_key_default()


def downgrade() -> None:
    # The memory table is the host's and stays.
    op.execute("DROP TRIGGER IF EXISTS dream_signals_default_key" + (" ON dream_signals" if op.get_bind().dialect.name == "postgresql" else ""))
    op.drop_index('ix_dream_archive_user_id', table_name='dream_archive')
    op.drop_index('ix_dream_archive_signal_id', table_name='dream_archive')
    op.drop_index('ix_dream_archive_run_id', table_name='dream_archive')
    op.drop_index('ix_dream_archive_archived_at', table_name='dream_archive')
    op.drop_table('dream_archive')
    op.drop_index('ix_dream_user_state_next_dream_at', table_name='dream_user_state')
    op.drop_index('ix_dream_user_state_dirty', table_name='dream_user_state', postgresql_where=sa.text('dirty_since IS NOT NULL'), sqlite_where=sa.text('dirty_since IS NOT NULL'))
    op.drop_table('dream_user_state')
    op.drop_table('dream_spend')
    op.drop_index('ix_dream_signals_user_id', table_name='dream_signals')
    op.drop_index('ix_dream_signals_status_kind', table_name='dream_signals')
    op.drop_index('ix_dream_signals_ready', table_name='dream_signals', postgresql_where=sa.text("status IN ('pending', 'failed')"), sqlite_where=sa.text("status IN ('pending', 'failed')"))
    op.drop_index('ix_dream_signals_leased', table_name='dream_signals', postgresql_where=sa.text("status = 'processing'"), sqlite_where=sa.text("status = 'processing'"))
    op.drop_table('dream_signals')
    op.drop_index('ix_dream_runs_user_id_started_at', table_name='dream_runs')
    op.drop_index('ix_dream_runs_started_at', table_name='dream_runs')
    op.drop_table('dream_runs')
    op.drop_table('dream_policies')
    op.drop_index('uq_dream_observations_candidate', table_name='dream_observations')
    op.drop_table('dream_observations')
    op.drop_index('ix_dream_events_user_id', table_name='dream_events')
    op.drop_index('ix_dream_events_signal_id', table_name='dream_events')
    op.drop_index('ix_dream_events_run_id', table_name='dream_events')
    op.drop_table('dream_events')
    op.drop_index('ix_dream_entry_state_user_id', table_name='dream_entry_state')
    op.drop_table('dream_entry_state')
    op.drop_index('uq_dream_contradictions_open', table_name='dream_contradictions', postgresql_where=sa.text("status = 'open'"), sqlite_where=sa.text("status = 'open'"))
    op.drop_index('ix_dream_contradictions_user_id', table_name='dream_contradictions')
    op.drop_table('dream_contradictions')
    op.drop_index('ix_dream_activity_user_id_action_at', table_name='dream_activity')
    op.drop_table('dream_activity')
