"""Per-user mutual exclusion across processes and hosts: a lease in ``dream_user_state``.

Taking the lease is one conditional ``UPDATE`` (free, or expired), so two workers on any
hosts can never both hold it; a worker that dies loses it when ``locked_until`` passes.
Plain SQL, so it works the same on PostgreSQL and on the demo's SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import Table, delete, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.models import UserState
from store.types import db_now


class Taken(NamedTuple):
    """What :func:`take` did: whether it took the lease, and whether it made the user's
    state row to do so (the user had none)."""

    taken: bool
    made_row: bool


def acquire(session: Session, user_id: str, token: str, ttl: timedelta, *, entries: Table | None = None) -> bool:
    """Take the user's lease for ``ttl`` unless someone else holds a live one.

    With ``entries`` (the memory table), a user with no state row and no entries there
    (erased since they were named, or never known) gets no row and no lease: see
    :func:`without_unknown`."""
    took = take(session, user_id, token, ttl)
    if took.taken and took.made_row and entries is not None:
        return bool(without_unknown(session, entries, [user_id], token))
    return took.taken


def take(session: Session, user_id: str, token: str, ttl: timedelta) -> Taken:
    """:func:`acquire`, saying also whether this transaction made the user's state row:
    for a caller that must tell that row from one the user had (an erasure)."""
    at = db_now(session)
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    made = session.execute(
        insert(UserState)
        .values(user_id=user_id, next_dream_at=at)
        .on_conflict_do_nothing()
        .returning(UserState.user_id)
    ).first()
    taken = session.execute(
        update(UserState)
        .where(
            UserState.user_id == user_id,
            or_(UserState.locked_until.is_(None), UserState.locked_until < at, UserState.lock_token == token),
        )
        .values(locked_until=at + ttl, lock_token=token)
        .returning(UserState.user_id)
    ).first()
    return Taken(taken is not None, made is not None)


def renew(session: Session, user_id: str, token: str, ttl: timedelta) -> bool:
    """Extend a lease we hold; False if it was lost (expired and taken by another)."""
    kept = session.execute(
        update(UserState)
        .where(UserState.user_id == user_id, UserState.lock_token == token)
        .values(locked_until=db_now(session) + ttl)
        .returning(UserState.user_id)
    ).first()
    return kept is not None


def renew_many(
    session: Session, user_ids: Sequence[str], token: str, ttl: timedelta, *, skip_locked: bool = False
) -> dict[str, datetime]:
    """Extend the leases of ``user_ids`` still held under ``token``; returns user -> new
    lease end. The rows are locked in user order (two renewals never deadlock), until
    the transaction ends: no one takes those leases meanwhile. Without ``skip_locked`` a
    user left out has lost the lease; with it, rows another transaction holds right now
    are left out too (see :func:`holders`)."""
    if not user_ids:
        return {}
    mine = (
        select(UserState.user_id)
        .where(UserState.user_id.in_(sorted(user_ids)), UserState.lock_token == token)
        .order_by(UserState.user_id)
    )
    if session.get_bind().dialect.name == "postgresql":
        mine = mine.with_for_update(skip_locked=skip_locked)
    rows = session.execute(
        update(UserState)
        .where(UserState.user_id.in_(select(mine.cte("mine").c.user_id)), UserState.lock_token == token)
        .values(locked_until=db_now(session) + ttl)
        .returning(UserState.user_id, UserState.locked_until)
        .execution_options(synchronize_session=False)
    )
    return {row.user_id: row.locked_until for row in rows}


def holders(session: Session, user_ids: Sequence[str], token: str) -> set[str]:
    """Which of ``user_ids`` still have their lease under ``token`` (a plain read)."""
    if not user_ids:
        return set()
    query = select(UserState.user_id).where(UserState.user_id.in_(sorted(user_ids)), UserState.lock_token == token)
    return set(session.scalars(query))


def holds_row(session: Session, user_id: str) -> bool:
    """Whether the user has a state row (a schedule, a lease)."""
    return session.scalar(select(UserState.user_id).where(UserState.user_id == user_id)) is not None


def release(session: Session, user_id: str, token: str) -> None:
    """Give the lease back (only if it is still ours)."""
    session.execute(
        update(UserState)
        .where(UserState.user_id == user_id, UserState.lock_token == token)
        .values(locked_until=None, lock_token=None)
    )


def forget(session: Session, user_id: str, token: str) -> None:
    """Remove the user's state row while it holds a lease of ``token``: for the caller
    whose lease made that row (there was none before) and who gives the lease back."""
    session.execute(delete(UserState).where(UserState.user_id == user_id, UserState.lock_token == token))


_PG_ENSURE = text(
    "INSERT INTO dream_user_state (user_id, next_dream_at) SELECT unnest(CAST(:ids AS varchar[])), :at "
    "ON CONFLICT (user_id) DO NOTHING RETURNING user_id"
)
# SKIP LOCKED: a row another transaction holds right now is left out instead of waited
# for (and never deadlocks two chunks that share users); the caller retries those users
# one by one with :func:`acquire`, which waits.
_PG_ACQUIRE_MANY = text(
    """
