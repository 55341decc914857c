"""The sweep benchmark (P1) runs end to end in quick mode: its ways all did the same work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]


def quick_bench(measure: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m bench --quick MEASURE`` as a process of its own, on the test server."""
    return bench_process("bench", "--quick", measure, timeout=timeout)


def bench_process(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS...`` as a process of its own, on the test server."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={
            "REVERIE_BENCH_PG_ADMIN_URL": PG_ADMIN_URL,
            "PATH": "/usr/bin:/bin",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        },
    )


def test_sweep_benchmark_quick_mode_runs_four_ways_that_do_the_same_work(pg_settings: object) -> None:
    done = quick_bench("P1", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| P1 ")]
    assert any("real path (dispatcher -> Redis -> celery worker" in row for row in rows), done.stdout
    assert any(row.startswith("| P1 | floor:") for row in rows), done.stdout
    assert any("cron pass (`reverie run --all`" in row for row in rows), done.stdout
    assert any("cron pass as above with profiles built" in row for row in rows), done.stdout
    assert any(row.startswith("| P1 | per-row") for row in rows), done.stdout
    same = [row for row in rows if "same work by every way" in row]
    assert len(same) == 1, done.stdout
    cells = [cell.strip() for cell in same[0].strip("|").split("|")]
    # measure, what, figure, baseline, ratio, goal, verdict
    assert cells[4] == "same rows" and cells[6] == "pass", same[0]
    assert "archived+removed" in cells[2] and not cells[2].startswith("0 archived"), same[0]


def test_profile_benchmark_quick_mode_reads_and_sweeps_and_rebuilds_nobody_unchanged(pg_settings: object) -> None:
    done = quick_bench("P7", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| P7 ")]
    reads = [row for row in rows if "profile read" in row]
    assert len(reads) == 4 and any("plain SQL" in row for row in reads), done.stdout
    assert all("ms" in row.split("|")[3] for row in reads), done.stdout
    assert any("with profiles built" in row and "profiles off" in row for row in rows), done.stdout
    (again,) = [row for row in rows if "nobody changed" in row]
    cells = [cell.strip() for cell in again.strip("|").split("|")]
    # measure, what, figure, baseline, ratio, goal, verdict
    assert cells[2].startswith("0 rebuilt") and cells[6] == "pass", again
    # A later sweep rebuilds exactly the users the application changed.
    (later,) = [row for row in rows if "changed by the application" in row]
    changed = re.search(r"profiles on: (\d+) users", later)
    rebuilt = re.search(r"; (\d+) users' profiles rebuilt", later)
    assert changed and rebuilt and int(changed[1]) > 0 and rebuilt[1] == changed[1], later


def test_profile_step_benchmark_stops_the_build_after_each_step(pg_settings: object) -> None:
    # Each variant checks its own sweeps (every user processed; profiles written by the
    # whole build only, none by the stopped ones), and fails the run otherwise.
    done = bench_process("bench.profile_steps", "--users", "20", "--rounds", "2", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| P7 ")]
    assert len(rows) == 4, done.stdout
    assert all("profiles off" in row for row in rows[1:]) and rows[-1].count("whole first build") == 1, done.stdout


def test_the_stopped_builds_of_the_step_benchmark_send_nothing_to_the_profiles_table(pg_settings: Any) -> None:
    # ``read`` and ``built`` must not write at all (no savepoint, no delete of the old
    # profiles either), or the steps' split would hide part of the write in them.
    from sqlalchemy import event

    from bench.profile_steps import stopped_after
    from store.db import get_engine
    from tasks.dream import dream_users
    from tests.dream_seed import entry, seed

    users = [f"s{i}" for i in range(3)]
    seed(pg_settings, [entry(u, "home_city", "Lisbon", visibility="global") for u in users])
    seen: list[str] = []

    def writes(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "dream_profiles" in statement and not statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    event.listen(get_engine(pg_settings), "before_cursor_execute", writes)
    for variant in ("read", "built"):
        with stopped_after(variant):
            assert {o.status for o in dream_users(pg_settings, users)} == {"succeeded"}
        assert seen == [], (variant, seen)


def test_signal_wait_benchmark_quick_mode_runs_both_deployments_with_real_processes(pg_settings: object) -> None:
    done = quick_bench("P8", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| P8 ")]
    assert len(rows) == 2, done.stdout
    assert "one shared worker" in rows[0] and "split workers" in rows[1], done.stdout
    for row in rows:
        assert re.search(r"\| \d+\.\d / \d+\.\d s \|", row), row
    # Each way processed every signal while beat's dream runs went on.
    assert done.stderr.count("3 signals, dream runs finished meanwhile") == 2, done.stderr[-3000:]
