"""Canonical writes: a fact lands on the entry it belongs to, not beside it as a twin.

Three ways a fact finds its entry, in order:

1. the model named a known entry by its handle (``same`` or ``update``): the fact is
   written onto that entry, whatever key the model proposed;
2. the proposed key is an existing key of the user in the write's own scope: EDDI's
   upsert;
3. the proposed key means an existing key the agent may see (``favourite_colour`` for
   ``favorite_color``; the key matcher decides, at no model cost): the fact is written
   onto that entry.

Otherwise it is a new entry. Every overwrite archives the old row first (reason
``replace``), so it can be put back; ``_gdpr_`` and protected-category entries are
never rewritten. A value equal to the stored one up to case, spacing and closing
punctuation changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from store import key_vectors
from store.entry_state import is_reserved, protected_category
from store.known_entries import locked_entry, rewrite_entry, visible_entries
from store.memories import table_for, upsert_entry
from tasks.decisions import normalise
from tasks.known import Known, KnownEntries
from worker.keymatch import KeyMatcher, get_matcher
from worker.settings import Settings

RELATIONS = ("new", "same", "update")
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"


def _unquote(value: str) -> str:
    # Only quotes around the whole value: "sign off with 'Warmly, Ann'" keeps its own.
    value = value.strip()
    while len(value) >= 2 and value[0] in _QUOTES and value[-1] in _QUOTES:
        value = value[1:-1].strip()
    return value


def clean_value(value: str) -> str:
    """A proposed value without surrounding spaces, quotes or closing punctuation."""
    return _unquote(_unquote(value).rstrip(".!?;:,"))


def same_value(stored: Any, proposed: str) -> bool:
    """Whether a stored value says what ``proposed`` says (case, spacing, punctuation aside)."""
    if not isinstance(stored, str):
        return False
    return normalise(clean_value(stored)) == normalise(clean_value(proposed))


@dataclass(frozen=True)
class Resolved:
    """What a reply item says about the known entries: its relation and, for ``same``
    and ``update``, the entry; ``reason`` says why it is refused (empty: it is not)."""

    relation: str
    target: Known | None = None
    reason: str = ""


def resolve_handle(candidate: Any, shown: KnownEntries) -> Resolved:
    """The known entry a reply item's handle names, for ``same`` and ``update``.

    An item without ``relation`` is an ``update`` when it carries a handle, else
    ``new``. A handle that names no entry shown to the model is refused: it is a guess,
    or an attempt to reach an entry this agent may not see.
    """
    handle = candidate.get("handle") if isinstance(candidate, dict) else None
    relation = candidate.get("relation") if isinstance(candidate, dict) else None
    if relation is None:
        relation = "new" if handle is None else "update"
    if relation not in RELATIONS:
        return Resolved("new", reason="relation: must be new, same or update")
    if relation == "new" or handle is None:
        # "update" or "same" naming no entry: a fact of its own, checked like any other.
        return Resolved("new")
    target = shown.by_handle(handle)
    if target is None:
        return Resolved(relation, reason=f"handle: {str(handle)[:20]!r} is not one of the entries shown")
    return Resolved(relation, target)


@dataclass(frozen=True)
class Landed:
    """Where a fact was written: the entry's key and what happened (``insert``,
    ``update``, ``unchanged`` or ``protected``), with ``outcome`` said for the report."""

    key: str
    action: str
    outcome: str


@dataclass
class Writer:
    """Writes one signal's facts for its own user, onto the entries they belong to."""

    session: Session
    settings: Settings
    user_id: str
    agent_id: str | None
    shown: KnownEntries
    source: str
    signal_id: int | None
    conversation_id: str | None = None
    _visible: list[Any] | None = field(default=None, init=False)

    def write(
        self, key: str, value: str, category: str, *, target: Known | None = None, relation: str = "new"
    ) -> Landed:
        table = table_for(self.settings)
        if target is not None:
            row = locked_entry(self.session, table, target.entry_id, self.user_id)
            if row is not None:
                return self._onto(row, value, category, note=f"{relation} as known entry {target.handle}")
            # Gone since the prompt was built: written by its key like any new fact.
            key = target.key
        if not self._own_key_exists(key):
            matched = self._matched(key)
            if matched is not None:
                row = locked_entry(self.session, table, matched.id, self.user_id)
                if row is not None:
                    return self._onto(row, value, category, note=f"proposed as {key!r}, same meaning")
        result = upsert_entry(
            self.session,
            table,
            user_id=self.user_id,
            key=key,
            value=value,
            category=category,
            source=self.source,
            visibility="self",
            source_agent_id=self.agent_id,
            source_conversation_id=self.conversation_id,
            protected_categories=self.settings.protected_category_set,
            signal_id=self.signal_id,
        )
        return Landed(key, result.action, result.action)

    def _onto(self, row: Any, value: str, category: str, *, note: str) -> Landed:
        if is_reserved(row.key) or protected_category(row.category, self.settings.protected_category_set):
            return Landed(row.key, "protected", "protected")
        if same_value(row.value, value):
            return Landed(row.key, "unchanged", f"unchanged ({note})")
        result = rewrite_entry(
            self.session,
            table_for(self.settings),
            row,
            value=value,
            # The entry keeps its own category: feedback naming a fact entry does not
            # turn it into a preference.
            category=row.category,
            source=self.source,
            source_conversation_id=self.conversation_id,
            protected_categories=self.settings.protected_category_set,
            signal_id=self.signal_id,
        )
        return Landed(row.key, result.action, f"{result.action} ({note})")

    def _entries(self) -> list[Any]:
        if self._visible is None:
            table = table_for(self.settings)
            self._visible = visible_entries(self.session, table, self.user_id, self.agent_id)
        return self._visible

    def _own(self, row: Any) -> bool:
        return bool(row.visibility != "global" and row.source_agent_id == self.agent_id)

    def _own_key_exists(self, key: str) -> bool:
        return any(row.key == key and self._own(row) for row in self._entries())

    def _matched(self, key: str) -> Any | None:
        """The visible entry whose key means ``key`` (the agent's own first), if any."""
        matcher = matcher_for(self.settings)
        if matcher is None:
            return None
        rows = self._entries()
        keys = sorted({row.key for row in rows})
        if not keys:
            return None
        key_vectors.prepare(self.session, matcher, keys, proposed=[key])
        found = matcher.find(key, keys)
        if found is None:
            return None
        same_key = [row for row in rows if row.key == found]
        same_key.sort(key=lambda row: (not self._own(row), row.visibility == "global"))
        return same_key[0] if same_key else None


def matcher_for(settings: Settings) -> KeyMatcher | None:
    """The key matcher writes use, or None when key matching is turned off (then a
    write lands on an existing entry only by its exact key, EDDI's upsert)."""
    matcher = get_matcher(settings)
    return None if matcher.mode == "off" else matcher
