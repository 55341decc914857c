"""New signals notify the listener: a statement trigger on dream_signals (PostgreSQL).

Revision ID: 0008
Revises: 0004
"""

from __future__ import annotations

from alembic import op


revision = "0008"
down_revision = "0004"
branch_labels = None
depends_on = None

# One notice per statement, whatever its row count: a bulk INSERT of 10,000 rows costs
# one notice, not 10,000. The ids are sent when they fit in a notice, else a marker
# that means "scan for ready rows". pg_notify is delivered on commit, so the listener
# never wakes a worker for a row it cannot see yet. A producer that sends its own
# wake-up (the Python helper) sets the transaction-local setting to skip the notice.
# A migration is frozen in time: the names below are spelled out, and store.notices
# reads them (a test checks both sides agree).
_PG_NOTIFY_FUNCTION = """
CREATE OR REPLACE FUNCTION dream_signals_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ids text;
BEGIN
    IF coalesce(current_setting('reverie.woken', true), '') = 'on' THEN
        RETURN NULL;
    END IF;
    SELECT string_agg(id::text, ',' ORDER BY id) INTO ids FROM inserted;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    IF octet_length(ids) > 7900 THEN
        ids := '*';
    END IF;
    PERFORM pg_notify('dream_signals', ids);
    RETURN NULL;
END
$$
"""
_PG_NOTIFY_TRIGGER = """
CREATE TRIGGER dream_signals_notify AFTER INSERT ON dream_signals
REFERENCING NEW TABLE AS inserted
FOR EACH STATEMENT EXECUTE FUNCTION dream_signals_notify()
"""


def upgrade() -> None:
    # SQLite has no LISTEN: its producers and ``reverie run`` need no notice.
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_PG_NOTIFY_FUNCTION)
    op.execute(_PG_NOTIFY_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS dream_signals_notify ON dream_signals")
    op.execute("DROP FUNCTION IF EXISTS dream_signals_notify()")
