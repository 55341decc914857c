"""Queries on ``dream_runs``: the ledger of dream runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import String, cast, func, insert, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import ScalarSelect

from store.models import ArchivedEntry, Run, Spend, UserState
from store.types import db_now


@dataclass(frozen=True)
class RunCounts:
    entries_pruned: int = 0
    contradictions_found: int = 0
    contradictions_resolved: int = 0
    entries_summarized: int = 0
    entries_written: int = 0
    groups_deferred: int = 0


#: What a ledger row says when a later run closed it for a run that never did.
ABANDONED = "the run stopped before it closed its ledger row (its worker ended); the next run of this user closed it"


#: What a ledger row says when a pass closed it after its user's lease lapsed.
LAPSED = (
    "the run stopped before it closed its ledger row (its worker ended, and its lease lapsed); "
    "a later pass closed it, with what the archive and the budget recorded of it"
)


def close_abandoned(session: Session, user_ids: Sequence[str]) -> int:
    """Close, as failed, the ``running`` ledger rows of ``user_ids``; for the caller that
    has just taken their leases, so no run of theirs is under way: such a row was left
    by a worker that stopped (killed, out of memory) before closing it. A run that only
    lost its lease and still lives closes its own row again later, when it ends."""
    if not user_ids:
        return 0
    result = session.execute(
        update(Run)
        .where(Run.user_id.in_(sorted(user_ids)), Run.status == "running")
        .values(_recorded(session, ABANDONED))
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def close_lapsed(session: Session) -> int:
    """Close, as failed, the ``running`` ledger rows whose user's lease has lapsed or was
    given back: no live run holds them (a run renews its lease while it works), so their
    worker stopped (killed, out of memory) before closing them. Found by every sweep and
    ``reverie run``, not only by that user's next run a day later. A run that only lost
    its lease and still lives closes its own row again later, with its own counts."""
    at = db_now(session)
    held = select(UserState.user_id).where(
        UserState.user_id == Run.user_id, UserState.locked_until.is_not(None), UserState.locked_until >= at
    )
    result = session.execute(
        update(Run)
        .where(Run.status == "running", ~held.exists())
        .values(_recorded(session, LAPSED))
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def _recorded(session: Session, error: str) -> dict[str, Any]:
    """A closed row's values: failed, with what the run left on record (its rows archived
    as pruned, summarized or resolved, and its spend), which a worker that died never wrote."""

    def archived(reason: str) -> ScalarSelect[Any]:
        return (
            select(func.count())
            .where(
                ArchivedEntry.user_id == Run.user_id,
                ArchivedEntry.run_id == Run.id,
                ArchivedEntry.reason == reason,
            )
            .scalar_subquery()
        )

    # A reservation still open counts in full: its process died in the call, and the
    # reaper settles it as spent once the call's deadline passes.
    spent = (
        select(Spend.spent_nano + Spend.reserved_nano)
        .where(Spend.scope == "run", Spend.scope_key == cast(Run.id, String))
        .scalar_subquery()
    )
    return {
        "status": "failed",
        "finished_at": db_now(session),
        "error": error,
        "entries_pruned": archived("prune"),
        "entries_summarized": archived("summarize"),
        "cost_nano": func.coalesce(spent, 0),
    }


#: What a ledger row says when the transaction that opened it lost its reply.
LOST_AT_START = "the database went away as the run began"


def close_leased_under(session: Session, user_ids: Sequence[str], token: str) -> int:
    """Close, as failed, the ``running`` ledger rows of those of ``user_ids`` whose lease
    is held under ``token``: the runs a transaction taking those leases opened, for the
    caller that does not know whether it committed (its reply was lost). A token is
    never used twice, so where nothing committed, nothing matches."""
    if not user_ids:
        return 0
    leased = select(UserState.user_id).where(UserState.user_id.in_(sorted(user_ids)), UserState.lock_token == token)
    result = session.execute(
        update(Run)
        .where(Run.user_id.in_(leased), Run.status == "running")
        .values(status="failed", finished_at=db_now(session), error=LOST_AT_START)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def start_run(session: Session, user_id: str, *, scope: str = "user", trigger: str = "manual") -> int:
    """A new ``running`` ledger row; returns its id."""
    run_id = session.execute(
        insert(Run)
        .values(user_id=user_id, scope=scope, trigger=trigger, status="running", started_at=db_now(session))
        .returning(Run.id)
    ).scalar_one()
    return int(run_id)


def finish_run(
    session: Session,
    run_id: int,
    *,
    status: str,
    counts: RunCounts,
    cost_nano: int,
    error: str | None = None,
    finished_at: datetime | None = None,
) -> None:
    """Close a ledger row with its outcome (ended now, unless ``finished_at`` says when)."""
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(
            status=status,
            finished_at=finished_at or db_now(session),
            entries_pruned=counts.entries_pruned,
            contradictions_found=counts.contradictions_found,
            contradictions_resolved=counts.contradictions_resolved,
            entries_summarized=counts.entries_summarized,
            entries_written=counts.entries_written,
            groups_deferred=counts.groups_deferred,
            cost_nano=cost_nano,
            error=error[:2000] if error else None,
        )
    )


def get_run(session: Session, run_id: int) -> Run | None:
    return session.get(Run, run_id)


def runs_of(session: Session, user_id: str) -> list[Run]:
    return list(session.scalars(select(Run).where(Run.user_id == user_id).order_by(Run.id)))


_PG_START = text(
    """
