"""Reverie's tables (prefixed ``dream_``) and the shared memory table.

The memory table belongs to the host application (EDDI's layout, docs/reference.md);
its name is a setting, so it is built on demand by :func:`memory_table`. Reverie's own
tables are typed ORM models. Timestamps are naive UTC; money is integer nano-USD.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from store.types import BigId, JsonType, Timestamp, utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SIGNAL_KINDS = ("session_end", "feedback", "activity")
SIGNAL_STATUSES = ("pending", "processing", "done", "rejected", "failed", "dead")
RUN_STATUSES = ("running", "succeeded", "failed", "skipped")
RUN_RUNNING = "status = 'running'"
EVENT_RESTORE = "action = 'restore'"
#: A profile the model wrote (the predicate of its partial index, per database).
PG_MODEL_WRITTEN = "(layout ->> 'writer') = 'model'"
SQLITE_MODEL_WRITTEN = "json_extract(layout, '$.writer') = 'model'"
_PG_MODEL_WRITTEN, _SQLITE_MODEL_WRITTEN = text(PG_MODEL_WRITTEN), text(SQLITE_MODEL_WRITTEN)
#: Signals whose payload retention may empty: finished for good, payload still there.
FINISHED_WITH_PAYLOAD = "status IN ('done', 'rejected') AND payload_purged_at IS NULL"


#: The longest user id Reverie's tables hold (a host's own ``text`` column may hold longer
#: ones: those users are left alone).
MAX_USER_ID = 255


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: Timestamp, dict[str, Any]: JsonType}


def _numbered_key() -> PrimaryKeyConstraint:
    # Includes user_id, so the table can be distributed by it (store.distribution);
    # id first, so a lookup by id alone still uses the key's index. SQLite keeps id as
    # its whole key (store.distribution.NUMBERED), which is all the ORM relies on.
    return PrimaryKeyConstraint("id", "user_id")


#: The ORM identifies a row of a numbered table by ``id`` alone: the database numbers
#: it from one sequence, so it never repeats, and ``session.get(Model, id)`` keeps working.
BY_ID: dict[str, Any] = {"primary_key": ["id"]}


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Signal(Base):
    """A unit of work queued by a producer (docs/reference.md, Signals). The row is the truth."""

    __tablename__ = "dream_signals"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32))
    user_id: Mapped[str] = mapped_column(String(255))
    agent_id: Mapped[str | None] = mapped_column(String(255))
    payload: Mapped[Any] = mapped_column(JsonType)
    # Filled by a trigger on PostgreSQL when a producer leaves it out. Unique per user,
    # so one user's key never blocks another's (and the table can be split by user).
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    enqueued_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    available_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    claimed_until: Mapped[datetime | None]
    claim_token: Mapped[str | None] = mapped_column(String(36))
    processed_at: Mapped[datetime | None]
    # When retention emptied the payload of this finished signal; the row stays, so a
    # duplicate of it still takes no effect.
    payload_purged_at: Mapped[datetime | None]

    __table_args__ = (
        _numbered_key(),
        CheckConstraint(_in("status", SIGNAL_STATUSES), name="status"),
        UniqueConstraint("user_id", "idempotency_key"),
        Index(
            "ix_dream_signals_finished",
            "processed_at",
            postgresql_where=text(FINISHED_WITH_PAYLOAD),
            sqlite_where=text(FINISHED_WITH_PAYLOAD),
        ),
        Index(
            "ix_dream_signals_ready",
            "available_at",
            postgresql_where=text("status IN ('pending', 'failed')"),
            sqlite_where=text("status IN ('pending', 'failed')"),
        ),
        Index(
            "ix_dream_signals_leased",
            "claimed_until",
            postgresql_where=text("status = 'processing'"),
            sqlite_where=text("status = 'processing'"),
        ),
        Index("ix_dream_signals_user_id", "user_id"),
        Index("ix_dream_signals_status_kind", "status", "kind"),
    )


class Run(Base):
    """The ledger: one row per dream run of one user."""

    __tablename__ = "dream_runs"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(255))
    scope: Mapped[str] = mapped_column(String(32), server_default="user")
    trigger: Mapped[str] = mapped_column(String(16), server_default="manual")
    status: Mapped[str] = mapped_column(String(16), server_default="running")
    started_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    finished_at: Mapped[datetime | None]
    entries_pruned: Mapped[int] = mapped_column(Integer, server_default="0")
    contradictions_found: Mapped[int] = mapped_column(Integer, server_default="0")
    contradictions_resolved: Mapped[int] = mapped_column(Integer, server_default="0")
    entries_summarized: Mapped[int] = mapped_column(Integer, server_default="0")
    entries_written: Mapped[int] = mapped_column(Integer, server_default="0")
    groups_deferred: Mapped[int] = mapped_column(Integer, server_default="0")
    cost_nano: Mapped[int] = mapped_column(BigId, server_default="0")
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        _numbered_key(),
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        Index("ix_dream_runs_user_id_started_at", "user_id", "started_at"),
        Index("ix_dream_runs_started_at", "started_at"),
        # Ledger rows a stopped worker left open, closed by the run that takes the user over.
        Index("ix_dream_runs_running", "user_id", postgresql_where=text(RUN_RUNNING), sqlite_where=text(RUN_RUNNING)),
    )


class ArchivedEntry(Base):
    """A whole memory-table row, copied before Reverie removed or replaced it."""

    __tablename__ = "dream_archive"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    run_id: Mapped[int | None] = mapped_column(BigId)
    signal_id: Mapped[int | None] = mapped_column(BigId)
    user_id: Mapped[str] = mapped_column(String(255))
    entry_id: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(String(32))
    row: Mapped[dict[str, Any]]
    archived_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    restored_at: Mapped[datetime | None]

    __table_args__ = (
        _numbered_key(),
        # The run's rows go with the run. user_id on both sides: a foreign key between
        # two distributed tables must hold the distribution column.
        ForeignKeyConstraint(["user_id", "run_id"], ["dream_runs.user_id", "dream_runs.id"], ondelete="CASCADE"),
        Index("ix_dream_archive_run_id", "run_id"),
        Index("ix_dream_archive_signal_id", "signal_id"),
        Index("ix_dream_archive_user_id", "user_id"),
        Index("ix_dream_archive_archived_at", "archived_at"),
    )


class Contradiction(Base):
    """Entries of one user whose normalised keys agree and values do not."""

    __tablename__ = "dream_contradictions"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(255))
    norm_key: Mapped[str] = mapped_column(String(255))
    entry_ids: Mapped[Any] = mapped_column(JsonType)
    fingerprint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), server_default="open")
    resolution: Mapped[str] = mapped_column(String(16), server_default="flag")
    found_run_id: Mapped[int | None] = mapped_column(BigId)
    found_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    closed_at: Mapped[datetime | None]

    __table_args__ = (
        _numbered_key(),
        CheckConstraint("status IN ('open', 'closed')", name="status"),
        Index(
            "uq_dream_contradictions_open",
            "user_id",
            "norm_key",
            unique=True,
            postgresql_where=text("status = 'open'"),
            sqlite_where=text("status = 'open'"),
        ),
        Index("ix_dream_contradictions_user_id", "user_id"),
    )


USER_IN_FLIGHT = "dispatched_at IS NOT NULL AND (last_dream_at IS NULL OR last_dream_at < dispatched_at)"


class UserState(Base):
    """Per-user schedule: when the user is next due, and whether something changed."""

    __tablename__ = "dream_user_state"

    user_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    next_dream_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    last_dream_at: Mapped[datetime | None]
    # Set when a signal or write touched the user after their last dream.
    dirty_since: Mapped[datetime | None]
    # A lease: the user's dream is running until then (per-user mutual exclusion).
    locked_until: Mapped[datetime | None]
    lock_token: Mapped[str | None] = mapped_column(String(36))
    # When beat's dispatcher last sent this user a run: a dirty user is not sent again
    # until a newer change arrives or the dispatch lease runs out (the run was lost).
    dispatched_at: Mapped[datetime | None]

    __table_args__ = (
        Index("ix_dream_user_state_next_dream_at", "next_dream_at"),
        Index(
            "ix_dream_user_state_dirty",
            "dirty_since",
            postgresql_where=text("dirty_since IS NOT NULL"),
            sqlite_where=text("dirty_since IS NOT NULL"),
        ),
        # Users sent a run that has not started yet: what an autoscaler counts as dream
        # work in flight (ops/k8s/keda-scaledobject.yaml), read without a table scan.
        Index(
            "ix_dream_user_state_in_flight",
            "dispatched_at",
            postgresql_where=text(USER_IN_FLIGHT),
            sqlite_where=text(USER_IN_FLIGHT),
        ),
    )


class EntryState(Base):
    """What Reverie last saw of an entry's ``access_count``, and when it grew."""

    __tablename__ = "dream_entry_state"

    # Keyed per user: the host's memory table may number its rows per user (its key
    # (user_id, id) when it is distributed), so an entry id alone names no row.
    entry_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    access_count_seen: Mapped[int] = mapped_column(Integer, server_default="0")
    last_recalled_at: Mapped[datetime | None]
    seen_at: Mapped[datetime] = mapped_column(server_default=utcnow())

    __table_args__ = (
        PrimaryKeyConstraint("user_id", "entry_id"),
        Index("ix_dream_entry_state_user_id", "user_id"),
    )


