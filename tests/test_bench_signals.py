"""The signal benchmarks (P2 throughput, P5 worker memory) run end to end in quick mode.

Quick mode proves the benchmark works (real worker processes, a throwaway database
and Redis, every row of the table present), not how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]


def _bench_databases() -> set[str]:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'reverie_bench_sig_%'").fetchall()
    return {str(row[0]) for row in rows}


def test_quick_p2_and_p5_print_their_rows_and_clean_up(pg_settings: object) -> None:
    before = _bench_databases()
    env = {**os.environ, "REVERIE_BENCH_PG_ADMIN_URL": PG_ADMIN_URL, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json", "P2", "P5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    p2 = [r for r in rows if r["measure"] == "P2"]
    p5 = [r for r in rows if r["measure"] == "P5"]
    whats = " | ".join(r["what"] for r in p2)
    for part in ("no-op Celery task", "activity signals", "session_end signals", "latency p50", "latency p99"):
        assert part in whats
    activity = next(r for r in p2 if r["what"].startswith("activity signals"))
    assert activity["figure"].endswith("signals/s") and activity["baseline"].endswith("tasks/s")
    assert activity["verdict"] in ("pass", "MISS")
    # Plain SQL producers: idle and at half max, each beside the helper's latency.
    sql_rows = [r for r in p2 if r["what"].startswith("plain SQL INSERT")]
    assert len(sql_rows) == 4
    assert all(r["baseline"].endswith("(enqueue_signal)") for r in sql_rows)
    assert [r["verdict"] for r in sql_rows if r["goal"] != "-"] == ["pass", "pass"]
    # Every signal of the memory run was processed, and parent and both children were sampled.
    assert p5[0]["verdict"] == "pass", p5[0]
    assert p5[0]["baseline"].startswith("key matching off: 200 done in "), p5[0]
    names = {r["what"].split(":")[0] for r in p5[1:]}
    processes = ("parent", "child 1", "child 2")
    assert names == {f"{size} {name}" for size in ("RSS", "PSS") for name in processes} | {"PSS total"}
    assert all(r["figure"].endswith("MB") for r in p5[1:])
    # The worker's total beside the same stream with key matching off, in the same run.
    totals = [r for r in p5 if r["what"].startswith("PSS total")]
    assert len(totals) == 2
    assert all(r["baseline"].endswith("MB (key matching off)") for r in totals)
    assert totals[0]["goal"] == "<= 520 MB" and totals[0]["verdict"] in ("pass", "MISS")
    # No worker, Redis or database left behind.
    assert _bench_databases() == before
    assert "| P2 " in done.stdout and "| P5 " in done.stdout
