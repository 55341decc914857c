"""Right to erasure: every row about one user, in the memory table and every ``dream_`` table.

The one removal from the memory table that is not archived: keeping a copy is what an
erasure must not do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sqlalchemy import Table, delete, func, select
from sqlalchemy.orm import Session

from store import activity as activity_store
from store import key_vectors
from store.memories import table_for
from store.models import ArchivedEntry, Base, Event, KeyVector, Observation, Run, Signal, Spend
from store.spend import delete_user_lines
from worker.settings import Settings


def erase_user(
    session: Session,
    settings: Settings,
    user_id: str,
    *,
    hold: Callable[[Session], None] = lambda session: None,
    key_forms: Callable[[str], Iterable[str]] | None = None,
) -> dict[str, int]:
    """Delete every row about ``user_id``; rows deleted per table. ``hold`` runs just
    before the schedule row goes (it may raise to roll everything back: the erasure's
    lease was lost meanwhile). ``key_forms``: the forms a key's vectors may be kept under
    (the key matcher's); the vectors kept in ``dream_key_vectors`` for every key the user's rows
    hold or held (the memory table, the archive, Reverie's events, observations) are
    deleted too: they hold no user id, but a key can name a person.

    Signals go first: deleting them waits for any worker that holds one locked while
    applying it, so its writes are committed and then erased here, and a worker that
    comes later finds its signal gone and writes nothing. Signals enqueued after this
    transaction commits are processed normally.
    """
    counts: dict[str, int] = {}
    # A signal's own budget line is keyed by its id: the user's too. Locked in id order,
    # as a batch of signals being finished locks them (store.signals.finish_signals).
    held = select(Signal.id).where(Signal.user_id == user_id).order_by(Signal.id).with_for_update()
    signal_ids = list(session.scalars(held))
    signal_keys = [str(i) for i in signal_ids]
    # Those rows only: a signal committed while the lock waited is after the erasure
    # (processed as usual, with its budget line).
    counts[Signal.__tablename__] = _delete_signals(session, signal_ids)
    # Routine detection writes memories from activity rows it read earlier: this waits
    # for a detection writing this user's (its writes committed, then erased below) and
    # holds off the next until this commits (it then finds the events it read gone).
    # Only this user's: producers' inserts of activity do not wait. Taken after the
    # signals, whose row locks an activity signal's apply holds before it inserts.
    activity_store.lock_for_erasure(session, user_id)
    memory = table_for(settings)
    held_keys = _keys_of(session, memory, user_id) if key_forms is not None else set()
    counts[memory.name] = _delete(session, memory, user_id)
    run_ids = {str(i) for i in session.scalars(select(Run.id).where(Run.user_id == user_id))}
    if run_ids:
        # A run's budget lines are keyed "<run id>" or "<run id>/<agent hash>": the user's.
        keys = [
            key
            for key in session.scalars(select(Spend.scope_key).where(Spend.scope == "run"))
            if key.split("/", 1)[0] in run_ids
        ]
        _delete_lines(session, "run", keys, counts)
    lines = delete_user_lines(session, user_id)
    if lines:
        counts[Spend.__tablename__] = counts.get(Spend.__tablename__, 0) + lines
    # Budget lines go in the order a call locks them (run, user's day, signal; see
    # worker.budget.lines_for): a call settling meanwhile then waits, never deadlocks.
    _delete_lines(session, "signal", signal_keys, counts)
    hold(session)
    # Children before parents (the archive refers to runs).
    for table in reversed(Base.metadata.sorted_tables):
        if table.name != Signal.__tablename__ and "user_id" in table.c:
            counts[table.name] = _delete(session, table, user_id)
    if key_forms is not None:
        counts[KeyVector.__tablename__] = key_vectors.forget(
            session, {form for key in held_keys for form in key_forms(key)}
        )
    return counts


def _keys_of(session: Session, memory: Table, user_id: str) -> set[str]:
    """Every key the user's rows hold or held: the memory table's, the archive's, those of
    Reverie's events and of observations (before they are deleted)."""
    archived = ArchivedEntry.row["key"].as_string()
    statements = [
        select(memory.c.key).where(memory.c.user_id == user_id),
        select(archived).where(ArchivedEntry.user_id == user_id),
        select(Event.key).where(Event.user_id == user_id),
        select(Observation.key).where(Observation.user_id == user_id),
    ]
    return {key for statement in statements for key in session.scalars(statement.distinct()) if isinstance(key, str)}


def _delete_signals(session: Session, ids: list[int]) -> int:
    deleted = 0
    for start in range(0, len(ids), 1000):
        result = session.execute(delete(Signal).where(Signal.id.in_(ids[start : start + 1000])))
        deleted += int(getattr(result, "rowcount", 0) or 0)
    return deleted


def _delete(session: Session, table: Table, user_id: str) -> int:
    result = session.execute(delete(table).where(table.c.user_id == user_id))
    return int(getattr(result, "rowcount", 0) or 0)


def rows_about(session: Session, settings: Settings, user_id: str) -> dict[str, int]:
    """Rows still naming ``user_id``, per table (all zero after an erasure)."""
    tables = [table_for(settings), *(t for t in Base.metadata.sorted_tables if "user_id" in t.c)]
    return {
        table.name: int(session.scalar(select(func.count()).select_from(table).where(table.c.user_id == user_id)) or 0)
        for table in tables
    }


def _delete_lines(session: Session, scope: str, keys: list[str], counts: dict[str, int]) -> None:
    """Delete these budget lines of ``scope``, in batches, counted under ``dream_spend``.
    Locked first in the keys' order, whatever order a plan would delete them in: a run's
    total (``<run id>``) before its agents' shares (``<run id>/...``), as a call's
    settlement and the reaper take them."""
    keys = sorted(keys)
    for start in range(0, len(keys), 500):
        batch = keys[start : start + 500]
        session.execute(
            select(Spend.scope_key)
            .where(Spend.scope == scope, Spend.scope_key.in_(batch))
            .order_by(Spend.scope_key)
            .with_for_update()
        ).all()
        result = session.execute(delete(Spend).where(Spend.scope == scope, Spend.scope_key.in_(batch)))
        counts[Spend.__tablename__] = counts.get(Spend.__tablename__, 0) + int(getattr(result, "rowcount", 0) or 0)
