"""Footprint: rows and bytes per user in each table, and bytes per wake-up in Redis.

A throwaway database gets ``--users`` users of :mod:`bench.workload` (``--entries``
entries each) and ``--signals-per-user`` mixed signals each (:mod:`bench.signal_workload`),
then one ``reverie run --all`` (this process's pipeline, the offline model, the default
dream settings) processes every signal and dreams every user once. After a ``VACUUM``,
each table's row count and ``pg_total_relation_size`` (heap, indexes, TOAST) are divided
by the number of users.

A throwaway ``redis-server`` then takes ``--messages`` wake-ups of each kind the
service sends (``signals.process`` for one signal, ``dream.run_users`` for a chunk of
100 users, and the sweeper's re-send marks), and ``INFO memory`` gives the bytes each
one holds while it waits.

    python -m bench.footprint --users 2000 --entries 100 --signals-per-user 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import psycopg
from psycopg.types.json import Jsonb

from bench.signal_workload import mixed_signals
from bench.sweep import PRUNE_DAYS, REVERIE, _free_port, _process, _url, _wait_for, databases
from bench.workload import MemoryWorkload, seed_memories


def _env(url: str) -> dict[str, str]:
    return {
        **os.environ,
        "REVERIE_DATABASE_URL": url,
        "REVERIE_BROKER_URL": "",
        "REVERIE_PRUNE_STALE_AFTER_DAYS": str(PRUNE_DAYS),
        "REVERIE_LOG_LEVEL": "WARNING",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }


def database_footprint(users: int, entries: int, signals_per_user: int) -> dict[str, Any]:
    """Per-table rows and bytes per user after every signal is processed and every user dreamed once."""
    with databases("reverie_footprint") as make:
        url = _url(make(None))
        subprocess.run([REVERIE, "migrate"], env=_env(url), check=True, capture_output=True)
        workload = MemoryWorkload(users=users, entries=entries)
        with psycopg.connect(url) as conn:
            seed_memories(conn, workload)
            ids = [workload.user_id(user) for user in range(users)]
            with conn.cursor() as cur:
                specs = mixed_signals(users * signals_per_user, users=users)
                cur.executemany(
                    "INSERT INTO dream_signals (kind, user_id, agent_id, payload) VALUES (%s, %s, %s, %s)",
                    [
                        (s.kind, ids[int(s.user_id.rsplit("-", 1)[1]) % users], s.agent_id, Jsonb(s.payload))
                        for s in specs
                    ],
                )
            conn.commit()
        started = time.perf_counter()
        done = subprocess.run(
            [REVERIE, "run", "--all", "--json"], env=_env(url), check=True, capture_output=True, text=True
        )
        run_seconds = time.perf_counter() - started
        report = json.loads(done.stdout)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
            tables = [
                row[0]
                for row in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
                ).fetchall()
            ]
            sizes = {}
            for table in tables:
                count = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
                size = conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()
                assert count is not None and size is not None
                sizes[table] = {"rows": int(count[0]), "bytes": int(size[0])}
    return {
        "users": users,
        "entries": entries,
        "signals": users * signals_per_user,
        "run_seconds": run_seconds,
        "report": {k: report.get(k) for k in ("users_processed", "signals_processed", "entries_pruned", "cost_usd")},
        "tables": sizes,
    }


def _answers(client: Any) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _used_memory(client: Any) -> int:
    return int(cast(dict[str, Any], client.info("memory"))["used_memory"])


def redis_footprint(messages: int) -> dict[str, float]:
    """Bytes of Redis memory per waiting wake-up, by kind."""
    import redis

    from worker.settings import Settings
    from worker.wakeup import not_resent_within, publish

    tmp = Path(tempfile.mkdtemp(prefix="reverie-footprint-"))
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    settings = Settings(_env_file=None, broker_url=url)
    out: dict[str, float] = {}
    with _process(argv, tmp / "redis.log"):
        client = redis.Redis.from_url(url)
        _wait_for("redis", lambda: _answers(client), 30, tmp)
        chunk = [f"user-{n:09d}" for n in range(100)]
        cases: dict[str, Callable[[], object]] = {
            "signals.process (one signal id)": lambda: publish(
                settings, "signals.process", [[n] for n in range(messages)]
            ),
            "dream.run_users (a chunk of 100 user ids)": lambda: publish(
                settings, "dream.run_users", [[chunk] for _ in range(messages)]
            ),
            "sweeper re-send mark (one key with a TTL)": lambda: not_resent_within(settings, range(messages), 300),
        }
        publish(settings, "signals.process", [[0]])  # queues declared, connection made
        for what, fill in cases.items():
            client.flushall()
            publish(settings, "signals.process", [[0]])
            before = _used_memory(client)
            fill()
            after = _used_memory(client)
            out[what] = (after - before) / messages
        client.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=2_000)
    parser.add_argument("--entries", type=int, default=100)
    parser.add_argument("--signals-per-user", type=int, default=2)
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args(argv)
    db = database_footprint(args.users, args.entries, args.signals_per_user)
    print(
        f"{db['users']:,} users x {db['entries']} entries, {db['signals']:,} signals; "
        f"reverie run --all took {db['run_seconds']:.1f} s: {json.dumps(db['report'])}\n"
    )
    print("| table | rows | rows per user | bytes | bytes per user |")
    print("| --- | ---: | ---: | ---: | ---: |")
    total = 0
    for table, size in db["tables"].items():
        total += size["bytes"]
        print(
            f"| `{table}` | {size['rows']:,} | {size['rows'] / db['users']:.2f} | {size['bytes']:,} "
            f"| {size['bytes'] / db['users']:,.0f} |"
        )
    print(f"| all | | | {total:,} | {total / db['users']:,.0f} |\n")
    for what, per in redis_footprint(args.messages).items():
        print(f"Redis, {what}: {per:,.0f} bytes each ({args.messages:,} waiting)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
