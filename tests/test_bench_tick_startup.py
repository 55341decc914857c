"""``python -m bench --quick P3 P6`` runs end to end and prints their rows (not a speed check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]


def test_quick_p3_and_p6_print_their_rows(pg_settings: object) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json", "P3", "P6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "REVERIE_BENCH_PG_ADMIN_URL": PG_ADMIN_URL, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("| P")]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(table) == len(rows)
    p3 = [r for r in rows if r["measure"] == "P3"]
    p6 = [r for r in rows if r["measure"] == "P6"]
    assert [r["what"].split(" (")[0] for r in p3] == [
        "tick: 20,000 users, 200 due",
        "tick: 2,000 users, 200 due",
        "tick: 20,000 users, 20 due",
        "next tick, nobody due",
    ]
    # Every due user was claimed: the tick did the real work it was timed for.
    assert "(claimed 200)" in p3[0]["what"] and "(claimed 20)" in p3[2]["what"]
    assert p3[0]["ratio"].endswith("x") and p3[2]["ratio"].endswith("x")
    assert all(r["figure"].endswith(("ms", " s")) for r in p3)
    assert [r["what"] for r in p6] == [
        "reverie --help, median of 3",
        "heavy packages imported by reverie --help",
    ]
    assert "python -c pass" in p6[0]["baseline"] and p6[0]["ratio"].endswith("x")
    assert p6[0]["verdict"] in ("pass", "MISS")
