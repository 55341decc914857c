"""Queries on ``dream_policies``: per-agent dream configs (partial, EDDI field names)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.models import Policy
from store.types import now


def all_configs(session: Session) -> dict[str, dict[str, Any]]:
    """Every stored per-agent config, keyed by agent id."""
    return {row.agent_id: dict(row.config) for row in session.execute(select(Policy.agent_id, Policy.config))}


def get_config(session: Session, agent_id: str) -> dict[str, Any] | None:
    row = session.get(Policy, agent_id)
    return dict(row.config) if row is not None else None


def merge_config(session: Session, agent_id: str, changes: dict[str, Any]) -> dict[str, Any]:
    """Apply ``changes`` over the agent's stored config (creating it); returns the result."""
    row = session.get(Policy, agent_id, with_for_update=True)
    if row is None:
        row = Policy(agent_id=agent_id, config=dict(changes), updated_at=now())
        session.add(row)
    else:
        # A new dict, so the JSON column is seen as changed.
        row.config = {**row.config, **changes}
        row.updated_at = now()
    session.flush()
    return dict(row.config)
