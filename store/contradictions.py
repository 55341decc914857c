"""Queries on ``dream_contradictions``: one open row per user and normalised key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from store.models import Contradiction


def open_by_key(session: Session, user_id: str) -> dict[str, Contradiction]:
    """The user's open contradictions, keyed by normalised key."""
    rows = session.scalars(
        select(Contradiction).where(Contradiction.user_id == user_id, Contradiction.status == "open")
    )
    return {row.norm_key: row for row in rows}


def record(
    session: Session,
    *,
    user_id: str,
    norm_key: str,
    entry_ids: list[str],
    fingerprint: str,
    run_id: int | None,
    resolution: str,
    at: datetime,
    closed: bool = False,
) -> None:
    """A newly found contradiction (``closed``: resolved on the spot)."""
    session.execute(
        insert(Contradiction).values(
            user_id=user_id,
            norm_key=norm_key[:255],
            entry_ids=entry_ids,
            fingerprint=fingerprint,
            status="closed" if closed else "open",
            resolution=resolution,
            found_run_id=run_id,
            found_at=at,
            closed_at=at if closed else None,
        )
    )


def refresh(session: Session, contradiction_id: int, entry_ids: list[str], fingerprint: str) -> None:
    """Keep an open contradiction's rows current without counting it again."""
    session.execute(
        update(Contradiction)
        .where(Contradiction.id == contradiction_id)
        .values(entry_ids=entry_ids, fingerprint=fingerprint)
    )


def close(session: Session, contradiction_ids: list[int], at: datetime, *, resolution: str | None = None) -> None:
    """Close open contradictions; ``resolution``: how, where it is not how they were
    found (one flagged before, resolved by ``keep_newest`` since)."""
    if contradiction_ids:
        values: dict[str, Any] = {"status": "closed", "closed_at": at}
        if resolution is not None:
            values["resolution"] = resolution
        session.execute(
            update(Contradiction)
            .where(Contradiction.id.in_(contradiction_ids), Contradiction.status == "open")
            .values(**values)
        )


def entry_ids_of(row: Contradiction) -> list[str]:
    ids: Any = row.entry_ids
    return [str(i) for i in ids] if isinstance(ids, list) else []


def open_by_user(session: Session, user_ids: Sequence[str]) -> dict[str, dict[str, Contradiction]]:
    """:func:`open_by_key` for several users (one query): user id -> normalised key -> row."""
    out: dict[str, dict[str, Contradiction]] = {uid: {} for uid in user_ids}
    if user_ids:
        rows = session.scalars(
            select(Contradiction).where(Contradiction.user_id.in_(sorted(user_ids)), Contradiction.status == "open")
        )
        for row in rows:
            out.setdefault(row.user_id, {})[row.norm_key] = row
    return out


def record_many(session: Session, found: Sequence[Mapping[str, Any]]) -> None:
    """Several newly found contradictions (each as :func:`record`'s keyword arguments), one statement."""
    if not found:
        return
    session.execute(
        insert(Contradiction),
        [
            {
                "user_id": f["user_id"],
                "norm_key": f["norm_key"][:255],
                "entry_ids": f["entry_ids"],
                "fingerprint": f["fingerprint"],
                "status": "closed" if f.get("closed") else "open",
                "resolution": f["resolution"],
                "found_run_id": f["run_id"],
                "found_at": f["at"],
                "closed_at": f["at"] if f.get("closed") else None,
            }
            for f in found
        ],
    )
