"""The cap-utilization benchmark (P4) runs end to end in quick mode and prints its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]


def test_bench_p4_quick_mode_prints_both_rows() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env["REVERIE_BENCH_PG_ADMIN_URL"] = PG_ADMIN_URL
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json", "P4"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["measure"], r["what"].split(" (")[0]) for r in rows] == [
        ("P4", "run-cap utilization"),
        ("P4", "day-cap utilization"),
    ]
    for row in rows:
        assert row["figure"].endswith(")") and "%" in row["figure"] and row["verdict"] in ("pass", "MISS")
