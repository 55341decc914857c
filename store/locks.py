"""Per-user mutual exclusion across processes and hosts: a lease in ``dream_user_state``.

Taking the lease is one conditional ``UPDATE`` (free, or expired), so two workers on any
hosts can never both hold it; a worker that dies loses it when ``locked_until`` passes.
Plain SQL, so it works the same on PostgreSQL and on the demo's SQLite.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import or_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.models import UserState
from store.types import now


def acquire(session: Session, user_id: str, token: str, ttl: timedelta) -> bool:
    """Take the user's lease for ``ttl`` unless someone else holds a live one."""
    at = now()
    values = {"user_id": user_id, "next_dream_at": at}
    if session.get_bind().dialect.name == "postgresql":
        session.execute(pg_insert(UserState).values(**values).on_conflict_do_nothing())
    else:
        session.execute(sqlite_insert(UserState).values(**values).on_conflict_do_nothing())
    taken = session.execute(
        update(UserState)
        .where(
            UserState.user_id == user_id,
            or_(UserState.locked_until.is_(None), UserState.locked_until < at, UserState.lock_token == token),
        )
        .values(locked_until=at + ttl, lock_token=token)
        .returning(UserState.user_id)
    ).first()
    return taken is not None


def renew(session: Session, user_id: str, token: str, ttl: timedelta) -> bool:
    """Extend a lease we hold; False if it was lost (expired and taken by another)."""
    kept = session.execute(
        update(UserState)
        .where(UserState.user_id == user_id, UserState.lock_token == token)
        .values(locked_until=now() + ttl)
        .returning(UserState.user_id)
    ).first()
    return kept is not None


def release(session: Session, user_id: str, token: str) -> None:
    """Give the lease back (only if it is still ours)."""
    session.execute(
        update(UserState)
        .where(UserState.user_id == user_id, UserState.lock_token == token)
        .values(locked_until=None, lock_token=None)
    )
