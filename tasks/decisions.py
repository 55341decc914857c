"""What a signal handler receives and what it reports back.

A handler works in two steps so no database transaction is held open across a
model call: ``prepare`` (no transaction; may call the model) and ``apply`` (inside
the transaction that also marks the signal ``done``).
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class SignalInput:
    """A claimed signal whose payload has been re-validated."""

    signal_id: int
    kind: str
    user_id: str
    agent_id: str | None
    payload: dict[str, Any]
    enqueued_at: datetime


@dataclass(frozen=True)
class Decision:
    """One candidate memory and what became of it.

    ``accepted`` candidates passed every check; ``outcome`` then says what the write
    did (``insert``, ``update``, ``unchanged``, ``observed 1/2``...). Refused ones
    carry the reason in ``outcome``.
    """

    key: str
    value: str
    category: str
    accepted: bool
    outcome: str


@dataclass
class Effect:
    """What applying one signal did to the memory table."""

    source: str
    decisions: list[Decision] = field(default_factory=list)
    writes: Counter[str] = field(default_factory=Counter)

    @property
    def wrote(self) -> bool:
        return sum(self.writes.values()) > 0

    def refuse(self, candidate: Any, reason: str) -> None:
        self.decisions.append(Decision(*describe(candidate), accepted=False, outcome=reason))


def describe(candidate: Any) -> tuple[str, str, str]:
    """Key, value and category of a (possibly malformed) candidate, shortened for reports."""
    if not isinstance(candidate, dict):
        return ("?", _short(candidate), "?")
    return (_short(candidate.get("key")), _short(candidate.get("value")), _short(candidate.get("category")))


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)[:limit]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def normalise(text: str) -> str:
    """Case and whitespace folded, for evidence matching (``"My  Color"`` ~ ``"my color"``)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def parse_reply_list(text: str) -> list[Any] | None:
    """The JSON array in a model reply (code fences allowed), or None if there is none."""
    # Models like to wrap JSON in prose or code fences: take the outermost brackets.
    body = text.strip()
    start, end = body.find("["), body.rfind("]")
    if start < 0 or end < start:
        return None
    try:
        parsed = json.loads(body[start : end + 1])
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, list) else None
