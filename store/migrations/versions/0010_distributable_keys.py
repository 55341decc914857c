"""Keys a Citus cluster can distribute by user_id.

Revision ID: 0010
Revises: 0009

What changes, and what the keys now mean:

- The numbered tables (``dream_signals``, ``dream_runs``, ``dream_archive``,
  ``dream_contradictions``, ``dream_events``, ``dream_observations``,
  ``dream_activity``) get the primary key ``(id, user_id)`` on PostgreSQL. ``id`` is
  still numbered from one sequence and never repeats; the key now says only that it is
  unique together with the user, which is what a node can check on its own.
  SQLite numbers only a lone ``INTEGER PRIMARY KEY``, so there ``id`` stays the key.
- ``dream_archive``'s foreign key to its run becomes ``(user_id, run_id)`` ->
  ``dream_runs (user_id, id)``, still ``ON DELETE CASCADE``. An archived row and its run
  always belong to the same user (checked before the key is made). On SQLite the run
  table gets a plain ``UNIQUE (user_id, id)`` for the key to point at.
- ``dream_entry_state`` is keyed on ``(user_id, entry_id)`` instead of ``entry_id``:
  what Reverie last saw of an entry is kept per user, as a host that keys its memory
  table by ``(user_id, id)`` may reuse an id for two users.

Unchanged, as they already hold ``user_id`` or belong to no user: the idempotency key
(unique per ``(user_id, idempotency_key)`` since 0002), the open-contradiction and
observation unique indexes, ``dream_user_state``, ``dream_profiles``, and the reference
tables (``dream_policies``, ``dream_key_vectors``, ``dream_spend``,
``dream_reservations``). The host's memory table is never touched.

Downgrade puts the old keys back. Should two users hold state for the same entry id by
then, it keeps the one row per entry id whose recall is the latest (the old key has room
for one).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Spelled out: a migration is frozen in time, whatever store.distribution later says.
_NUMBERED = (
    "dream_signals",
    "dream_runs",
    "dream_archive",
    "dream_contradictions",
    "dream_events",
    "dream_observations",
    "dream_activity",
)
_OLD_FK = "fk_dream_archive_run_id_dream_runs"
_NEW_FK = "fk_dream_archive_user_id_dream_runs"


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _check_archive_runs_agree() -> None:
    stray = op.get_bind().scalar(
        sa.text(
            "SELECT count(*) FROM dream_archive a JOIN dream_runs r ON r.id = a.run_id WHERE r.user_id <> a.user_id"
        )
    )
    if stray:
        raise RuntimeError(f"{stray} archived rows name a run of another user; the per-user key cannot be made")


def _set_primary_key(table: str, columns: str) -> None:
    op.execute(f"ALTER TABLE {table} DROP CONSTRAINT pk_{table}, ADD CONSTRAINT pk_{table} PRIMARY KEY ({columns})")


def upgrade() -> None:
    _check_archive_runs_agree()
    if _postgresql():
        # The old key points at dream_runs' old primary key: it goes first.
        op.drop_constraint(_OLD_FK, "dream_archive", type_="foreignkey")
        for table in _NUMBERED:
            _set_primary_key(table, "id, user_id")
        _set_primary_key("dream_entry_state", "user_id, entry_id")
        op.create_foreign_key(
            _NEW_FK, "dream_archive", "dream_runs", ["user_id", "run_id"], ["user_id", "id"], ondelete="CASCADE"
        )
        return
    # SQLite rebuilds a table to change a key. Rebuilding dream_runs while
    # dream_archive still points at it would cascade its DROP into the archive, so
    # the archive lets go of it first and takes the new key last.
    with op.batch_alter_table("dream_archive") as batch:
        batch.drop_constraint(_OLD_FK, type_="foreignkey")
    _rebuild_sqlite("dream_runs", run_key=True)
    with op.batch_alter_table("dream_archive") as batch:
        batch.create_foreign_key(_NEW_FK, "dream_runs", ["user_id", "run_id"], ["user_id", "id"], ondelete="CASCADE")
    _rebuild_sqlite("dream_entry_state", primary_key=["user_id", "entry_id"])


def downgrade() -> None:
    _keep_one_state_per_entry()
    if _postgresql():
        op.drop_constraint(_NEW_FK, "dream_archive", type_="foreignkey")
        for table in _NUMBERED:
            _set_primary_key(table, "id")
        _set_primary_key("dream_entry_state", "entry_id")
        op.create_foreign_key(_OLD_FK, "dream_archive", "dream_runs", ["run_id"], ["id"], ondelete="CASCADE")
        return
    with op.batch_alter_table("dream_archive") as batch:
        batch.drop_constraint(_NEW_FK, type_="foreignkey")
    _rebuild_sqlite("dream_runs", run_key=False)
    with op.batch_alter_table("dream_archive") as batch:
        batch.create_foreign_key(_OLD_FK, "dream_runs", ["run_id"], ["id"], ondelete="CASCADE")
    _rebuild_sqlite("dream_entry_state", primary_key=["entry_id"])


def _keep_one_state_per_entry() -> None:
    op.execute(
        """
        DELETE FROM dream_entry_state
        WHERE EXISTS (
            SELECT 1 FROM dream_entry_state other
            WHERE other.entry_id = dream_entry_state.entry_id
              AND other.user_id <> dream_entry_state.user_id
              AND (coalesce(other.last_recalled_at, other.seen_at), other.user_id)
                > (coalesce(dream_entry_state.last_recalled_at, dream_entry_state.seen_at), dream_entry_state.user_id)
        )
        """
    )


def _rebuild_sqlite(table: str, *, run_key: bool | None = None, primary_key: list[str] | None = None) -> None:
    """Rebuild ``table`` as it stands, with ``primary_key`` as its key and, for
    ``run_key`` True or False, with or without an unnamed ``UNIQUE (user_id, id)``.

    Unnamed, because SQLite drops a constraint only by rebuilding the table from what
    it reflects: the downgrade finds it by its columns and leaves it out.
    """
    reflected = sa.Table(table, sa.MetaData(), autoload_with=op.get_bind())
    if run_key is not None:
        for constraint in list(reflected.constraints):
            if isinstance(constraint, sa.UniqueConstraint) and {c.name for c in constraint.columns} == {
                "user_id",
                "id",
            }:
                reflected.constraints.discard(constraint)
        if run_key:
            reflected.append_constraint(sa.UniqueConstraint("user_id", "id"))
    if primary_key is not None:
        for column in reflected.columns:
            column.primary_key = False
        reflected.append_constraint(sa.PrimaryKeyConstraint(*primary_key, name=f"pk_{table}"))
    with op.batch_alter_table(table, copy_from=reflected, recreate="always"):
        pass
