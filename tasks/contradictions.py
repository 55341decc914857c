"""Contradictions: keys that mean the same with different values, per user.

Keys are compared by meaning with the key matcher (:mod:`worker.keymatch`): ``birthday``
and ``date_of_birth`` are one key, ``first_name`` and ``last_name`` never are; across
agents and visibilities. Values are compared as JSON. A new contradiction sets
``conflicted`` on its rows and is recorded once; it closes (and ``conflicted`` clears)
when the values agree again. Under ``keep_newest`` the older rows are archived and
removed; ``_gdpr_`` keys are never considered and protected categories never removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Table
from sqlalchemy.orm import Session

from store import contradictions as store
from store import key_vectors
from store.entry_state import is_reserved, protected_category
from store.memories import (
    as_restored,
    contradiction_candidates,
    loose_key,
    remove_entries,
    restored_entries,
    set_conflicted,
    table_for,
    unchanged_since_read,
    user_entries,
    user_keys,
)
from store.models import Contradiction
from store.types import naive_utc
from worker.keymatch import KeyMatcher, get_matcher
from worker.policy import PolicyBook
from worker.settings import Settings

_SEPARATORS = re.compile(r"[\s_.\-]+")


def normalise_key(key: str) -> str:
    """``Favorite-Color``, ``favorite color`` and ``favorite_color`` are one key."""
    return _SEPARATORS.sub("_", key.strip().lower()).strip("_")


def canonical_value(value: Any) -> str:
    """A value as canonical JSON (SQLite may hand JSON back as text)."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ContradictionCounts:
    found: int = 0
    resolved: int = 0
    removed: int = 0


def _fingerprint(rows: list[Any]) -> str:
    parts = sorted(f"{row.id}={canonical_value(row.value)}" for row in rows)
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


def _newest_first(rows: list[Any]) -> list[Any]:
    return sorted(rows, key=lambda r: (_time(r.updated_at or r.created_at), _time(r.created_at), r.id), reverse=True)


def _time(stamp: datetime | None) -> datetime:
    """A row's time to order by, naive UTC (a host's ``timestamptz`` column reads with a
    zone); none (NULL, or a time past Python's range) the oldest."""
    return naive_utc(stamp) if stamp is not None else datetime.min


@dataclass
class _Pass:
    """One detection pass over a user's entries (shared state of the helpers).

    Flags and newly found contradictions are collected in ``writes`` and written by
    :meth:`_Writes.flush`, so a pass over many users costs a few statements.
    """

    session: Session
    settings: Settings
    table: Table
    user_id: str
    book: PolicyBook
    at: datetime
    run_id: int | None
    writes: _Writes
    found: int = 0
    resolved: int = 0
    removed: int = 0
    #: The user's entries a restore put back (id -> when): while one holds what was put
    #: back (not updated since), ``keep_newest`` flags its contradiction, and removes none
    #: of its rows (the restore would be undone by the next pass).
    restored: dict[str, datetime] = field(default_factory=dict)

    def record(self, norm_key: str, rows: list[Any], resolution: str, *, closed: bool = False) -> None:
        self.found += 1
        self.writes.found.append(
            {
                "user_id": self.user_id,
                "norm_key": norm_key,
                "entry_ids": [r.id for r in rows],
                "fingerprint": _fingerprint(rows),
                "run_id": self.run_id,
                "resolution": resolution,
                "at": self.at,
                "closed": closed,
            }
        )

    def handle(self, norm_key: str, rows: list[Any], existing: Contradiction | None) -> None:
        # A group holding a row a restore put back (which still holds it) is flagged, not
        # resolved: removing any of its rows would undo what the restore decided (a host's
        # trigger dates the row put back at the restore, the newest of the group).
        restored = any(self._as_restored(r) for r in rows)
        losers = [] if restored else _losers(self.settings, self.book, rows)
        if losers:
            # Only while each loser still holds what it was judged on: a row the
            # application changed since the read stays.
            gone = remove_entries(
                self.session,
                self.table,
                unchanged_since_read(self.session, self.table, losers),
                reason="contradiction",
                source="contradiction",
                run_id=self.run_id,
            )
            self.removed += len(gone)
            gone_ids = {g.entry_id for g in gone}
            survivors = [r for r in rows if r.id not in gone_ids]
            if _distinct_values(survivors) < 2:
                # Resolved: the values that remain agree.
                self.writes.flag(self.user_id, [r.id for r in survivors], False)
                if existing is not None:
                    store.close(self.session, [existing.id], self.at, resolution="keep_newest")
                else:
                    self.record(norm_key, rows, "keep_newest", closed=True)
                self.resolved += 1
                return
            rows = survivors
        self.writes.flag(self.user_id, [r.id for r in rows], True)
        if existing is None:
            self.record(norm_key, rows, "flag")
        elif existing.fingerprint != _fingerprint(rows):
            store.refresh(self.session, existing.id, [r.id for r in rows], _fingerprint(rows))

    def _as_restored(self, row: Any) -> bool:
        return as_restored(row, self.restored.get(str(row.id)))

    def close_stale(self, stale: list[Contradiction]) -> None:
        for contradiction in stale:
            self.writes.flag(self.user_id, store.entry_ids_of(contradiction), False)
        store.close(self.session, [c.id for c in stale], self.at)

    def counts(self) -> ContradictionCounts:
        return ContradictionCounts(found=self.found, resolved=self.resolved, removed=self.removed)


