"""The sweep benchmark (P1) runs end to end in quick mode: its three ways did the same work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_benchmark_quick_mode_runs_three_ways_that_do_the_same_work(pg_settings: object) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "P1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={
            "REVERIE_BENCH_PG_ADMIN_URL": PG_ADMIN_URL,
            "PATH": "/usr/bin:/bin",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| P1 ")]
    assert any("real path (dispatcher -> Redis -> celery worker" in row for row in rows), done.stdout
    assert any(row.startswith("| P1 | floor:") for row in rows), done.stdout
    assert any(row.startswith("| P1 | per-row") for row in rows), done.stdout
    same = [row for row in rows if "same work by all three ways" in row]
    assert len(same) == 1, done.stdout
    cells = [cell.strip() for cell in same[0].strip("|").split("|")]
    # measure, what, figure, baseline, ratio, goal, verdict
    assert cells[4] == "same rows" and cells[6] == "pass", same[0]
    assert "archived+removed" in cells[2] and not cells[2].startswith("0 archived"), same[0]
