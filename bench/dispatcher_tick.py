"""P3: one dispatcher tick against a big schedule; its cost follows the due count, not the total.

For each case (total users, due users) a throwaway PostgreSQL database gets a
``dream_user_state`` of that many users, of whom that many are due (80 % by time, 20 %
dirty), plus as many dirty users whose run is already in flight (the dirty scan must
step over them). Then one real tick's database work (``schedules.dispatcher.claim``:
claim + commit, runs not sent anywhere) is timed ``REPEATS`` times, the claimed users'
schedule rows put back (and vacuumed) between repeats, and the median kept; a last tick,
which finds nobody due, is timed too.

The cases, and what each row's goal says:

- 1,000,000 users, 10,000 due: under a second;
- 100,000 users, 10,000 due: the baseline of the first row, which must stay within
  ``TOTAL_GROWTH_LIMIT`` (1.5x) of it: ten times the users, nearly the same tick;
- 1,000,000 users, 1,000 due: compared with the first row, must take at most
  ``DUE_SHRINK_LIMIT`` (0.5x) of it: a tenth of the due users, a much cheaper tick.

    python -m bench P3                  # the three cases above (seconds of seeding each)
    python bench/dispatcher_tick.py     # the same, printing the claim's query plan first
    python bench/dispatcher_tick.py --quick   # tiny numbers: a smoke run
    python -m bench.dispatcher_tick --case 3000000 5787   # one case of your own
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg
from psycopg import sql

if not __package__:  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.table import Row, ratio, render, seconds
from schedules import dispatcher
from store import dispatch as dispatch_store
from store.db import dispose_engines, session_scope
from store.migrate import upgrade
from store.types import now
from worker.settings import Settings

#: One tick with 1,000,000 users and 10,000 due: under a second.
GOAL_SECONDS = 1.0
#: Ten times the users (same due count) may cost at most this factor.
TOTAL_GROWTH_LIMIT = 1.5
#: A tenth of the due users (same total) must cost at most this fraction.
DUE_SHRINK_LIMIT = 0.5
REPEATS = 3

FULL_CASES = ((1_000_000, 10_000), (100_000, 10_000), (1_000_000, 1_000))
QUICK_CASES = ((20_000, 200), (2_000, 200), (20_000, 20))

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@dataclass
class Figures:
    users: int
    due: int
    claimed: int
    tick_seconds: float  # median of REPEATS ticks
    ticks: list[float]
    idle_tick_seconds: float
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
        # What a tick changes, kept to put back between repeats.
        conn.execute(
            "CREATE TABLE bench_saved AS SELECT user_id, next_dream_at, dispatched_at FROM dream_user_state "
            "WHERE next_dream_at <= timezone('utc', now()) OR dirty_since IS NOT NULL"
        )
        conn.execute("VACUUM ANALYZE dream_user_state")


def _restore(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE dream_user_state AS s SET next_dream_at = b.next_dream_at, dispatched_at = b.dispatched_at "
            "FROM bench_saved AS b WHERE s.user_id = b.user_id "
            "AND (s.next_dream_at, s.dispatched_at) IS DISTINCT FROM (b.next_dream_at, b.dispatched_at)"
        )
        conn.execute("VACUUM ANALYZE dream_user_state")


def _explain(settings: Settings) -> str:
    from sqlalchemy import text

    at = now()
    interval = settings.dream_interval_seconds
    params = {
        "at": at,
        "limit": settings.dispatch_max_users,
        "dirty_cutoff": at - timedelta(seconds=settings.dispatch_dirty_delay_seconds),
        "lease_cutoff": at - timedelta(seconds=settings.dispatch_lease_seconds),
        "lease_end": at + timedelta(seconds=settings.dispatch_lease_seconds),
        "interval": interval,
        "base": (at - dispatch_store.EPOCH).total_seconds() + interval / 2,
    }
    explain = dispatch_store._PG_CLAIM.text.replace("\nWITH", "EXPLAIN (ANALYZE, BUFFERS) WITH", 1)
    with session_scope(settings) as session:
        lines = [row[0] for row in session.execute(text(explain), params)]
        session.rollback()
    return "\n".join(lines)


def run(users: int, due: int, *, repeats: int = REPEATS) -> Figures:
    """Seed a throwaway database with ``users`` scheduled, ``due`` of them due; time ticks."""
    name = f"reverie_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        settings = Settings(_env_file=None, database_url=url, dispatch_max_users=due)  # type: ignore[call-arg]
        upgrade(settings)
        _fill(url, users, due)
        plan = _explain(settings)
        dispose_engines()
        dispatcher.claim(settings, at=now() - timedelta(days=3650))  # warm the pool; nobody is due then
        ticks: list[float] = []
        claimed = 0
        for index in range(repeats):
            if index:
                _restore(url)
            started = time.perf_counter()
            claimed = len(dispatcher.claim(settings))
            ticks.append(time.perf_counter() - started)
        started = time.perf_counter()
        dispatcher.claim(settings)
        idle = time.perf_counter() - started
        dispose_engines()
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    return Figures(users, due, claimed, statistics.median(ticks), ticks, idle, plan)


def rows_for(big: Figures, fewer_users: Figures, fewer_due: Figures) -> list[Row]:
    """The P3 rows: the big tick against its goal, and the two scaling comparisons."""

    def label(f: Figures) -> str:
        return f"tick: {f.users:,} users, {f.due:,} due (claimed {f.claimed:,})"

    def ms(f: Figures) -> str:
        return seconds(f.tick_seconds)

    growth = big.tick_seconds / fewer_users.tick_seconds
    shrink = fewer_due.tick_seconds / big.tick_seconds
    return [
        Row(
            "P3",
            label(big),
            ms(big),
            baseline=f"{ms(fewer_users)} ({fewer_users.users:,} users)",
            ratio=ratio(big.tick_seconds, fewer_users.tick_seconds),
            goal=f"< {seconds(GOAL_SECONDS)}, ratio <= {TOTAL_GROWTH_LIMIT}x",
            passed=big.tick_seconds < GOAL_SECONDS
            and growth <= TOTAL_GROWTH_LIMIT
            and big.claimed == big.due
            and fewer_users.claimed == fewer_users.due,
        ),
        Row("P3", label(fewer_users), ms(fewer_users)),
        Row(
            "P3",
            label(fewer_due),
            ms(fewer_due),
            baseline=f"{ms(big)} ({big.due:,} due)",
            ratio=ratio(fewer_due.tick_seconds, big.tick_seconds),
            goal=f"ratio <= {DUE_SHRINK_LIMIT}x",
            passed=shrink <= DUE_SHRINK_LIMIT and fewer_due.claimed == fewer_due.due,
        ),
        Row(
            "P3",
            f"next tick, nobody due ({big.users:,} users)",
            seconds(big.idle_tick_seconds),
            goal=f"< {seconds(GOAL_SECONDS)}",
            passed=big.idle_tick_seconds < GOAL_SECONDS,
        ),
    ]


def _measure(quick: bool) -> tuple[list[Row], Figures]:
    cases = QUICK_CASES if quick else FULL_CASES
    figures = []
    for users, due in cases:
        print(f"P3: seeding {users:,} users, {due:,} due", file=sys.stderr, flush=True)
        figures.append(run(users, due))
    big, fewer_users, fewer_due = figures
    return rows_for(big, fewer_users, fewer_due), big


def measure(quick: bool) -> list[Row]:
    """The P3 rows (``quick``: tiny numbers, a smoke run of a few seconds)."""
    return _measure(quick)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny numbers: a smoke run, not a measurement")
    parser.add_argument(
        "--case",
        nargs=2,
        type=int,
        metavar=("USERS", "DUE"),
        help="time one case only (USERS scheduled, DUE of them due) and print its figures",
    )
    args = parser.parse_args(argv)
    if args.case:
        users, due = args.case
        one = run(users, due)
        ticks = ", ".join(f"{t * 1000:.0f}" for t in one.ticks)
        print(f"{users:,} users, {due:,} due: claimed {one.claimed:,}, tick median {one.tick_seconds * 1000:.0f} ms")
        print(f"ticks (ms): {ticks}; next tick, nobody due: {one.idle_tick_seconds * 1000:.0f} ms")
        return 0 if one.claimed == due else 1
    rows, big = _measure(args.quick)
    print(f"EXPLAIN ANALYZE of the claim ({big.users:,} users, {big.due:,} due):\n")
    print(big.plan)
    print(f"\nticks (s): {', '.join(f'{t:.3f}' for t in big.ticks)}\n")
    print(render(rows))
    return 0 if all(r.passed is not False for r in rows) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