class Event(Base):
    """Every write or removal Reverie makes to the memory table. Never the value."""

    __tablename__ = "dream_events"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(255))
    entry_id: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(32))
    signal_id: Mapped[int | None] = mapped_column(BigId)
    run_id: Mapped[int | None] = mapped_column(BigId)
    at: Mapped[datetime] = mapped_column(server_default=utcnow())

    __table_args__ = (
        _numbered_key(),
        Index("ix_dream_events_user_id", "user_id"),
        Index("ix_dream_events_run_id", "run_id"),
        Index("ix_dream_events_signal_id", "signal_id"),
        Index("ix_dream_events_at", "at"),
        Index(
            "ix_dream_events_restore",
            "user_id",
            "entry_id",
            postgresql_where=text(EVENT_RESTORE),
            sqlite_where=text(EVENT_RESTORE),
        ),
    )


class Policy(Base):
    """A per-agent dream policy in EDDI ``dreamConfig`` field names."""

    __tablename__ = "dream_policies"

    agent_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    config: Mapped[dict[str, Any]]
    updated_at: Mapped[datetime] = mapped_column(server_default=utcnow())


class Spend(Base):
    """A budget and what was reserved and spent against it (scope ``run``, ``day``,
    ``user``: one user's signals in a day, or ``signal``: one signal over its attempts)."""

    __tablename__ = "dream_spend"

    scope: Mapped[str] = mapped_column(String(8), primary_key=True)
    scope_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    limit_nano: Mapped[int] = mapped_column(BigId)
    reserved_nano: Mapped[int] = mapped_column(BigId, server_default="0")
    spent_nano: Mapped[int] = mapped_column(BigId, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(server_default=utcnow())

    __table_args__ = (
        CheckConstraint("scope IN ('run', 'day', 'user', 'signal')", name="scope"),
        CheckConstraint("reserved_nano >= 0 AND spent_nano >= 0", name="non_negative"),
        CheckConstraint("reserved_nano + spent_nano <= limit_nano", name="within_limit"),
        Index("ix_dream_spend_updated_at", "updated_at"),
    )


class Reservation(Base):
    """A model call's reservation in flight: taken from ``lines`` (``[scope, key]``
    pairs) and removed when the call is settled. One still here after ``deadline``
    belongs to a call whose process died; the reaper settles it."""

    __tablename__ = "dream_reservations"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    lines: Mapped[Any] = mapped_column(JsonType)
    amount_nano: Mapped[int] = mapped_column(BigId)
    deadline: Mapped[datetime] = mapped_column(index=True)
    created_at: Mapped[datetime] = mapped_column(server_default=utcnow())

    __table_args__ = (CheckConstraint("amount_nano >= 0", name="non_negative"),)


class Observation(Base):
    """A candidate preference from feedback, promoted once it recurs enough."""

    __tablename__ = "dream_observations"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(255))
    # '' when the feedback named no agent, so the unique key below works everywhere.
    agent_id: Mapped[str] = mapped_column(String(255), server_default="")
    key: Mapped[str] = mapped_column(String(100))
    value: Mapped[Any] = mapped_column(JsonType)
    evidence: Mapped[str | None] = mapped_column(Text)
    seen_count: Mapped[int] = mapped_column(Integer, server_default="0")
    signal_ids: Mapped[Any] = mapped_column(JsonType)
    first_seen_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    last_seen_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    promoted_at: Mapped[datetime | None]

    __table_args__ = (
        _numbered_key(),
        Index("uq_dream_observations_candidate", "user_id", "agent_id", "key", unique=True),
    )


