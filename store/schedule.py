"""Who is due for a dream: per-user schedule rows in ``dream_user_state``.

A user is due when their ``next_dream_at`` has passed, when something touched them
since their last dream (``dirty_since``), or when they have entries in the memory
table and no state row yet (a host database Reverie has never seen).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, or_, select, text, union, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.dispatch import next_slot
from store.entry_state import users_in
from store.memories import table_for
from store.models import MAX_USER_ID, UserState
from store.types import db_now
from worker.settings import Settings


def _upsert(
    session: Session, values: dict[str, Any] | list[dict[str, Any]], set_: dict[str, Any], where: Any = None
) -> None:
    # Both dialects spell ON CONFLICT the same way; only the construct differs. Many rows
    # are one statement, and take their locks in the order given.
    if session.get_bind().dialect.name == "postgresql":
        pg = pg_insert(UserState).values(values)
        session.execute(pg.on_conflict_do_update(index_elements=[UserState.user_id], set_=set_, where=where))
    else:
        lite = sqlite_insert(UserState).values(values)
        session.execute(lite.on_conflict_do_update(index_elements=[UserState.user_id], set_=set_, where=where))


def mark_dirty(session: Session, settings: Settings, user_id: str, at: datetime | None = None) -> None:
    """Note that ``user_id`` changed; keeps the earliest ``dirty_since`` already set
    unless a run holds the user (:func:`mark_dirty_many`)."""
    mark_dirty_many(session, settings, [user_id], at)


def mark_dirty_many(session: Session, settings: Settings, user_ids: Sequence[str], at: datetime | None = None) -> None:
    """:func:`mark_dirty` for many users: one statement, rows locked in user id order
    (so two batches never wait on each other in a cycle).

    A user seen for the first time gets a schedule row whose next slot is their own
    phase of the dream interval (:func:`store.dispatch.next_slot`), not now: like any
    other changed user, they are dreamed ``dispatch_dirty_delay_seconds`` after their
    first change, once for the changes of that while, not at once and again for the
    rest of the conversation."""
    users = sorted(set(user_ids))
    if not users:
        return
    when = at or db_now(session)
    interval = settings.dream_interval_seconds
    _upsert(
        session,
        [
            {"user_id": user_id, "dirty_since": when, "next_dream_at": next_slot(user_id, when, interval)}
            for user_id in users
        ],
        {"dirty_since": when},
        # The earliest change stays the mark (the dirty delay counts from it), except
        # while a run holds the user: that run may have read the rows before this change,
        # and its end keeps only a mark later than its start (:func:`mark_dreamed`).
        where=or_(
            UserState.dirty_since.is_(None),
            and_(UserState.locked_until.is_not(None), UserState.locked_until > when, UserState.dirty_since < when),
        ),
    )


def mark_dirty_known(session: Session, user_ids: Sequence[str], at: datetime) -> None:
    """Mark users changed at ``at`` (due after the dirty delay, as :func:`mark_dirty_many`
    does) where they have a schedule row: none is made (a user erased meanwhile stays
    gone). ``at`` replaces an earlier mark, so a dream under way, which started before
    ``at``, leaves it for the next one."""
    users = sorted(set(user_ids))
    if users:
        session.execute(update(UserState).where(UserState.user_id.in_(users)).values(dirty_since=at))


def due_user_ids(session: Session, at: datetime, limit: int, settings: Settings | None = None) -> list[str]:
    """Up to ``limit`` user ids due at ``at``, in a stable order.

    With ``settings`` given, users who have entries in the memory table but no state
    row are due too.
    """
    due = select(UserState.user_id).where(or_(UserState.next_dream_at <= at, UserState.dirty_since.is_not(None)))
    query = due
    if settings is not None:
        table = table_for(settings)
        unseen = (
            select(table.c.user_id)
            .where(
                ~select(UserState.user_id).where(UserState.user_id == table.c.user_id).exists(),
                func.length(table.c.user_id) <= MAX_USER_ID,
            )
            .distinct()
        )
        query = union(due, unseen)  # type: ignore[assignment]
    sub = query.subquery()
    stmt = select(sub.c.user_id).order_by(sub.c.user_id).limit(limit)
    return list(session.scalars(stmt))


def all_user_ids(session: Session, settings: Settings) -> list[str]:
    """Every user with entries in the memory table or a schedule row."""
    table = table_for(settings)
    # An id longer than Reverie's tables hold (a host's ``text`` column may hold one) is left alone.
    holdable = select(table.c.user_id).where(func.length(table.c.user_id) <= MAX_USER_ID)
    sub = union(holdable, select(UserState.user_id)).subquery()
    return list(session.scalars(select(sub.c.user_id).order_by(sub.c.user_id)))


def known_user_ids(session: Session, settings: Settings, user_ids: Sequence[str]) -> set[str]:
    """Those of ``user_ids`` with entries in the memory table or a schedule row (two
    indexed looks, each on one table: a set operation across two distributed tables is
    not one every Citus plans): a user neither names is unknown here (a typo, or erased)."""
    if not user_ids:
        return set()
    table = table_for(settings)
    wanted = sorted(set(user_ids))
    array = session.get_bind().dialect.name == "postgresql"
    found = set(session.scalars(select(UserState.user_id).where(users_in(UserState.user_id, wanted, array=array))))
    rest = [u for u in wanted if u not in found]
    if rest:
        with_rows = select(table.c.user_id).where(users_in(table.c.user_id, rest, array=array)).distinct()
        found.update(session.scalars(with_rows))
    return found


def mark_dreamed(session: Session, user_id: str, at: datetime, next_at: datetime) -> None:
    """Record a dream that started at ``at``: sets the next due time and clears
    ``dirty_since`` unless something touched the user after ``at`` (then they stay due).
    """
    still_dirty = case((UserState.dirty_since > at, UserState.dirty_since), else_=None)
    _upsert(
        session,
        {"user_id": user_id, "last_dream_at": at, "next_dream_at": next_at, "dirty_since": None},
        {"last_dream_at": at, "next_dream_at": next_at, "dirty_since": still_dirty},
    )


def defer(session: Session, user_id: str, next_at: datetime) -> None:
    """Move a user's next due time without touching anything else."""
    session.execute(update(UserState).where(UserState.user_id == user_id).values(next_dream_at=next_at))


