"""Queries on ``dream_signals``: the producer's insert, listing and replay, and the
worker's claim, lock and outcome."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Text, and_, case, cast, exists, func, literal, null, or_, select, text, tuple_, union_all, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased, defer

from store.models import Signal
from store.types import db_now, now, utcnow


@dataclass(frozen=True)
class Inserted:
    signal_id: int
    idempotency_key: str
    created: bool


def insert_signal(
    session: Session,
    *,
    kind: str,
    user_id: str,
    payload: Any,
    agent_id: str | None,
    idempotency_key: str | None,
    fallback_key: str,
    payload_text: str | None = None,
) -> Inserted:
    """Insert a signal unless this user already has one with the same idempotency key.

    On PostgreSQL a missing key is computed by the table's trigger, exactly as for a
    producer that INSERTs by hand; elsewhere ``fallback_key`` is used. ``payload_text``:
    the payload as the JSON text it came in, written as that text on PostgreSQL (its
    numbers as written: ``100.50`` stays ``100.50``, as a producer's own SQL keeps it,
    and so gets the same key).
    """
    dialect = session.get_bind().dialect.name
    key = idempotency_key if idempotency_key is not None or dialect == "postgresql" else fallback_key
    as_text = payload_text if dialect == "postgresql" else None
    values = {
        "kind": kind,
        "user_id": user_id,
        "agent_id": agent_id,
        "payload": payload if as_text is None else cast(literal(as_text, Text), postgresql.JSONB),
        "idempotency_key": key,
    }
    insert = postgresql.insert(Signal) if dialect == "postgresql" else sqlite.insert(Signal)
    statement = (
        insert.values(**values)
        .on_conflict_do_nothing(index_elements=["user_id", "idempotency_key"])
        .returning(Signal.id, Signal.idempotency_key)
    )
    row = session.execute(statement).first()
    if row is not None:
        return Inserted(row.id, row.idempotency_key, created=True)
    # Keys are unique per user: the duplicate is this user's own signal, never another's.
    existing = session.execute(
        select(Signal.id, Signal.idempotency_key).where(
            Signal.user_id == user_id,
            Signal.idempotency_key == _key_expression(key, kind, user_id, as_text or _json_text(payload), dialect),
        )
    ).one()
    return Inserted(existing.id, existing.idempotency_key, created=False)


def _key_expression(key: str | None, kind: str, user_id: str, payload_text: str, dialect: str) -> Any:
    if key is not None:
        return key
    # The same expression the trigger uses, so a duplicate is found without a second hash.
    assert dialect == "postgresql"
    return text(
        "encode(sha256(convert_to("
        ":kind || E'\\n' || :user_id || E'\\n' || CAST(:payload AS jsonb)::text, 'UTF8')), 'hex')"
    ).bindparams(kind=kind, user_id=user_id, payload=payload_text)


def _json_text(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False)


def list_signals(
    session: Session,
    *,
    status: str | None = None,
    kind: str | None = None,
    user_id: str | None = None,
    limit: int = 50,
) -> Sequence[Signal]:
    """The newest signals, without their payloads (a hostile payload may not even parse)."""
    query = select(Signal).options(defer(Signal.payload, raiseload=True)).order_by(Signal.id.desc()).limit(limit)
    if status is not None:
        query = query.where(Signal.status == status)
    if kind is not None:
        query = query.where(Signal.kind == kind)
    if user_id is not None:
        query = query.where(Signal.user_id == user_id)
    return session.scalars(query).all()


def count_by_status(session: Session) -> dict[tuple[str, str], int]:
    rows = session.execute(select(Signal.kind, Signal.status, func.count()).group_by(Signal.kind, Signal.status))
    return {(kind, status): count for kind, status, count in rows}


def retry_signals(session: Session, *, signal_id: int | None = None, all_dead: bool = False) -> list[int]:
    """Put dead (or failed) signals back to ``pending`` with fresh attempts."""
    statement = (
        update(Signal)
        .values(status="pending", attempts=0, available_at=db_now(session), claimed_until=None, claim_token=None)
        .returning(Signal.id)
    )
    if signal_id is not None:
        statement = statement.where(Signal.id == signal_id, Signal.status.in_(("dead", "failed")))
    elif all_dead:
        statement = statement.where(Signal.status == "dead")
    else:
        return []
    return list(session.scalars(statement))


def get_signal(session: Session, signal_id: int) -> Signal | None:
    return session.get(Signal, signal_id)


def oldest_pending(session: Session) -> datetime | None:
    return session.scalar(select(func.min(Signal.enqueued_at)).where(Signal.status == "pending"))


# -- the worker side: claim, load, lock, record the outcome ------------------------------

READY_STATUSES = ("pending", "failed")


@dataclass(frozen=True)
class Claimed:
    """A signal this worker now holds until ``claimed_until`` (its lease)."""

    signal_id: int
    kind: str
    user_id: str
    agent_id: str | None
    attempts: int
    claim_token: str
    enqueued_at: datetime
    #: The payload as JSON text, when the claim returned it (``with_payload=True``);
    #: never parsed by the driver (see :func:`load_payload_text`).
    payload_text: str | None = field(default=None, repr=False)
    has_payload: bool = False


def _clock(session: Session) -> Any:
    """The database's current time for use inside a statement: on PostgreSQL the
    expression itself (no round trip to read it first), on SQLite (embedded, the same
    clock) this host's time."""
    return utcnow() if session.get_bind().dialect.name == "postgresql" else now()


