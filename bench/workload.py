"""Deterministic, seeded workloads for the benchmarks.

A :class:`MemoryWorkload` describes a host memory table (users x entries per user, the
share of stale entries, the share of keys that contradict another, the agents); the
same parameters and seed always give the same rows. :func:`seed_memories` writes them
into an existing ``usermemories`` table with ``COPY``.

    rows = list(memory_rows(MemoryWorkload(users=20, entries=10)))
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

#: The columns :func:`memory_rows` fills, in order.
MEMORY_COLUMNS = (
    "id",
    "user_id",
    "key",
    "value",
    "category",
    "visibility",
    "source_agent_id",
    "group_ids",
    "conflicted",
    "access_count",
    "created_at",
    "updated_at",
)

#: Stale entries are this old or older, fresh ones younger than ``FRESH_DAYS``: far
#: from the default 90-day cutoff, so the second a measurement starts never matters.
STALE_DAYS = 120
FRESH_DAYS = 60


@dataclass(frozen=True)
class MemoryWorkload:
    """The shape of a seeded memory table.

    ``stale_share``: entries neither updated nor recalled for ``STALE_DAYS`` or more
    (some of them protected: a ``_gdpr_`` key, or the ``property`` category).
    ``contradiction_share``: entries whose key is another entry's key spelled another
    way, with a different value (pairs, so two entries of a user per contradiction).
    ``recalled_share``: old entries with ``access_count > 0`` (recalled, so kept).
    """

    seed: int = 42
    users: int = 1_000
    entries: int = 100
    stale_share: float = 0.45
    contradiction_share: float = 0.04
    recalled_share: float = 0.05
    agents: int = 4

    def user_id(self, user: int) -> str:
        return f"user-{user:06d}"


def _entry_id(seed: int, user: int, entry: int) -> str:
    return hashlib.md5(f"{seed}:{user}:{entry}".encode(), usedforsecurity=False).hexdigest()


def _user_rows(w: MemoryWorkload, user: int, at: datetime) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(f"{w.seed}:{user}")
    pairs = round(w.entries * w.contradiction_share / 2)
    if w.contradiction_share > 0 and w.entries >= 3:
        pairs = min(max(1, pairs), (w.entries - 1) // 2)
    user_id = w.user_id(user)
    for entry in range(w.entries):
        agent: str | None = f"agent-{rng.randrange(w.agents)}" if w.agents else None
        visibility = "self"
        category = rng.choice(("fact", "fact", "preference", "context"))
        if entry < 2 * pairs:
            # Entries 2k and 2k+1 hold one key in two spellings and two values.
            pair = entry // 2
            key = f"topic_{pair}" if entry % 2 == 0 else f"Topic-{pair}"
            value: Any = f"answer {entry % 2} of {pair}"
        elif entry == 2 * pairs:
            key, value, agent, visibility = "_gdpr_consent", "granted", None, "global"
        else:
            key = f"note_{entry}"
            value = f"value {user}/{entry}"
            if rng.random() < 0.04:
                category = "property"
        roll = rng.random()
        access = 0
        if roll < w.stale_share:
            age = rng.uniform(STALE_DAYS, 400)
        elif roll < w.stale_share + w.recalled_share:
            age = rng.uniform(STALE_DAYS, 400)
            access = rng.randint(1, 9)
        else:
            age = rng.uniform(0, FRESH_DAYS)
        touched = at - timedelta(days=age)
        yield (
            _entry_id(w.seed, user, entry),
            user_id,
            key,
            json.dumps(value),
            category,
            visibility,
            agent,
            "[]",
            False,
            access,
            touched,
            touched,
        )


def memory_rows(w: MemoryWorkload, *, at: datetime | None = None) -> Iterator[tuple[Any, ...]]:
    """Every row of the workload, in :data:`MEMORY_COLUMNS` order (``at``: the "now"
    ages count back from; default the current UTC time)."""
    # The memory table's timestamps are naive UTC.
    now = at or datetime.now(UTC).replace(tzinfo=None)
    for user in range(w.users):
        yield from _user_rows(w, user, now)


def seed_memories(conn: psycopg.Connection[Any], w: MemoryWorkload, *, table: str = "usermemories") -> int:
    """COPY the workload into ``table`` (created already); returns the rows written.
    The caller commits."""
    written = 0
    columns = ", ".join(MEMORY_COLUMNS)
    with conn.cursor() as cur, cur.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
        for row in memory_rows(w):
            copy.write_row(row)
            written += 1
    return written