_PG_DREAMED = text(
    """
INSERT INTO dream_user_state (user_id, last_dream_at, next_dream_at, dirty_since)
SELECT u, :at, n, NULL FROM unnest(CAST(:ids AS varchar[]), CAST(:next_ats AS timestamp[])) AS t(u, n)
ON CONFLICT (user_id) DO UPDATE SET
    last_dream_at = EXCLUDED.last_dream_at,
    next_dream_at = EXCLUDED.next_dream_at,
    dirty_since = CASE WHEN dream_user_state.dirty_since > :at THEN dream_user_state.dirty_since END
"""
)


def next_dreams(user_ids: Sequence[str], after: datetime, interval: timedelta) -> dict[str, datetime]:
    """Each user's next scheduled dream after one that ended at ``after``: at their own
    phase of the interval (:func:`store.dispatch.next_slot`), so users dreamed together
    (a chunk, a whole ``reverie run --all``) are not all due again at one instant."""
    seconds = interval.total_seconds()
    return {user_id: next_slot(user_id, after, seconds) for user_id in user_ids}


def mark_dreamed_many(session: Session, next_at: Mapping[str, datetime], at: datetime) -> None:
    """:func:`mark_dreamed` for several users whose dreams started at ``at``, each due
    next at ``next_at[user]`` (one statement)."""
    if not next_at:
        return
    user_ids = sorted(next_at)
    if session.get_bind().dialect.name == "postgresql":
        # Array parameters, not one per user: nothing to compile per chunk.
        session.execute(_PG_DREAMED, {"ids": user_ids, "next_ats": [next_at[u] for u in user_ids], "at": at})
        return
    still_dirty = case((UserState.dirty_since > at, UserState.dirty_since), else_=None)
    rows = [
        {"user_id": uid, "last_dream_at": at, "next_dream_at": next_at[uid], "dirty_since": None} for uid in user_ids
    ]
    lite = sqlite_insert(UserState).values(rows)
    set_ = {"last_dream_at": at, "next_dream_at": lite.excluded.next_dream_at, "dirty_since": still_dirty}
    session.execute(lite.on_conflict_do_update(index_elements=[UserState.user_id], set_=set_))
