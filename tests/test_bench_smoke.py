"""The sweep benchmark runs end to end in quick mode (tiny numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_ADMIN_URL

BENCH = Path(__file__).resolve().parents[1] / "bench" / "dream_sweep.py"


def test_bench_quick_mode(pg_settings: object) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--users", "5", "--entries", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"REVERIE_BENCH_PG_ADMIN_URL": PG_ADMIN_URL, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "-- prune" in done.stdout and "Delete on usermemories" in done.stdout
    figure = json.loads(done.stdout.strip().splitlines()[-1])
    assert figure["users"] == 5 and figure["users_processed"] == 5 and figure["seconds"] > 0