class KeyVector(Base):
    """The key-matching model's vector for one key in rules form (no user id: keys are
    shared; an erasure deletes those of its user's keys)."""

    __tablename__ = "dream_key_vectors"

    # Names the model and the phrase form, so another model never reads these vectors.
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    norm_key: Mapped[str] = mapped_column(String(512), primary_key=True)
    vector: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(server_default=utcnow())


class ActivityEvent(Base):
    """One event of an ``activity`` signal, kept for routine detection."""

    __tablename__ = "dream_activity"
    __mapper_args__ = BY_ID

    id: Mapped[int] = mapped_column(BigId, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(255))
    agent_id: Mapped[str] = mapped_column(String(255), server_default="")
    action: Mapped[str] = mapped_column(String(255))
    at: Mapped[datetime]
    attributes: Mapped[Any | None] = mapped_column(JsonType)
    signal_id: Mapped[int | None] = mapped_column(BigId)

    __table_args__ = (
        _numbered_key(),
        Index("ix_dream_activity_user_id_action_at", "user_id", "action", "at"),
    )


class Profile(Base):
    """Prompt-ready memory of one user as one agent sees it (``agent_id`` '' : the
    agent-less profile, global entries only), rebuilt when the user's memory changes.

    ``layout`` holds what a reader needs to cut the text to a smaller budget without a
    tokenizer: the included lines in ranked order with their token counts, the section
    headers' counts and the left-out line's. The ``source_*`` columns are the
    fingerprint of the user's rows the profile was built from.
    """

    __tablename__ = "dream_profiles"

    user_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    agent_id: Mapped[str] = mapped_column(String(255), primary_key=True, server_default="")
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(Integer)
    budget: Mapped[int] = mapped_column(Integer)
    entries_included: Mapped[int] = mapped_column(Integer)
    entries_left_out: Mapped[int] = mapped_column(Integer)
    layout: Mapped[dict[str, Any]]
    tokenizer: Mapped[str] = mapped_column(String(255))
    built_at: Mapped[datetime] = mapped_column(server_default=utcnow())
    source_rows: Mapped[int] = mapped_column(Integer, server_default="0")
    source_updated_at: Mapped[datetime | None]
    source_recalls: Mapped[int] = mapped_column(BigId, server_default="0")
    source_conflicted: Mapped[int] = mapped_column(Integer, server_default="0")
    source_content: Mapped[int] = mapped_column(BigId, server_default="0")

    __table_args__ = (
        # The profiles the model wrote (``store.profiles.model_written``), and only those.
        Index(
            "ix_dream_profiles_model_written",
            "user_id",
            # Not text(): the class's own ``text`` column shadows it here.
            postgresql_where=_PG_MODEL_WRITTEN,
            sqlite_where=_SQLITE_MODEL_WRITTEN,
        ),
    )


