"""Queries that purge what has outlived its retention, one bounded batch at a time.

Each function removes (or empties) at most ``limit`` rows older than ``cutoff``, found
through an index on the age column, and returns how many it touched: the caller
repeats until a batch comes back short, one transaction per batch, so the cost follows
the number of expired rows and no lock is held for long.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, exists, select, text, tuple_, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable

from store.models import FINISHED_WITH_PAYLOAD, ArchivedEntry, Event, Run, Signal, Spend

#: What an emptied payload becomes: still a JSON object, as the column promises.
PURGED_PAYLOAD: dict[str, object] = {}


def purge_archive(session: Session, *, cutoff: datetime, limit: int) -> int:
    """Archive rows archived before ``cutoff``: past them, a removal cannot be undone."""
    doomed = (
        select(ArchivedEntry.id)
        .where(ArchivedEntry.archived_at < cutoff)
        .order_by(ArchivedEntry.archived_at)
        .limit(limit)
    )
    return _count(session, delete(ArchivedEntry).where(ArchivedEntry.id.in_(doomed)).returning(ArchivedEntry.id))


def purge_signal_payloads(session: Session, *, cutoff: datetime, limit: int, at: datetime) -> int:
    """Empty the payloads (transcripts, edits, events) of signals finished before ``cutoff``.

    The row stays, idempotency key and status included, so a duplicate of a purged
    signal still takes no effect. Dead signals keep their payload for ``signals retry``.
    """
    doomed = (
        select(Signal.id)
        # The partial index's own predicate, as literal SQL, so the planner can use it.
        .where(text(FINISHED_WITH_PAYLOAD), Signal.processed_at < cutoff)
        .order_by(Signal.processed_at)
        .limit(limit)
    )
    statement = (
        update(Signal)
        .where(Signal.id.in_(doomed))
        .values(payload=PURGED_PAYLOAD, payload_purged_at=at)
        .returning(Signal.id)
        .execution_options(synchronize_session=False)
    )
    return _count(session, statement)


def purge_events(session: Session, *, cutoff: datetime, limit: int) -> int:
    doomed = select(Event.id).where(Event.at < cutoff).order_by(Event.at).limit(limit)
    return _count(session, delete(Event).where(Event.id.in_(doomed)).returning(Event.id))


def purge_runs(session: Session, *, cutoff: datetime, limit: int) -> int:
    """Finished ledger rows started before ``cutoff`` whose archive rows are all gone.

    A run's archive rows are what ``restore --run`` puts back: the run is kept as long
    as any of them is (deleting it would take them along).
    """
    archived = exists().where(ArchivedEntry.run_id == Run.id)
    doomed = (
        select(Run.id)
        .where(Run.started_at < cutoff, Run.status != "running", ~archived)
        .order_by(Run.started_at)
        .limit(limit)
    )
    return _count(session, delete(Run).where(Run.id.in_(doomed)).returning(Run.id))


def purge_spend(session: Session, *, cutoff: datetime, cutoff_day: str, limit: int) -> int:
    """Budget lines last touched before ``cutoff``; a day line only for a day before
    ``cutoff_day``, so the line of a day still being spent is never reset."""
    doomed = session.execute(
        select(Spend.scope, Spend.scope_key)
        .where(Spend.updated_at < cutoff, (Spend.scope == "run") | (Spend.scope_key < cutoff_day))
        .order_by(Spend.updated_at)
        .limit(limit)
    ).all()
    if not doomed:
        return 0
    keys = [(row.scope, row.scope_key) for row in doomed]
    return _count(session, delete(Spend).where(tuple_(Spend.scope, Spend.scope_key).in_(keys)).returning(Spend.scope))


def _count(session: Session, statement: Executable) -> int:
    return len(session.execute(statement).all())
