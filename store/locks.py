"""Per-user mutual exclusion across processes and hosts: a lease in ``dream_user_state``.

Taking the lease is one conditional ``UPDATE`` (free, or expired), so two workers on any
hosts can never both hold it; a worker that dies loses it when ``locked_until`` passes.
Plain SQL, so it works the same on PostgreSQL and on the demo's SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import delete, or_, select, text, update
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


def acquire(session: Session, user_id: str, token: str, ttl: timedelta) -> bool:
    """Take the user's lease for ``ttl`` unless someone else holds a live one."""
    return take(session, user_id, token, ttl).taken


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
    "ON CONFLICT (user_id) DO NOTHING"
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


def acquire_many(session: Session, user_ids: Sequence[str], token: str, ttl: timedelta) -> list[str]:
    """Take the leases of every free user among ``user_ids`` under one token (PostgreSQL,
    two statements); returns the users leased, in order. Users whose lease is held, or
    whose state row is locked at this moment, are left out."""
    at = db_now(session)
    ids = sorted(set(user_ids))
    session.execute(_PG_ENSURE, {"ids": ids, "at": at})
    taken = set(session.scalars(_PG_ACQUIRE_MANY, {"ids": ids, "at": at, "until": at + ttl, "token": token}))
    return [uid for uid in ids if uid in taken]


def release_many(session: Session, user_ids: Sequence[str], token: str) -> None:
    """Give back the leases of ``user_ids`` still held under ``token`` (one statement)."""
    if user_ids:
        session.execute(
            update(UserState)
            .where(UserState.user_id.in_(sorted(user_ids)), UserState.lock_token == token)
            .values(locked_until=None, lock_token=None)
        )