def _claimable(at: Any) -> Any:
    return or_(
        and_(Signal.status.in_(READY_STATUSES), Signal.available_at <= at),
        and_(Signal.status == "processing", Signal.claimed_until < at),
    )


def claim_signals(
    session: Session,
    *,
    lease_seconds: int,
    limit: int,
    signal_id: int | None = None,
    after_id: int | None = None,
    max_attempts: int | None = None,
    with_payload: bool = False,
    also_kinds: Sequence[str] = (),
    bury_own: bool = False,
    buried_rows: list[tuple[int, str]] | None = None,
    token: str | None = None,
) -> list[Claimed]:
    """Move up to ``limit`` claimable signals to ``processing`` under a new lease
    (``token``: the claim's token, a new one by default; see :func:`unclaim`).

    Claimable: ``pending``/``failed`` whose ``available_at`` has passed, or
    ``processing`` whose lease expired (a worker died). Each claim adds one attempt
    and sets a fresh ``claim_token``; on PostgreSQL ``FOR UPDATE SKIP LOCKED`` lets
    concurrent workers claim disjoint rows. With ``max_attempts``, rows already out
    of attempts are left for :func:`bury_exhausted`; with ``after_id`` only rows with
    a larger id are claimed (one pass visits each signal once). With ``with_payload``
    each claim carries its payload as JSON text, read in the same statement. With
    ``signal_id`` and ``also_kinds``, that signal is claimed first if it can be and the
    rest of ``limit`` is filled with the oldest claimable signals of those kinds.
    With ``bury_own`` (and ``signal_id`` and ``max_attempts``), that signal is also
    buried as :func:`bury_exhausted` would, in the same statement on PostgreSQL; each
    row buried is appended to ``buried_rows``.
    """
    if buried_rows is None:
        buried_rows = []
    if bury_own and session.get_bind().dialect.name != "postgresql":
        claimed = claim_signals(
            session,
            lease_seconds=lease_seconds,
            limit=limit,
            signal_id=signal_id,
            after_id=after_id,
            max_attempts=max_attempts,
            with_payload=with_payload,
            also_kinds=also_kinds,
            token=token,
        )
        if signal_id is not None and max_attempts is not None:
            buried_rows.extend(bury_exhausted(session, max_attempts=max_attempts, signal_id=signal_id))
        return claimed
    at = _clock(session)
    token = token or new_claim_token()
    postgres = session.get_bind().dialect.name == "postgresql"
    wakeup = bury_own and with_payload and signal_id is not None and max_attempts is not None and after_id is None
    if postgres and wakeup and also_kinds and PREBUILT_WAKEUP_CLAIM:
        assert signal_id is not None and max_attempts is not None
        return _pg_wakeup_claim(
            session,
            signal_id=signal_id,
            kinds=also_kinds,
            limit=limit,
            max_attempts=max_attempts,
            lease_seconds=lease_seconds,
            token=token,
            buried_rows=buried_rows,
        )
    if signal_id is not None and also_kinds and after_id is None:
        ready_ids: Any = _own_and_fill(at, signal_id, also_kinds, limit, max_attempts=max_attempts, lock=postgres)
    else:
        ready_ids = _in_id_order(
            at, limit, signal_id=signal_id, after_id=after_id, max_attempts=max_attempts, lock=postgres
        )
    returned: list[Any] = [Signal.id, Signal.kind, Signal.user_id, Signal.agent_id, Signal.attempts, Signal.enqueued_at]
    if with_payload:
        returned.append(cast(Signal.payload, Text).label("payload_text"))
    statement = (
        update(Signal)
        # Re-checked on the locked row: another worker may have claimed it meanwhile.
        .where(Signal.id.in_(ready_ids), _claimable(at))
        .values(
            status="processing",
            attempts=Signal.attempts + 1,
            claim_token=token,
            claimed_until=at + timedelta(seconds=lease_seconds),
        )
        .returning(*returned)
        .execution_options(synchronize_session=False)
    )
    if bury_own and signal_id is not None and max_attempts is not None:
        rows = _claim_and_bury(session, statement, _bury_statement(at, max_attempts, signal_id), buried_rows)
    else:
        rows = list(session.execute(statement).all())
    return _claims(rows, token, with_payload=with_payload)


