"""Queries for beat's dispatcher and sweeper: claiming due users, finding stranded signals.

A user is due when ``next_dream_at`` has passed, or when a change marked them dirty at
least ``dirty_delay`` ago and no run has been sent since that change (or the one sent
is older than the dispatch lease). Claiming moves ``next_dream_at`` to the end of the
dispatch lease (or the user's next slot, if that comes first) and stamps
``dispatched_at`` in the same statement. The claim is a lease, not a promise kept by the
broker: the run that is sent moves ``next_dream_at`` on to the next slot when it
finishes (:func:`store.schedule.mark_dreamed`); a run whose message was lost, or whose
worker died, never does, and the user is due again when the lease ends. On PostgreSQL it locks
with ``FOR UPDATE SKIP LOCKED`` through the two schedule indexes, so its cost follows
the number of due users and a concurrent claim never returns the same user.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import Table, bindparam, func, or_, select, text, union, union_all, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from store.memories import table_for
from store.models import MAX_USER_ID, Signal, UserState
from store.types import db_now
from worker.settings import Settings

EPOCH = datetime(1970, 1, 1)
_HASH_SPACE = 2**32

# The phase is the first 32 bits of md5(user_id) as a fraction of the interval, the same
# in Python (:func:`phase_seconds`) and SQL, so a slot computed by either side agrees.
_PG_PHASE = "(('x' || substr(md5(s.user_id), 1, 8))::bit(32)::bigint / 4294967296.0) * :interval"

# Both candidate scans walk an index in order and stop at the limit, skipping rows
# another claim holds. The UPDATE then finds the claimed rows by primary key
# (= ANY(ARRAY(...)) is an index scan), so no step reads users who are not due.
_PG_CLAIM = text(
    f"""
