"""Queries on ``dream_runs``: the ledger of dream runs."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from store.models import Run
from store.types import now


@dataclass(frozen=True)
class RunCounts:
    entries_pruned: int = 0
    contradictions_found: int = 0
    contradictions_resolved: int = 0
    entries_summarized: int = 0
    entries_written: int = 0
    groups_deferred: int = 0


def start_run(session: Session, user_id: str, *, scope: str = "user", trigger: str = "manual") -> int:
    """A new ``running`` ledger row; returns its id."""
    run_id = session.execute(
        insert(Run)
        .values(user_id=user_id, scope=scope, trigger=trigger, status="running", started_at=now())
        .returning(Run.id)
    ).scalar_one()
    return int(run_id)


def finish_run(
    session: Session, run_id: int, *, status: str, counts: RunCounts, cost_nano: int, error: str | None = None
) -> None:
    """Close a ledger row with its outcome."""
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(
            status=status,
            finished_at=now(),
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