@dataclass
class _Writes:
    """Flag changes (the last one per entry wins) and new contradictions, written together."""

    # Keyed by (user id, entry id): the host may number its rows per user.
    flags: dict[tuple[str, str], bool] = field(default_factory=dict)
    found: list[dict[str, Any]] = field(default_factory=list)

    def flag(self, user_id: str, entry_ids: list[str], value: bool) -> None:
        for entry_id in entry_ids:
            self.flags.pop((user_id, entry_id), None)
            self.flags[(user_id, entry_id)] = value

    def flush(self, session: Session, table: Table) -> None:
        for value in (True, False):
            set_conflicted(session, table, [e for e, v in self.flags.items() if v is value], value)
        store.record_many(session, self.found)


def _distinct_values(rows: list[Any]) -> int:
    return len({canonical_value(r.value) for r in rows})


def _groups(
    rows: list[Any], book: PolicyBook, owners: Collection[str] | None, matcher: KeyMatcher
) -> dict[str, list[Any]]:
    """The rows that may contradict, by meaning-group (named by its representative's rules form)."""
    kept = [
        row
        for row in rows
        if not is_reserved(row.key)
        and book.for_agent(row.source_agent_id).detects
        and (owners is None or row.source_agent_id in owners)
    ]
    representative = matcher.groups([row.key for row in kept])
    groups: dict[str, list[Any]] = defaultdict(list)
    for row in kept:
        groups[matcher.normalise(representative[row.key])].append(row)
    return groups


