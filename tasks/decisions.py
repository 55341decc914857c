"""What a signal handler receives and what it reports back.

A handler works in two steps so no database transaction is held open across a
model call: ``prepare`` (no transaction; may call the model) and ``apply`` (inside
the transaction that also marks the signal ``done``).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterator
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


#: Top-level keys under which a reply object may carry its list of items (structured output).
LIST_FIELDS = ("facts", "preferences", "items")
#: Bracket positions tried when the reply wraps its JSON in prose (a bound on a hostile reply).
MAX_JSON_STARTS = 64
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.DOTALL)


def parse_reply_list(text: str) -> list[Any] | None:
    """The list of items in a model reply, or None if there is none.

    Models wrap JSON in prose or code fences and, under structured output, in an
    object (``{"facts": [...]}``): the first JSON value found in the whole text, a
    fenced block or from a bracket on that is a list of objects (or such a wrapper)
    wins; failing that, the first list. A single loose object is not a list: a reply
    cut off inside its array must not yield its first whole item.
    """
    fallback: list[Any] | None = None
    for value in _json_values(text):
        items = value if isinstance(value, list) else _wrapped(value)
        if items is None:
            continue
        if all(isinstance(item, dict) for item in items):
            return items
        if fallback is None:
            fallback = items
    return fallback


def _wrapped(value: Any) -> list[Any] | None:
    if isinstance(value, dict):
        for name in LIST_FIELDS:
            if isinstance(value.get(name), list):
                return list(value[name])
    return None


def _json_values(text: str) -> Iterator[Any]:
    body = text.strip()
    blocks = [body, *(match.group(1).strip() for match in _FENCE.finditer(body))]
    decoder = json.JSONDecoder()
    for block in blocks:
        try:
            yield json.loads(block)
            continue
        except (ValueError, RecursionError):
            pass
        starts = [index for index, char in enumerate(block) if char in "[{"][:MAX_JSON_STARTS]
        for start in starts:
            try:
                value, _ = decoder.raw_decode(block, start)
            except (ValueError, RecursionError):
                continue
            yield value