INSERT INTO dream_runs (user_id, scope, trigger, status, started_at)
SELECT u, :scope, :trigger, 'running', :at FROM unnest(CAST(:ids AS varchar[])) WITH ORDINALITY AS v(u, n)
ORDER BY n
RETURNING user_id, id
"""
)


def start_runs(
    session: Session, user_ids: Sequence[str], *, scope: str = "user", trigger: str = "manual"
) -> dict[str, int]:
    """One new ``running`` ledger row per user (one statement); returns user id -> run id."""
    if not user_ids:
        return {}
    at = db_now(session)
    if session.get_bind().dialect.name == "postgresql":
        params = {"ids": list(user_ids), "scope": scope, "trigger": trigger, "at": at}
        return {row.user_id: int(row.id) for row in session.execute(_PG_START, params)}
    rows = session.execute(
        insert(Run).returning(Run.user_id, Run.id),
        [
            {"user_id": uid, "scope": scope, "trigger": trigger, "status": "running", "started_at": at}
            for uid in user_ids
        ],
    )
    return {row.user_id: int(row.id) for row in rows}


@dataclass(frozen=True)
class Finished:
    """One run's outcome for :func:`finish_runs`."""

    run_id: int
    status: str
    counts: RunCounts
    cost_nano: int = 0
    error: str | None = None


_PG_FINISH = text(
    """
UPDATE dream_runs AS r SET
    status = v.status, finished_at = :at, entries_pruned = v.pruned, contradictions_found = v.found,
    contradictions_resolved = v.resolved, entries_summarized = v.summarized, entries_written = v.written,
    groups_deferred = v.deferred, cost_nano = v.cost, error = v.error
FROM unnest(CAST(:ids AS bigint[]), CAST(:statuses AS varchar[]), CAST(:pruned AS int[]), CAST(:found AS int[]),
            CAST(:resolved AS int[]), CAST(:summarized AS int[]), CAST(:written AS int[]), CAST(:deferred AS int[]),
            CAST(:costs AS bigint[]), CAST(:errors AS text[]))
     AS v(id, status, pruned, found, resolved, summarized, written, deferred, cost, error)
WHERE r.id = v.id
"""
)


def finish_runs(session: Session, finished: Sequence[Finished]) -> None:
    """Close many ledger rows with their outcomes (one statement on PostgreSQL)."""
    if not finished:
        return
    if session.get_bind().dialect.name != "postgresql":
        for f in finished:
            finish_run(session, f.run_id, status=f.status, counts=f.counts, cost_nano=f.cost_nano, error=f.error)
        return
    session.execute(
        _PG_FINISH,
        {
            "at": db_now(session),
            "ids": [f.run_id for f in finished],
            "statuses": [f.status for f in finished],
            "pruned": [f.counts.entries_pruned for f in finished],
            "found": [f.counts.contradictions_found for f in finished],
            "resolved": [f.counts.contradictions_resolved for f in finished],
            "summarized": [f.counts.entries_summarized for f in finished],
            "written": [f.counts.entries_written for f in finished],
            "deferred": [f.counts.groups_deferred for f in finished],
            "costs": [f.cost_nano for f in finished],
            "errors": [f.error[:2000] if f.error else None for f in finished],
        },
    )