def _same_keys(matcher: KeyMatcher, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """For the SQL prefilter: ``(user, key)`` -> group label, for every key whose
    meaning-group holds keys that the prefilter's loose form would keep apart."""
    by_user: dict[str, list[str]] = defaultdict(list)
    for user_id, key in keys:
        by_user[user_id].append(key)
    labels: dict[tuple[str, str], str] = {}
    for user_id, user_keys_ in by_user.items():
        members: dict[str, list[str]] = defaultdict(list)
        for key, representative in matcher.groups(user_keys_).items():
            members[representative].append(key)
        for representative, group in members.items():
            # Most keys mean only themselves: a group of one needs no label.
            if len(group) > 1 and len({loose_key(key) for key in group}) > 1:
                labels.update({(user_id, key): representative for key in group})
    return labels


def _unseen(rows: list[Any], book: PolicyBook) -> set[str]:
    """The ids of rows whose owner's policy turns detection off: their contradictions are
    not looked at, so they are not closed either (their values may still disagree)."""
    return {str(row.id) for row in rows if not book.for_agent(row.source_agent_id).detects}


def _detect_user(
    work: _Pass,
    groups: dict[str, list[Any]],
    already_open: dict[str, Contradiction],
    *,
    scoped: bool,
    unseen: set[str],
) -> None:
    contradicting: set[str] = set()
    for norm_key, rows in groups.items():
        if _distinct_values(rows) >= 2:
            contradicting.add(norm_key)
            work.handle(norm_key, rows, already_open.pop(norm_key, None))
    # What is still open but no longer disagrees (or is gone) is closed.
    stale = list(already_open.values())
    if scoped:
        # An agent-scoped run only closes what it could see.
        stale = [c for c in stale if c.norm_key in groups]
    # Nor does any run close one it no longer looks at: detection was turned off for an
    # owner of its rows, not made to agree.
    stale = [c for c in stale if unseen.isdisjoint(store.entry_ids_of(c))]
    work.close_stale(stale)


def detect(
    session: Session,
    settings: Settings,
    user_id: str,
    *,
    book: PolicyBook,
    owners: Collection[str] | None,
    at: datetime,
    run_id: int | None,
) -> ContradictionCounts:
    """Find, record, flag, resolve and close the user's contradictions (caller's transaction)."""
    already_open = store.open_by_key(session, user_id)
    if not _detects(book) and not already_open:
        return ContradictionCounts()  # nothing to find or close (see :func:`detect_many`)
    table = table_for(settings)
    matcher = get_matcher(settings)
    rows = user_entries(session, table, user_id)
    key_vectors.prepare(session, matcher, {row.key for row in rows})
    groups = _groups(rows, book, owners, matcher)
    writes = _Writes()
    work = _Pass(session, settings, table, user_id, book, at, run_id, writes)
    work.restored = {e: at for (_, e), at in _restored(session, book, [user_id]).items()}
    unseen = _unseen(rows, book)
    _detect_user(work, groups, already_open, scoped=owners is not None, unseen=unseen)
    writes.flush(session, table)
    return work.counts()


def detect_many(
    session: Session, settings: Settings, runs: Mapping[str, int], *, book: PolicyBook, at: datetime
) -> dict[str, ContradictionCounts]:
    """:func:`detect` for several users' whole-user runs (``runs``: user id -> run id),
    in the caller's transaction, from one read of the entries that may contradict
    (PostgreSQL; see :func:`store.memories.contradiction_candidates`)."""
    users = sorted(runs)
    already_open = store.open_by_user(session, users)
    if not _detects(book) and not any(already_open.values()):
        # No policy looks for contradictions and none is open: there is nothing to find
        # or close, and the keys are not matched (a cost with no use here).
        return {user_id: ContradictionCounts() for user_id in users}
    table = table_for(settings)
    matcher = get_matcher(settings)
    same_keys: dict[tuple[str, str], str] = {}
    if matcher.mode != "off":
        keys = user_keys(session, table, users)
        key_vectors.prepare(session, matcher, {key for _, key in keys})
        same_keys = _same_keys(matcher, keys)
    by_user: dict[str, list[Any]] = defaultdict(list)
    for row in contradiction_candidates(session, table, users, same_keys):
        by_user[row.user_id].append(row)
    restored: dict[str, dict[str, datetime]] = defaultdict(dict)
    for (user_id, entry_id), restored_at in _restored(session, book, users).items():
        restored[user_id][entry_id] = restored_at
    writes = _Writes()
    counts: dict[str, ContradictionCounts] = {}
    for user_id in users:
        work = _Pass(session, settings, table, user_id, book, at, runs[user_id], writes)
        work.restored = restored.get(user_id, {})
        mine = by_user.get(user_id, [])
        groups = _groups(mine, book, None, matcher)
        _detect_user(work, groups, already_open.get(user_id, {}), scoped=False, unseen=_unseen(mine, book))
        counts[user_id] = work.counts()
    writes.flush(session, table)
    return counts


def _detects(book: PolicyBook) -> bool:
    """Whether any policy looks for contradictions."""
    return any(p.detects for p in (book.default, *book.agents.values()))


def _restored(session: Session, book: PolicyBook, users: list[str]) -> dict[tuple[str, str], datetime]:
    """The users' restored entries, where any policy removes contradicted rows (else
    nothing is removed, and nothing is looked up)."""
    policies = (book.default, *book.agents.values())
    if not any(p.contradictionResolution == "keep_newest" for p in policies):
        return {}
    return restored_entries(session, users)


def _losers(settings: Settings, book: PolicyBook, rows: list[Any]) -> list[Any]:
    """Under ``keep_newest`` (the older row's owner's policy): the rows that go."""
    ordered = _newest_first(rows)
    protected = settings.protected_category_set
    return [
        row
        for row in ordered[1:]
        if book.for_agent(row.source_agent_id).contradictionResolution == "keep_newest"
        and not protected_category(row.category, protected)
    ]
