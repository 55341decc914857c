"""The reader's side of profiles: ``get_for_prompt``.

Importing this module is cheap: it imports neither litellm nor Celery. A budget smaller
than the one a profile was built for is honoured with the token counts stored beside
its lines, without a tokenizer: the lowest-ranked entries are left out first, exactly
as the builder would cut at that budget.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from store import profiles as profile_store
from store import schedule
from store.db import read_once, session_scope
from worker.profile_text import Layout, assemble, cut, estimate
from worker.settings import Settings, get_settings


@dataclass(frozen=True)
class PromptProfile:
    """A profile as read: ``text`` is at most ``tokens`` tokens, ``tokens`` at most
    ``budget``. ``built_at`` is None for a user (or agent) with no profile yet, whose
    text is empty."""

    user_id: str
    agent_id: str | None
    text: str
    tokens: int
    budget: int
    entries_included: int
    entries_left_out: int
    built_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["built_at"] = self.built_at.isoformat() if self.built_at else None
        return out


def get_for_prompt(
    user_id: str,
    agent_id: str | None = None,
    token_budget: int | None = None,
    session: Session | None = None,
    *,
    settings: Settings | None = None,
) -> PromptProfile:
    """The user's prompt-ready memory as ``agent_id`` sees it (None: the shared entries
    only), within ``token_budget`` tokens if given. An agent that owns no entries of the
    user reads the shared entries. One primary-key read; with ``session`` it runs in the
    caller's transaction; without, outside any (the one statement sees one snapshot)."""
    _an_id("user_id", user_id)
    if agent_id is not None:
        _an_id("agent_id", agent_id)
    token_budget = _budget(token_budget)
    if session is not None:
        return _read(session, user_id, agent_id, token_budget, settings)
    settings = settings or get_settings()
    return read_once(settings, lambda own: _read(own, user_id, agent_id, token_budget, settings))


def _an_id(name: str, value: Any) -> None:
    """An id checked before anything is read (the database's error for another type
    would abort the caller's transaction): ids are strings."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")


def _budget(token_budget: Any) -> int | None:
    """``token_budget`` checked before anything is read (a bad one must not abort the
    caller's transaction): None, or a whole number of tokens, at least 0."""
    if token_budget is None:
        return None
    if isinstance(token_budget, bool):
        raise TypeError("token_budget must be a whole number of tokens, not bool")
    try:
        budget = operator.index(token_budget)
    except TypeError:
        raise TypeError(f"token_budget must be a whole number of tokens, not {type(token_budget).__name__}") from None
    if budget < 0:
        raise ValueError("token_budget must be at least 0")
    return budget


def is_known(user_id: str, *, settings: Settings | None = None) -> bool:
    """Whether Reverie knows the user: entries in the memory table, or a schedule row
    (a user with neither gets no profile from any dream)."""
    settings = settings or get_settings()
    with session_scope(settings) as session:
        return bool(schedule.known_user_ids(session, settings, [user_id]))


def _read(
    db: Session | Connection, user_id: str, agent_id: str | None, token_budget: int | None, settings: Settings | None
) -> PromptProfile:
    row = profile_store.read(db, user_id, agent_id, layout_over=token_budget)
    if row is None:
        budget = token_budget if token_budget is not None else (settings or get_settings()).profile_token_budget
        return PromptProfile(user_id, agent_id, "", 0, budget, 0, 0, None)
    return from_stored(row, agent_id, token_budget)


def from_stored(row: Any, agent_id: str | None, token_budget: int | None) -> PromptProfile:
    """The profile a reader gets of a stored profile row (its columns, ``layout`` as
    JSON where the cut needs it) at ``token_budget``: what a build at that budget keeps.
    A profile that holds every entry stays whole at any budget its text's count fits;
    one cut to a larger budget is cut again by the estimate a build cuts with."""
    if token_budget is None:
        return _whole(row, agent_id, max(row.budget, row.tokens))
    if token_budget >= row.budget or (token_budget >= row.tokens and not row.entries_left_out):
        return _whole(row, agent_id, max(min(token_budget, row.budget), row.tokens))
    return _cut(row, agent_id, token_budget)


def _whole(row: Any, agent_id: str | None, budget: int) -> PromptProfile:
    return PromptProfile(
        row.user_id, agent_id, row.text, row.tokens, budget, row.entries_included, row.entries_left_out, row.built_at
    )


def _cut(row: Any, agent_id: str | None, budget: int) -> PromptProfile:
    layout = Layout.from_json(row.layout)
    kept = cut(layout, budget)
    if kept >= row.entries_included and row.entries_included:
        if row.tokens <= budget:
            return _whole(row, agent_id, budget)  # the stored cut is this budget's too
        # The stored text itself is over this budget: at least one line goes.
        kept = row.entries_included - 1
    text = assemble(layout.lines[:kept], layout.total - kept)
    tokens = estimate(layout, kept)
    if tokens > budget or kept == 0:
        text, tokens = "", 0  # no entry fits (as a build makes it)
    return PromptProfile(row.user_id, agent_id, text, tokens, budget, kept, layout.total - kept, row.built_at)
