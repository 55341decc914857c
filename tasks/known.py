"""What the user already has, as the model is shown it: known entries behind small handles.

A model that sees the user's existing keys reuses them instead of inventing a twin
(``favourite_colour`` beside ``favorite_color``) and can say that a fact is already
known or changed. Each entry is shown as ``{"handle", "key", "value", "category"}``:
the handle is a small integer that means something only within one prompt, so no raw
id reaches the model, and a handle the model makes up names nothing.

Entries are chosen most relevant first (words shared with the signal's text, then the
most recently updated) until the token budget (``REVERIE_KNOWN_ENTRIES_TOKEN_BUDGET``)
is spent; a budget of 0 shows nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table

from store.db import session_scope
from store.known_entries import visible_entries
from store.memories import table_for
from worker.settings import Settings

_WORD = re.compile(r"[^\W_]+")
#: A shown value longer than this is cut: the model needs to recognise it, not reread it.
SHOWN_VALUE_CHARS = 200


@dataclass(frozen=True)
class Known:
    """One entry as shown to the model, with what is needed to write onto it later."""

    handle: int
    entry_id: str
    key: str
    value: Any
    category: str
    visibility: str
    source_agent_id: str | None

    def shown(self) -> dict[str, Any]:
        value = self.value if not isinstance(self.value, str) else self.value[:SHOWN_VALUE_CHARS]
        return {"handle": self.handle, "key": self.key, "value": value, "category": self.category}


@dataclass(frozen=True)
class KnownEntries:
    entries: tuple[Known, ...] = ()
    #: Visible entries that did not fit the budget.
    left_out: int = 0

    def by_handle(self, handle: Any) -> Known | None:
        if isinstance(handle, bool) or not isinstance(handle, int | str):
            return None
        for entry in self.entries:
            if str(entry.handle) == str(handle).strip():
                return entry
        return None

    def shown(self) -> list[dict[str, Any]]:
        return [entry.shown() for entry in self.entries]


def words(text: str) -> set[str]:
    return {word.casefold() for word in _WORD.findall(text)}


def load(settings: Settings, user_id: str, agent_id: str | None, context: str) -> KnownEntries:
    """The user's entries ``agent_id`` may see that fit the token budget, most relevant
    to ``context`` (the signal's text) first. One short read, no transaction held."""
    budget = settings.known_entries_token_budget
    if budget <= 0:
        return KnownEntries()
    table: Table = table_for(settings)
    with session_scope(settings) as session:
        rows = visible_entries(session, table, user_id, agent_id)
    if not rows:
        return KnownEntries()
    from worker.llm import count_text_tokens

    said = words(context)
    ranked = sorted(rows, key=lambda row: _rank(row, said))
    chosen: list[Known] = []
    spent = 0
    for row in ranked:
        entry = Known(
            len(chosen) + 1, row.id, row.key, row.value, row.category or "fact", row.visibility, row.source_agent_id
        )
        cost = count_text_tokens(settings, json.dumps(entry.shown(), ensure_ascii=False))
        if spent + cost > budget:
            continue
        spent += cost
        chosen.append(entry)
    return KnownEntries(tuple(chosen), left_out=len(rows) - len(chosen))


def _rank(row: Any, said: set[str]) -> tuple[int, float, str]:
    value = row.value if isinstance(row.value, str) else json.dumps(row.value, ensure_ascii=False)
    shared = len((words(row.key.replace("_", " ")) | words(value)) & said)
    updated = row.updated_at.timestamp() if isinstance(row.updated_at, datetime) else 0.0
    return (-shared, -updated, row.id)
