"""Time ``reverie run --all`` over a seeded world on PostgreSQL, and show query plans.

Creates a throwaway database, seeds ``--users`` x ``--entries`` memory entries
(deterministic: ages, recalls, protected keys and contradicting keys all derive from
the row number), runs ``reverie run --all --json`` in a subprocess (summarization off
unless ``--summarize``, which uses the offline model), prints the EXPLAIN ANALYZE of the
statements a run issues per user, and the figure. The database is dropped afterwards.

    python bench/dream_sweep.py                     # 10,000 users x 100 entries
    python bench/dream_sweep.py --users 20 --entries 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REVERIE = str(Path(sys.executable).with_name("reverie"))

SEED_SQL = """
INSERT INTO usermemories (id, user_id, key, value, category, visibility, source_agent_id,
                          group_ids, conflicted, access_count, created_at, updated_at)
SELECT md5(u::text || ':' || e::text),
       'user-' || lpad(u::text, 6, '0'),
       CASE WHEN e = 0 THEN '_gdpr_consent'
            WHEN e = 1 THEN 'language'
            WHEN e = 2 THEN 'Language'
            ELSE 'note_' || e::text END,
       to_jsonb(CASE WHEN e = 2 AND u %% 10 = 0 THEN 'German' WHEN e IN (1, 2) THEN 'English'
                     ELSE 'value ' || md5(u::text || e::text) END),
       CASE WHEN e %% 25 = 3 THEN 'property' WHEN e %% 3 = 0 THEN 'preference' ELSE 'fact' END,
       CASE WHEN e = 0 OR e = 2 THEN 'global' ELSE 'self' END,
       CASE WHEN e = 0 THEN NULL ELSE 'agent-' || (e %% 4)::text END,
       '[]'::jsonb,
       false,
       CASE WHEN e %% 7 = 0 THEN (u + e) %% 5 ELSE 0 END,
       ts, ts
FROM generate_series(0, %(users)s - 1) AS u,
     generate_series(0, %(entries)s - 1) AS e,
     LATERAL (SELECT timezone('utc', now()) - make_interval(days => (u * 7 + e * 13) %% 200)) AS t(ts)
"""


def _url(database: str) -> str:
    return ADMIN_URL.rsplit("/", 1)[0] + "/" + database


def seed(url: str, users: int, entries: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SEED_SQL, {"users": users, "entries": entries})
        conn.execute("ANALYZE")
    return time.perf_counter() - started


def explain(url: str, user_id: str) -> None:
    """EXPLAIN ANALYZE the per-user statements, each rolled back."""
    # Compiled by the same code the run uses, so the plans are the run's plans.
    from sqlalchemy.dialects import postgresql

    from store import entry_state
    from store.memories import table_for
    from store.types import now
    from worker.settings import Settings

    settings = Settings(_env_file=None, database_url=url)  # type: ignore[call-arg]
    table = table_for(settings)
    at = now()
    from datetime import timedelta

    where = entry_state.prunable_where(
        table,
        user_id,
        agent_cutoffs={},
        default_cutoff=at - timedelta(days=90),
        owners=None,
        protected_categories=settings.protected_category_set,
        last_access_column=None,
    )
    from sqlalchemy import delete, select

    statements = {
        "prune (archive-then-delete's DELETE)": delete(table).where(where).returning(table.c.id),
        "user entries (contradictions, summarize)": select(table)
        .where(table.c.user_id == user_id)
        .order_by(table.c.created_at, table.c.id),
    }
    with psycopg.connect(url) as conn:
        for title, statement in statements.items():
            compiled = statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
            print(f"\n-- {title}")
            for (line,) in conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {compiled}"):
                print("   ", line)
            conn.rollback()
        print("\n-- recall look (INSERT ... SELECT ... ON CONFLICT on dream_entry_state)")
        for (line,) in conn.execute(
            "EXPLAIN (COSTS OFF) INSERT INTO dream_entry_state (entry_id, user_id, access_count_seen, seen_at) "
            "SELECT id, user_id, coalesce(access_count, 0), now() FROM usermemories WHERE user_id = %s "
            "ON CONFLICT (entry_id) DO UPDATE SET access_count_seen = excluded.access_count_seen",
            (user_id,),
        ):
            print("   ", line)
        conn.rollback()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=100)
    parser.add_argument("--summarize", action="store_true", help="summarize with the offline model too")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    args = parser.parse_args()

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    name = f"reverie_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _url(name)
    env = {
        **os.environ,
        "REVERIE_DATABASE_URL": url,
        "REVERIE_SUMMARIZE_INTERACTIONS": "true" if args.summarize else "false",
        "REVERIE_LOG_LEVEL": "WARNING",
    }
    try:
        subprocess.run([REVERIE, "migrate"], env=env, check=True, capture_output=True)
        seeded = seed(url, args.users, args.entries)
        print(f"seeded {args.users} users x {args.entries} entries in {seeded:.1f}s")
        started = time.perf_counter()
        done = subprocess.run([REVERIE, "run", "--all", "--json"], env=env, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        report = json.loads(done.stdout)
        explain(url, "user-000001")
        print(
            f"\nreverie run --all: {report['users_processed']} users, {report['entries_pruned']} pruned, "
            f"{report['contradictions_found']} contradictions, {report['entries_summarized']} summarized "
            f"in {elapsed:.1f}s ({elapsed / max(1, report['users_processed']) * 1000:.1f} ms/user)"
        )
        print(json.dumps({"users": args.users, "entries": args.entries, "seconds": round(elapsed, 2), **report}))
    finally:
        if not args.keep:
            with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