DREAM_TABLES: tuple[Table, ...] = tuple(Base.metadata.sorted_tables)

# -- the shared memory table -------------------------------------------------------

MEMORY_COLUMNS = (
    "id",
    "user_id",
    "key",
    "value",
    "category",
    "visibility",
    "source_agent_id",
    "group_ids",
    "source_conversation_id",
    "conflicted",
    "access_count",
    "created_at",
    "updated_at",
)


@lru_cache(maxsize=8)
def query_name(name: str) -> str:
    """A name for a subquery or alias in a statement that also reads the host's memory
    table, that no such table can have (``REVERIE_MEMORY_TABLE`` takes letters, digits and
    ``_`` only): a table called like the alias would otherwise clash with it, or be read
    in its place."""
    return f"reverie-{name}"


@lru_cache(maxsize=16)
def memory_table(name: str = "usermemories", last_access_column: str | None = None) -> Table:
    """The host's memory table as a Core ``Table`` (EDDI's layout, docs/reference.md).

    Reverie never creates it from this object on PostgreSQL (the migration emits
    EDDI's exact DDL) and never alters it. ``last_access_column`` names an optional
    timestamp column the host maintains on recall.

    One object per (name, column) pair, made once: statements built for the table
    (such as a profile build's read, compiled once per shape) are keyed by it, and a
    new object each time would build them again for every chunk of users.
    """
    columns: list[Column[Any]] = [
        Column("id", String(64), primary_key=True),
        Column("user_id", String(255), nullable=False),
        Column("key", String(255), nullable=False),
        Column("value", JsonType),
        Column("category", String(50), nullable=False, server_default="fact"),
        Column("visibility", String(20), nullable=False, server_default="self"),
        Column("source_agent_id", String(255)),
        Column("group_ids", JsonType),
        Column("source_conversation_id", String(255)),
        Column("conflicted", Boolean),
        Column("access_count", Integer),
        Column("created_at", Timestamp),
        Column("updated_at", Timestamp),
    ]
    if last_access_column:
        columns.append(Column(last_access_column, Timestamp))
    # A MetaData of its own per (name, column) pair: settings differ between tests.
    return Table(name, MetaData(), *columns)