WITH timed AS (
    SELECT user_id FROM dream_user_state
    WHERE next_dream_at <= :at
    ORDER BY next_dream_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), dirty AS (
    SELECT user_id FROM dream_user_state
    WHERE dirty_since IS NOT NULL
      AND dirty_since <= :dirty_cutoff
      AND (dispatched_at IS NULL OR dispatched_at <= dirty_since OR dispatched_at < :lease_cutoff)
    ORDER BY dirty_since
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
UPDATE dream_user_state AS s
SET next_dream_at = LEAST(
        TIMESTAMP '1970-01-01'
            + make_interval(secs => ceil((:base - {_PG_PHASE}) / :interval) * :interval + {_PG_PHASE}),
        :lease_end
    ),
    dispatched_at = :at
WHERE s.user_id = ANY(ARRAY(SELECT user_id FROM timed UNION SELECT user_id FROM dirty LIMIT :limit))
RETURNING s.user_id
"""
)


def phase_seconds(user_id: str, interval_seconds: float) -> float:
    """The user's fixed offset within the dream interval, in ``[0, interval)``."""
    digest = hashlib.md5(user_id.encode("utf-8"), usedforsecurity=False).hexdigest()
    return int(digest[:8], 16) / _HASH_SPACE * interval_seconds


def next_slot(user_id: str, after: datetime, interval_seconds: float) -> datetime:
    """The user's next dream time: on their own phase, between half and one and a half
    intervals after ``after``, so users spread evenly over the interval and one who
    just dreamed is not due again at once."""
    phase = phase_seconds(user_id, interval_seconds)
    base = (after - EPOCH).total_seconds() + interval_seconds / 2
    seconds = math.ceil((base - phase) / interval_seconds) * interval_seconds + phase
    return EPOCH + timedelta(seconds=seconds)


def claim_due_users(
    session: Session,
    *,
    at: datetime | None = None,
    limit: int,
    interval_seconds: float,
    dirty_delay_seconds: float,
    lease_seconds: float,
) -> list[str]:
    """Claim up to ``limit`` due users: make each due again when the dispatch lease
    ends (or at their next slot, if sooner), stamp the dispatch, and return their ids
    (in no particular order). Commit before sending. The run sent for them moves them
    to their next slot when it finishes; if it never runs, they are claimed again after
    ``lease_seconds``. ``at`` defaults to the database's clock, which stamped
    ``dirty_since`` too."""
    at = at or db_now(session)
    dirty_cutoff = at - timedelta(seconds=dirty_delay_seconds)
    lease_cutoff = at - timedelta(seconds=lease_seconds)
    lease_end = at + timedelta(seconds=lease_seconds)
    if session.get_bind().dialect.name == "postgresql":
        params = {
            "at": at,
            "limit": limit,
            "dirty_cutoff": dirty_cutoff,
            "lease_cutoff": lease_cutoff,
            "lease_end": lease_end,
            "interval": float(interval_seconds),
            "base": (at - EPOCH).total_seconds() + interval_seconds / 2,
        }
        return list(session.scalars(_PG_CLAIM, params))
    return _claim_portable(
        session,
        at=at,
        limit=limit,
        interval_seconds=interval_seconds,
        dirty_cutoff=dirty_cutoff,
        lease_cutoff=lease_cutoff,
        lease_end=lease_end,
    )


def _claim_portable(
    session: Session,
    *,
    at: datetime,
    limit: int,
    interval_seconds: float,
    dirty_cutoff: datetime,
    lease_cutoff: datetime,
    lease_end: datetime,
) -> list[str]:
    # SQLite has one writer at a time: the UPDATE takes the write lock before it reads,
    # so a concurrent claim waits and then no longer sees these users as due.
    timed = select(UserState.user_id, UserState.next_dream_at.label("since")).where(UserState.next_dream_at <= at)
    dirty = select(UserState.user_id, UserState.dirty_since.label("since")).where(
        UserState.dirty_since.is_not(None),
        UserState.dirty_since <= dirty_cutoff,
        or_(
            UserState.dispatched_at.is_(None),
            UserState.dispatched_at <= UserState.dirty_since,
            UserState.dispatched_at < lease_cutoff,
        ),
    )
    due = union_all(timed, dirty).subquery()
    first = select(due.c.user_id).order_by(due.c.since).limit(limit)
    claimed = list(
        session.scalars(
            update(UserState).where(UserState.user_id.in_(first)).values(dispatched_at=at).returning(UserState.user_id)
        )
    )
    if claimed:
        table = cast(Table, UserState.__table__)
        session.execute(
            update(table).where(table.c.user_id == bindparam("uid")).values(next_dream_at=bindparam("next_at")),
            [{"uid": uid, "next_at": min(next_slot(uid, at, interval_seconds), lease_end)} for uid in claimed],
        )
    return claimed


def release_users(session: Session, user_ids: list[str], *, at: datetime | None = None) -> None:
    """Undo a claim whose runs could not be sent: the users are due again at ``at``
    (default: now, on the database's clock)."""
    if user_ids:
        at = at or db_now(session)
        session.execute(
            update(UserState).where(UserState.user_id.in_(user_ids)).values(next_dream_at=at, dispatched_at=None)
        )


def release_claim(session: Session, at: datetime) -> int:
    """Undo the claim stamped ``at`` (its ``dispatched_at``), for the dispatcher whose
    claim lost its reply: it does not know which users it claimed, and sent none of
    them. They are due again at ``at``. Returns the users released."""
    result = session.execute(
        update(UserState).where(UserState.dispatched_at == at).values(next_dream_at=at, dispatched_at=None)
    )
    return int(getattr(result, "rowcount", 0) or 0)


# Each distinct user of the memory table read once through its user_id index (a loose
# index scan), not every row; each new user is due at their own phase within the next
# interval, so a database of a million users does not become due in one minute.
_PG_ADOPT = f"""
WITH RECURSIVE users AS (
    (SELECT user_id FROM {{memories}} ORDER BY user_id LIMIT 1)
    UNION ALL
    SELECT (SELECT m.user_id FROM {{memories}} AS m WHERE m.user_id > users.user_id ORDER BY m.user_id LIMIT 1)
    FROM users WHERE users.user_id IS NOT NULL
)
INSERT INTO dream_user_state (user_id, next_dream_at)
SELECT s.user_id,
       TIMESTAMP '1970-01-01' + make_interval(secs => ceil((:base - {_PG_PHASE}) / :interval) * :interval + {_PG_PHASE})
FROM users AS s
WHERE s.user_id IS NOT NULL
  AND length(s.user_id) <= {MAX_USER_ID}
  AND NOT EXISTS (SELECT 1 FROM dream_user_state AS d WHERE d.user_id = s.user_id)
ON CONFLICT (user_id) DO NOTHING
RETURNING user_id
"""


def adopt_unseen_users(session: Session, settings: Settings, *, at: datetime | None = None) -> int:
    """Give every user of the memory table without a schedule row one, and return how
    many were adopted.

    On PostgreSQL each new user is due at their own phase within the next dream
    interval (the first slot at or after ``at``, default now on the database's
    clock), so adopting a large existing
    population spreads its first runs evenly instead of making everyone due at once;
    the scan reads each distinct user once through the memory table's user_id index.
    On SQLite (the demo) new users are due at ``at``. Runs at beat's start, after
    ``reverie migrate``, and hourly.
    """
    memories = table_for(settings)
    at = at or db_now(session)
    dialect = session.get_bind().dialect
    if dialect.name == "postgresql":
        interval = settings.dream_interval_seconds
        scan = text(_PG_ADOPT.format(memories=dialect.identifier_preparer.format_table(memories)))
        base = (at - EPOCH).total_seconds()
        return len(session.execute(scan, {"base": base, "interval": interval}).all())
    unseen = (
        select(memories.c.user_id, bindparam("at", at).label("next_dream_at"))
        .where(
            ~select(UserState.user_id).where(UserState.user_id == memories.c.user_id).exists(),
            func.length(memories.c.user_id) <= MAX_USER_ID,
        )
        .distinct()
    )
    # A concurrent mark_dirty may create the row first; that row wins.
    statement = (
        sqlite.insert(UserState)
        .from_select(["user_id", "next_dream_at"], unseen)
        .on_conflict_do_nothing(index_elements=["user_id"])
        .returning(UserState.user_id)
    )
    return len(session.execute(statement).all())


def stranded_signals(
    session: Session, *, at: datetime | None = None, grace_seconds: float, limit: int
) -> list[tuple[int, datetime]]:
    """(id, since) of signals that should be moving and may have no wake-up in the
    broker, oldest first: ready (``pending``, or ``failed`` and past its backoff) since
    longer than the grace, or ``processing`` with a lease that expired (the worker died).
    ``at`` defaults to the database's clock, which stamped ``available_at`` too."""
    at = at or db_now(session)
    ready = (
        select(Signal.id, Signal.available_at.label("since"))
        .where(Signal.status.in_(("pending", "failed")), Signal.available_at <= at - timedelta(seconds=grace_seconds))
        .order_by(Signal.available_at)
        .limit(limit)
    )
    expired = (
        select(Signal.id, Signal.claimed_until.label("since"))
        .where(Signal.status == "processing", Signal.claimed_until < at)
        .order_by(Signal.claimed_until)
        .limit(limit)
    )
    # Each branch is wrapped: SQLite allows no LIMIT inside a bare UNION member.
    both = union(select(ready.subquery()), select(expired.subquery())).subquery()
    rows = session.execute(select(both.c.id, both.c.since).order_by(both.c.since, both.c.id).limit(limit))
    return [(row.id, row.since) for row in rows]
