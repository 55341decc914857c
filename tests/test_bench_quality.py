"""The memory-quality benchmark (Q1) runs end to end in quick mode, with its baseline beside it."""

from __future__ import annotations

import re

from tests.test_bench_smoke import quick_bench


def test_quality_benchmark_quick_mode_measures_both_ways(pg_settings: object) -> None:
    done = quick_bench("Q1", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        cells[1]: cells
        for line in done.stdout.splitlines()
        if line.startswith("| Q1 ")
        for cells in [[cell.strip() for cell in line.strip().strip("|").split("|")]]
    }
    assert len(rows) == 6, done.stdout
    [pairs] = [cells for what, cells in rows.items() if what.startswith("(user, concept) pairs")]
    held, total = map(int, re.match(r"(\d+) of (\d+)", pairs[2]).groups())  # type: ignore[union-attr]
    held_before, total_before = map(int, re.match(r"(\d+) of (\d+)", pairs[3]).groups())  # type: ignore[union-attr]
    # The same corpus both ways; showing known entries and matching keys can only help.
    assert total == total_before > 0 and held >= held_before
    [cost] = [cells for what, cells in rows.items() if what.startswith("model calls")]
    assert cost[2].startswith("1.00 calls") and cost[3].startswith("1.00 calls")
