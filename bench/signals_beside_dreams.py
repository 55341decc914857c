"""P8: how long a signal waits while beat's dream chunks run, on one shared worker and on
the two workers docker-compose.yml and ops/k8s run.

Real processes: a throwaway ``redis-server``, ``celery worker`` processes with the
project's configuration, and ``reverie beat``, against a seeded PostgreSQL database
whose users are all due. Once the first dream run has started, a producer inserts one
``session_end`` signal every two seconds with plain SQL (no wake-up of its own), and
each signal's wait is read from the database: ``processed_at - enqueued_at``.

* **shared** (the baseline): one worker, ``-Q signals,dreams,housekeeping -c 2``;
* **split** (what is shipped): ``-Q signals -c 2`` and ``-Q dreams,housekeeping -c 2``.

Dream chunks of ``--chunk`` users (``REVERIE_DISPATCH_CHUNK_SIZE``; 1,000 by default, so
that a chunk runs for tens of seconds here, as chunks of 100 users did against a model).
Goal: the split's p99 wait under 5 s (a signal is not held behind a chunk).

    python -m bench.signals_beside_dreams
    python -m bench.signals_beside_dreams --users 2000 --chunk 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from bench.profiles import _migrated, _seed
from bench.sweep import _url, databases
from bench.table import Row, render
from bench.workload import MemoryWorkload
from tests.processes import Db, RedisServer, Service, session_end_payload

GOAL_P99_SECONDS = 5.0
SIGNALS = 20
WAYS = {"shared": ["signals,dreams,housekeeping"], "split": ["dreams,housekeeping", "signals"]}


def _log(message: str) -> None:
    print(f"  [P8] {message}", file=sys.stderr, flush=True)


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}")
        time.sleep(0.5)


def waits(way: str, template: str, make: Callable[[str | None], str], chunk: int, signals: int) -> list[float]:
    """Each signal's wait (seconds), on a fresh copy of the seeded database."""
    url = _url(make(template))
    with tempfile.TemporaryDirectory(prefix="reverie-p8-") as tmp_dir:
        tmp = Path(tmp_dir)
        redis = RedisServer(tmp)
        redis.start()
        service = Service(
            tmp,
            url.replace("postgresql://", "postgresql+psycopg://", 1),
            redis.url(0),
            REVERIE_LOG_HASH_KEY="p8-bench-key-not-a-secret-0000000",
            REVERIE_DISPATCH_CHUNK_SIZE=str(chunk),
        )
        db = Db(url)
        try:
            for number, queues in enumerate(WAYS[way], start=1):
                service.worker(2, queues=queues)
                _wait(f"worker {number} ready", lambda n=number: service.worker_ready(n), 120)
            service.beat()
            _wait("the first dream run", lambda: db.value("SELECT count(*) FROM dream_runs") > 0, 120)
            ids = []
            for n in range(signals):
                ids.append(db.insert_signal("session_end", f"p8-user-{n}", session_end_payload(n)))
                time.sleep(2)
            _wait("every signal done", lambda: db.statuses(ids).get("done", 0) == len(ids), 600)
            rows = db.rows(
                "SELECT extract(epoch FROM processed_at - enqueued_at)::float8 FROM dream_signals WHERE id = ANY(%s)",
                ids,
            )
            finished = db.value("SELECT count(*) FROM dream_runs WHERE status <> 'running'")
            _log(f"{way}: {len(rows)} signals, dream runs finished meanwhile: {finished}")
            return [float(r[0]) for r in rows]
        finally:
            service.stop_all()
            db.close()
            redis.stop()


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def run(users: int, entries: int, chunk: int, signals: int) -> list[Row]:
    with databases("reverie_p8") as make:
        template = _migrated(make)
        rows = _seed(_url(template), MemoryWorkload(seed=7, users=users, entries=entries), due=True)
        _log(f"seeded {rows:,} rows ({users:,} users x {entries}), chunks of {chunk}")
        found = {way: waits(way, template, make, chunk, signals) for way in WAYS}
    shared, split = found["shared"], found["split"]
    size = f"{users:,} users due x {entries} entries, chunks of {chunk:,}, {signals} signals 2 s apart"
    return [
        Row(
            "P8",
            f"signal wait while dream chunks run, one shared worker (-Q signals,dreams,housekeeping): "
            f"p50 / p99, {size}",
            f"{statistics.median(shared):.1f} / {_p99(shared):.1f} s",
        ),
        Row(
            "P8",
            f"signal wait while dream chunks run, split workers (-Q signals; -Q dreams,housekeeping): "
            f"p50 / p99, {size}",
            f"{statistics.median(split):.1f} / {_p99(split):.1f} s",
            f"shared {_p99(shared):.1f} s",
            f"{_p99(split) / max(_p99(shared), 1e-9):.3f}x",
            f"p99 < {GOAL_P99_SECONDS:g} s",
            _p99(split) < GOAL_P99_SECONDS,
        ),
    ]


def measure(quick: bool) -> list[Row]:
    if quick:
        return run(users=300, entries=10, chunk=100, signals=3)
    return run(users=6_000, entries=50, chunk=1_000, signals=SIGNALS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.signals_beside_dreams", description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=6_000)
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=1_000, help="users per dream chunk")
    parser.add_argument("--signals", type=int, default=SIGNALS)
    args = parser.parse_args(argv)
    rows = run(args.users, args.entries, args.chunk, args.signals)
    print(render(rows))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
