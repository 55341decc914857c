"""One dispatcher tick against a big schedule: its database work and the claim's plan.

Creates a throwaway PostgreSQL database, fills ``dream_user_state`` with ``--users``
users of whom ``--due`` are due (80 % by time, 20 % dirty), plus as many dirty users
whose run is already in flight (the dirty scan must step over them), then:

1. prints ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim, in a transaction rolled back;
2. times one real tick's database work (claim + commit), runs not sent anywhere;
3. times a second tick, which finds nobody due.

    python bench/dispatcher_tick.py                      # 1,000,000 users, 10,000 due
    python bench/dispatcher_tick.py --users 2000 --due 100   # a quick smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import psycopg
from psycopg import sql

from schedules import dispatcher
from store import dispatch as dispatch_store
from store.db import dispose_engines, session_scope
from store.migrate import upgrade
from store.types import now
from worker.settings import Settings

#: "Well under a second" for 1,000,000 users with 10,000 due.
GOAL_MS = 1000.0
#: The first claim (UPDATE ... FROM a join the planner hashed over every user): 419 ms.
BASELINE_MS = 419.0

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@dataclass
class Figures:
    users: int
    due: int
    claimed: int
    claim_ms: float
    idle_tick_ms: float
    plan: str


def _fill(url: str, users: int, due: int) -> None:
    timed = due - due // 5
    dirty = due // 5
    in_flight = min(due, users - due)
    with psycopg.connect(url, autocommit=True) as conn:
        # Not due: next time spread over the coming day.
        conn.execute(
            "INSERT INTO dream_user_state (user_id, next_dream_at) "
            "SELECT 'user-' || g, timezone('utc', now()) + (1 + random() * 86000) * interval '1 second' "
            "FROM generate_series(1, %s::int) AS g",
            (users,),
        )
        conn.execute(
            "UPDATE dream_user_state SET next_dream_at = timezone('utc', now()) - random() * interval '1 hour' "
            "WHERE user_id IN (SELECT 'user-' || g FROM generate_series(1, %s::int) AS g)",
            (timed,),
        )
        conn.execute(
            "UPDATE dream_user_state SET dirty_since = timezone('utc', now()) - interval '1 hour' "
            "WHERE user_id IN (SELECT 'user-' || g FROM generate_series(%s::int, %s::int) AS g)",
            (timed + 1, timed + dirty),
        )
        # Dirty, but their run was sent after the change: not due.
        conn.execute(
            "UPDATE dream_user_state SET dirty_since = timezone('utc', now()) - interval '2 hours', "
            "dispatched_at = timezone('utc', now()) - interval '10 minutes' "
            "WHERE user_id IN (SELECT 'user-' || g FROM generate_series(%s::int, %s::int) AS g)",
            (due + 1, due + in_flight),
        )
        conn.execute("VACUUM ANALYZE dream_user_state")


def _explain(settings: Settings) -> str:
    at = now()
    interval = settings.dream_interval_hours * 3600
    params = {
        "at": at,
        "limit": settings.dispatch_max_users,
        "dirty_cutoff": at - timedelta(seconds=settings.dispatch_dirty_delay_seconds),
        "lease_cutoff": at - timedelta(seconds=settings.dispatch_lease_seconds),
        "interval": interval,
        "base": (at - dispatch_store.EPOCH).total_seconds() + interval / 2,
    }
    explain = dispatch_store._PG_CLAIM.text.replace("\nWITH", "EXPLAIN (ANALYZE, BUFFERS) WITH", 1)
    with session_scope(settings) as session:
        from sqlalchemy import text

        lines = [row[0] for row in session.execute(text(explain), params)]
        session.rollback()
    return "\n".join(lines)


def run(users: int, due: int) -> Figures:
    name = f"reverie_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    base = ADMIN_URL.rsplit("/", 1)[0]
    url = f"{base}/{name}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        settings = Settings(_env_file=None, database_url=url, dispatch_max_users=max(due, 1))  # type: ignore[call-arg]
        upgrade(settings)
        _fill(url, users, due)
        plan = _explain(settings)

        dispose_engines()
        dispatcher.claim(settings, at=now() - timedelta(days=3650))  # warm the pool; nobody is due then
        started = time.perf_counter()
        claimed = dispatcher.claim(settings)
        claim_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        dispatcher.claim(settings)
        idle_ms = (time.perf_counter() - started) * 1000
        dispose_engines()
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    return Figures(users, due, len(claimed), claim_ms, idle_ms, plan)


def main(argv: list[str] | None = None) -> Figures:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--due", type=int, default=10_000)
    args = parser.parse_args(argv)
    if not 0 < args.due <= args.users // 2:
        parser.error("--due must be positive and at most half of --users")
    figures = run(args.users, args.due)
    print("EXPLAIN ANALYZE of the claim:\n")
    print(figures.plan)
    print()
    print(f"users in the schedule : {figures.users:,}")
    print(f"due                   : {figures.due:,}")
    print(f"claimed in one tick   : {figures.claimed:,}")
    print(f"tick database work    : {figures.claim_ms:,.0f} ms (claim + commit)")
    print(f"next tick, none due   : {figures.idle_tick_ms:,.1f} ms")
    print(f"baseline              : {BASELINE_MS:,.0f} ms (ratio {figures.claim_ms / BASELINE_MS:.2f})")
    print(f"goal                  : < {GOAL_MS:,.0f} ms ({'met' if figures.claim_ms < GOAL_MS else 'MISSED'})")
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