WITH free AS (
    SELECT user_id FROM dream_user_state
    WHERE user_id = ANY(CAST(:ids AS varchar[]))
      AND (locked_until IS NULL OR locked_until < :at OR lock_token = :token)
    ORDER BY user_id
    FOR UPDATE SKIP LOCKED
)
UPDATE dream_user_state AS s SET locked_until = :until, lock_token = :token
FROM free WHERE s.user_id = free.user_id
RETURNING s.user_id
"""
)


def acquire_many(
    session: Session, user_ids: Sequence[str], token: str, ttl: timedelta, *, entries: Table | None = None
) -> list[str]:
    """Take the leases of every free user among ``user_ids`` under one token (PostgreSQL,
    two statements); returns the users leased, in order. Users whose lease is held, or
    whose state row is locked at this moment, are left out; with ``entries``, so are
    users who had no state row and have no entries (:func:`without_unknown`)."""
    at = db_now(session)
    ids = sorted(set(user_ids))
    made = list(session.scalars(_PG_ENSURE, {"ids": ids, "at": at}))
    taken = set(session.scalars(_PG_ACQUIRE_MANY, {"ids": ids, "at": at, "until": at + ttl, "token": token}))
    if made and entries is not None:
        unknown = set(made) - set(without_unknown(session, entries, [u for u in made if u in taken], token))
        taken -= unknown
    return [uid for uid in ids if uid in taken]


def without_unknown(session: Session, entries: Table, made: Sequence[str], token: str) -> list[str]:
    """Of users whose state row this lease (``token``) just made, those with entries in
    ``entries``; the others' rows go again. Such a user was named by a message sent
    before an erasure (or never had entries): a dream must not bring them back, with a
    schedule and a ledger row. Looked at after the lease is held, in a statement of its
    own: an erasure that committed meanwhile is seen, and one still to come waits for
    the lease."""
    if not made:
        return []
    have = set(session.scalars(select(entries.c.user_id).where(entries.c.user_id.in_(sorted(made))).distinct()))
    gone = sorted(set(made) - have)
    if gone:
        session.execute(delete(UserState).where(UserState.user_id.in_(gone), UserState.lock_token == token))
    return [u for u in made if u in have]


def release_many(session: Session, user_ids: Sequence[str], token: str) -> None:
    """Give back the leases of ``user_ids`` still held under ``token`` (one statement)."""
    if user_ids:
        session.execute(
            update(UserState)
            .where(UserState.user_id.in_(sorted(user_ids)), UserState.lock_token == token)
            .values(locked_until=None, lock_token=None)
        )


# Erasure and the writers that act on rows they read earlier (routine detection, a
# restore) meet on a per-user advisory lock instead of a lock on a whole table, which
# made every producer's insert wait behind one erasure. Users share a bucket of the lock
# space so that a detection over all users holds a bounded number of locks (PostgreSQL's
# lock table is small), at the price of an erasure now and then waiting for a writer
# that holds the bucket of another user.
_LOCK_SPACE = 1_380_275_781  # the first key of every such lock: Reverie's own namespace
_BUCKETS = 1024
_PG_ERASING = text("SELECT pg_advisory_xact_lock(:space, hashtext(:user_id) & :mask)")
_PG_WRITING = text("SELECT pg_advisory_xact_lock_shared(:space, hashtext(:user_id) & :mask)")


def erasure_lock(session: Session, user_id: str, *, shared: bool) -> None:
    """Until the caller's transaction ends: an erasure's hold on ``user_id`` (exclusive),
    or a writer's that must not interleave with one (``shared``); PostgreSQL only (on
    SQLite a writing transaction already excludes every other)."""
    if session.get_bind().dialect.name == "postgresql":
        statement = _PG_WRITING if shared else _PG_ERASING
        session.execute(statement, {"space": _LOCK_SPACE, "user_id": user_id, "mask": _BUCKETS - 1})


def hold_off_erasure(session: Session, user_ids: Sequence[str]) -> None:
    """Keep an erasure of any of ``user_ids`` from starting until the caller's transaction
    ends, waiting for one under way (its deletions are then committed and seen)."""
    for user_id in sorted(set(user_ids)):
        erasure_lock(session, user_id, shared=True)
