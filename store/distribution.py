"""How Reverie's tables split across a Citus cluster (README, Distributing with Citus).

Every ``dream_`` table is either distributed by ``user_id``, co-located with the
others, or a small reference table copied to every node. A distributed table's primary
key and every unique constraint or index include ``user_id``, and a foreign key between
two of them includes ``user_id`` on both sides; a reference table references no
distributed table. ``tests/test_distributable_schema.py`` reads the live schema and
holds every table to that.
"""

from __future__ import annotations

#: The column every distributed table is split by.
DISTRIBUTION_COLUMN = "user_id"

#: Distributed by ``user_id`` and co-located: one user's rows of every table sit on one
#: node, so a dream run, a signal or an erasure touches one shard group.
DISTRIBUTED: frozenset[str] = frozenset(
    {
        "dream_signals",
        "dream_runs",
        "dream_archive",
        "dream_contradictions",
        "dream_user_state",
        "dream_entry_state",
        "dream_events",
        "dream_observations",
        "dream_activity",
        "dream_profiles",
    }
)

#: Small tables that belong to no user, copied whole to every node.
#: ``dream_spend`` and ``dream_reservations`` hold the budgets every worker shares (the
#: day's line above all): one reservation takes from several lines (run, user, day,
#: signal) in one statement that must see them all, and they stay small (retention
#: drops old lines; a reservation lives for one model call).
REFERENCE: frozenset[str] = frozenset(
    {
        "dream_policies",
        "dream_key_vectors",
        "dream_spend",
        "dream_reservations",
        "dream_alembic_version",
    }
)

#: The first distributed table; the others are co-located with it.
ANCHOR = "dream_signals"

#: Tables whose ``id`` is numbered by the database. Their primary key is
#: ``(id, user_id)`` on PostgreSQL; SQLite numbers only a lone ``INTEGER PRIMARY
#: KEY``, so there ``id`` stays the whole key (SQLite is never distributed).
NUMBERED: frozenset[str] = frozenset(
    {
        "dream_signals",
        "dream_runs",
        "dream_archive",
        "dream_contradictions",
        "dream_events",
        "dream_observations",
        "dream_activity",
    }
)


def citus_statements() -> list[str]:
    """The calls that distribute a migrated database, in an order Citus accepts:
    reference tables first, then the anchor, then the tables co-located with it
    (``dream_runs`` before ``dream_archive``, whose foreign key points at it)."""
    statements = [f"SELECT create_reference_table('{name}');" for name in sorted(REFERENCE)]
    statements.append(f"SELECT create_distributed_table('{ANCHOR}', '{DISTRIBUTION_COLUMN}');")
    rest = sorted(DISTRIBUTED - {ANCHOR}, key=lambda name: (name == "dream_archive", name))
    statements += [
        f"SELECT create_distributed_table('{name}', '{DISTRIBUTION_COLUMN}', colocate_with => '{ANCHOR}');"
        for name in rest
    ]
    return statements