def new_claim_token() -> str:
    """A claim's token: never used twice."""
    return str(uuid.uuid4())


def unclaim(session: Session, token: str) -> int:
    """Give back the claims made under ``token`` that still hold (``processing``):
    pending again, available at once, the attempt the claim added taken back; for the
    caller that does not know whether its claim committed (its reply was lost), so
    nothing was done with them. Returns the signals given back."""
    result = session.execute(
        update(Signal)
        .where(Signal.claim_token == token, Signal.status == "processing")
        .values(
            status="pending",
            attempts=case((Signal.attempts > 0, Signal.attempts - 1), else_=0),
            claim_token=None,
            claimed_until=None,
            available_at=_clock(session),
        )
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def _claims(rows: Sequence[Any], token: str, *, with_payload: bool) -> list[Claimed]:
    claimed = [
        Claimed(
            r.id,
            r.kind,
            r.user_id,
            r.agent_id,
            r.attempts,
            token,
            r.enqueued_at,
            payload_text=None if not with_payload or r.payload_text is None else str(r.payload_text),
            has_payload=with_payload,
        )
        for r in rows
    ]
    return sorted(claimed, key=lambda c: c.signal_id)


#: Whether a wake-up's claim on PostgreSQL runs the statement written out below (False:
#: the one built from the same parts as every other claim; the tests compare the two).
PREBUILT_WAKEUP_CLAIM = True
BURIED_ERROR = "lease expired after the last attempt (the worker stopped while processing)"

# What :func:`claim_signals` builds for a wake-up (``_own_and_fill`` and ``_claim_and_bury``),
# written out: building and compiling that statement cost a wake-up several times what
# running it does. ``tests/test_signal_claims.py`` holds the two to the same result.
_PG_WAKEUP_CLAIM = text(
    """
WITH own AS (
    SELECT s.id FROM dream_signals s
    WHERE s.id = :signal_id AND s.attempts < :max_attempts
      AND ((s.status IN ('pending', 'failed') AND s.available_at <= {now})
           OR (s.status = 'processing' AND s.claimed_until < {now}))
    FOR UPDATE OF s SKIP LOCKED
),
fill AS (
    SELECT s.id FROM dream_signals s
    WHERE s.status IN ('pending', 'failed') AND s.available_at <= {now}
      AND s.kind = ANY(CAST(:kinds AS varchar[])) AND s.id <> :signal_id AND s.attempts < :max_attempts
      AND NOT EXISTS (
          SELECT 1 FROM dream_signals suspect
          WHERE suspect.id = :signal_id AND suspect.status = 'processing' AND suspect.claimed_until < {now}
      )
    ORDER BY s.available_at
    LIMIT :fill
    FOR UPDATE OF s SKIP LOCKED
),
claimed AS (
    UPDATE dream_signals s
    SET status = 'processing', attempts = s.attempts + 1, claim_token = :token,
        claimed_until = {now} + make_interval(secs => :lease)
    WHERE s.id IN (SELECT id FROM own UNION ALL SELECT id FROM fill)
      AND ((s.status IN ('pending', 'failed') AND s.available_at <= {now})
           OR (s.status = 'processing' AND s.claimed_until < {now}))
    RETURNING s.id, s.kind, s.user_id, s.agent_id, s.attempts, s.enqueued_at, CAST(s.payload AS text) AS payload_text
),
buried AS (
    UPDATE dream_signals s
    SET status = 'dead', claim_token = NULL, claimed_until = NULL, last_error = :buried_error
    WHERE s.id = :signal_id AND s.status = 'processing' AND s.claimed_until < {now}
      AND s.attempts >= :max_attempts
    RETURNING s.id, s.kind
)
SELECT false AS buried, id, kind, user_id, agent_id, attempts, enqueued_at, payload_text FROM claimed
UNION ALL
SELECT true, id, kind, NULL, NULL, NULL, NULL, NULL FROM buried
""".replace("{now}", "timezone('utc', statement_timestamp())")  # the clock of utcnow(), inline for the index
)


def _pg_wakeup_claim(
    session: Session,
    *,
    signal_id: int,
    kinds: Sequence[str],
    limit: int,
    max_attempts: int,
    lease_seconds: int,
    token: str,
    buried_rows: list[tuple[int, str]],
) -> list[Claimed]:
    params = {
        "signal_id": signal_id,
        "kinds": list(kinds),
        "fill": max(limit - 1, 0),
        "max_attempts": max_attempts,
        "token": token,
        "lease": lease_seconds,
        "buried_error": BURIED_ERROR,
    }
    rows = session.execute(_PG_WAKEUP_CLAIM, params).all()
    buried_rows.extend((r.id, r.kind) for r in rows if r.buried)
    return _claims([r for r in rows if not r.buried], token, with_payload=True)


def _in_id_order(
    at: Any, limit: int, *, signal_id: int | None, after_id: int | None, max_attempts: int | None, lock: bool
) -> Any:
    """The ids of up to ``limit`` claimable signals in id order (only ``signal_id``, if given)."""
    candidates = select(Signal.id).where(_claimable(at)).limit(limit)
    candidates = candidates.where(Signal.id == signal_id) if signal_id is not None else candidates.order_by(Signal.id)
    if after_id is not None:
        candidates = candidates.where(Signal.id > after_id)
    if max_attempts is not None:
        candidates = candidates.where(Signal.attempts < max_attempts)
    if lock:
        candidates = candidates.with_for_update(skip_locked=True)
    # A CTE, not a subquery: a subquery on the same table would be correlated with the
    # UPDATE's rows and its LIMIT and SKIP LOCKED would apply per row.
    ready = candidates.cte("ready")
    return select(ready.c.id)


def _own_and_fill(
    at: Any, signal_id: int, kinds: Sequence[str], limit: int, *, max_attempts: int | None, lock: bool
) -> Any:
    """The ids a wake-up claims: its own signal if it is claimable, and up to ``limit - 1``
    ready signals of ``kinds``, those available longest first.

    Two lookups, each reading about the rows it returns whatever the backlog: the own
    signal by its key, the rest in order of the ready signals' partial index on
    ``available_at`` (a single ordering over all candidates, own first, would read and
    sort every ready signal on each wake-up).
    """
    own = select(Signal.id).where(Signal.id == signal_id, _claimable(at))
    # A signal whose lease expired was in flight when its worker died, and may be what
    # killed it: it is claimed only by its own wake-up, and then alone. Batched with
    # others, one crash would cost every signal of the batch an attempt each time,
    # until all of them were dead.
    suspect = aliased(Signal)
    own_is_suspect = exists().where(suspect.id == signal_id, suspect.status == "processing", suspect.claimed_until < at)
    fill = (
        select(Signal.id)
        .where(
            Signal.status.in_(READY_STATUSES),
            Signal.available_at <= at,
            Signal.kind.in_(kinds),
            Signal.id != signal_id,
            ~own_is_suspect,
        )
        .order_by(Signal.available_at)
        .limit(max(limit - 1, 0))
    )
    if max_attempts is not None:
        own = own.where(Signal.attempts < max_attempts)
        fill = fill.where(Signal.attempts < max_attempts)
    if lock:
        own = own.with_for_update(skip_locked=True)
        fill = fill.with_for_update(skip_locked=True)
    # CTEs, not subqueries: a subquery on the same table would be correlated with the
    # UPDATE's rows, and its LIMIT and SKIP LOCKED would apply per row.
    own_ids, fill_ids = own.cte("own"), fill.cte("fill")
    return union_all(select(own_ids.c.id), select(fill_ids.c.id))


def _claim_and_bury(session: Session, claim: Any, bury: Any, buried_rows: list[tuple[int, str]]) -> list[Any]:
    """Run a claim and a burial as one statement; the claimed rows (the buried ones go
    to ``buried_rows``). The claim takes only rows with attempts left and the burial
    only rows without, so the two never touch the same row."""
    claimed = claim.cte("claimed")
    buried = bury.cte("buried")
    names = [column.name for column in claimed.c]
    both = union_all(
        select(literal(False).label("buried"), *claimed.c),
        select(literal(True), buried.c.id, buried.c.kind, *(null() for _ in names[2:])),
    )
    rows = session.execute(both).all()
    buried_rows.extend((r.id, r.kind) for r in rows if r.buried)
    return [r for r in rows if not r.buried]


def bury_exhausted(session: Session, *, max_attempts: int, signal_id: int | None = None) -> list[tuple[int, str]]:
    """Mark ``dead`` the signals whose lease expired after their last attempt (only
    ``signal_id``, if given).

    Returns (id, kind) of each row buried, for the metrics.
    """
    statement = _bury_statement(_clock(session), max_attempts, signal_id)
    return [(r.id, r.kind) for r in session.execute(statement)]


def _bury_statement(at: Any, max_attempts: int, signal_id: int | None) -> Any:
    statement = (
        update(Signal)
        .where(Signal.status == "processing", Signal.claimed_until < at, Signal.attempts >= max_attempts)
        .values(
            status="dead",
            claim_token=None,
            claimed_until=None,
            last_error=BURIED_ERROR,
        )
        .returning(Signal.id, Signal.kind)
        .execution_options(synchronize_session=False)
    )
    if signal_id is not None:
        statement = statement.where(Signal.id == signal_id)
    return statement


def load_payload_text(session: Session, signal_id: int) -> tuple[bool, str | None]:
    """(row exists, the payload as JSON text), the payload never parsed by the driver.

    A foreign producer may store JSON nested deeply enough to exhaust the driver's
    recursive parser; the caller parses the text under its own guard.
    """
    row = session.execute(select(Signal.id, cast(Signal.payload, Text)).where(Signal.id == signal_id)).first()
    if row is None:
        return False, None
    return True, None if row[1] is None else str(row[1])


def lock_claimed(session: Session, signal_id: int, claim_token: str) -> bool:
    """Lock the signal row for this transaction if our claim still holds.

    False when the row is gone (``erase-user`` removed it) or another worker took it
    over after our lease expired: the caller must then write nothing.
    """
    statement = (
        select(Signal.id)
        .where(Signal.id == signal_id, Signal.claim_token == claim_token, Signal.status == "processing")
        .with_for_update()
    )
    return session.scalar(statement) is not None


def finish_signal(
    session: Session,
    signal_id: int,
    claim_token: str,
    *,
    status: str,
    error: str | None = None,
    available_at: datetime | None = None,
    refund_attempt: bool = False,
    retry_after: timedelta | None = None,
) -> datetime | None:
    """Record an outcome if our claim still holds; returns the time recorded, or None.

    ``done`` sets ``processed_at``; ``failed`` makes the signal claimable again at
    ``available_at``, or ``retry_after`` from now on the database's clock (which claims
    compare it with); ``refund_attempt`` gives back the attempt the claim took.
    """
    at = db_now(session)
    if retry_after is not None:
        available_at = at + retry_after
    values: dict[str, Any] = {"status": status, "last_error": error, "claim_token": None, "claimed_until": None}
    if status in ("done", "rejected"):
        values["processed_at"] = at
    if available_at is not None:
        values["available_at"] = available_at
    if refund_attempt:
        values["attempts"] = Signal.attempts - 1
    statement = (
        update(Signal)
        .where(Signal.id == signal_id, Signal.claim_token == claim_token, Signal.status == "processing")
        .values(**values)
        .returning(Signal.id)
        .execution_options(synchronize_session=False)
    )
    return at if session.execute(statement).first() is not None else None


def finish_signals(session: Session, claims: Sequence[tuple[int, str]], *, status: str) -> tuple[set[int], datetime]:
    """:func:`finish_signal` for many (id, claim token) pairs in one statement, ``done``
    or ``rejected``; returns the ids whose claim still held, and the time recorded."""
    assert status in ("done", "rejected")
    if session.get_bind().dialect.name == "postgresql":
        ids, tokens = [claim[0] for claim in claims], [claim[1] for claim in claims]
        rows = session.execute(_PG_FINISH, {"status": status, "ids": ids, "tokens": tokens}).all()
    else:
        rows = _finish_portable(session, claims, status)
    # Every row of one statement has the same time; with none, nothing was recorded.
    return {row.id for row in rows}, rows[0].processed_at if rows else db_now(session)


# finish_signals on PostgreSQL: the pairs as two arrays (one bound value each, where
# the portable statement binds two per signal and is built and compiled per batch).
# The rows are locked in id order first, as an erasure locks a user's signals: an
# update's own order is its plan's (an index on status and kind puts one kind first).
_PG_FINISH = text(
    """
WITH held AS (
    SELECT s.id FROM dream_signals s
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:tokens AS varchar[])) AS claim(id, token)
        ON s.id = claim.id AND s.claim_token = claim.token
    WHERE s.status = 'processing'
    ORDER BY s.id
    FOR UPDATE OF s
)
UPDATE dream_signals s
SET status = :status, last_error = NULL, claim_token = NULL, claimed_until = NULL,
    processed_at = timezone('utc', statement_timestamp())
FROM held
WHERE s.id = held.id
RETURNING s.id, s.processed_at
"""
)


def _finish_portable(session: Session, claims: Sequence[tuple[int, str]], status: str) -> list[Any]:
    statement = (
        update(Signal)
        .where(
            tuple_(Signal.id, Signal.claim_token).in_([tuple(claim) for claim in claims]),
            Signal.status == "processing",
        )
        .values(status=status, last_error=None, claim_token=None, claimed_until=None, processed_at=_clock(session))
        .returning(Signal.id, Signal.processed_at)
        .execution_options(synchronize_session=False)
    )
    return list(session.execute(statement).all())


def pending_counts(session: Session) -> dict[str, int]:
    """Signals waiting (``pending`` or ``failed``), by kind."""
    rows = session.execute(
        select(Signal.kind, func.count()).where(Signal.status.in_(READY_STATUSES)).group_by(Signal.kind)
    )
    return {kind: count for kind, count in rows}
