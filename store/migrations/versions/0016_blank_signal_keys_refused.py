"""A signal inserted with a blank ``idempotency_key`` (empty, or spaces) is refused at
its ``INSERT``, as ``reverie enqueue`` and ``enqueue_signal`` refuse it: before, it was
taken as a key like any other, so every later signal of that user with the same blank
key was a duplicate, and an ``ON CONFLICT DO NOTHING`` dropped it without a word.
A NULL key still gets the default one.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_MESSAGE = "idempotency_key must not be empty: leave it NULL for the default key"
#: Every character Python's ``str.strip`` takes as whitespace (the producers' own test),
#: as SQL text: ASCII's, and Unicode's (U+00A0, U+3000...).
_SPACES = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())

_PG_KEY_FUNCTION = f"""
CREATE OR REPLACE FUNCTION dream_signals_default_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.idempotency_key IS NULL THEN
        NEW.idempotency_key := encode(sha256(convert_to(
            NEW.kind || E'\\n' || NEW.user_id || E'\\n' || NEW.payload::text, 'UTF8')), 'hex');
    ELSIF btrim(NEW.idempotency_key, '{_SPACES}') = '' THEN
        RAISE EXCEPTION '{_MESSAGE}' USING ERRCODE = 'check_violation', COLUMN = 'idempotency_key',
            TABLE = 'dream_signals';
    END IF;
    RETURN NEW;
END
$$
"""
_PG_OLD_KEY_FUNCTION = """
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
_SQLITE_BLANK_TRIGGER = f"""
CREATE TRIGGER IF NOT EXISTS dream_signals_blank_key BEFORE INSERT ON dream_signals
FOR EACH ROW WHEN NEW.idempotency_key IS NOT NULL
    AND trim(NEW.idempotency_key, '{_SPACES}') = ''
BEGIN
    SELECT RAISE(ABORT, '{_MESSAGE}');
END
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_KEY_FUNCTION)
    else:
        op.execute(_SQLITE_BLANK_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_OLD_KEY_FUNCTION)
    else:
        op.execute("DROP TRIGGER IF EXISTS dream_signals_blank_key")
