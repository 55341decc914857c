"""``python -m bench [--quick] [--json] [P1 P2 ...]``: run the measures, print one table.

Each measure lives in a module of its own (see ``MEASURES``) with a
``measure(quick) -> list[Row]`` function. ``--quick`` runs every measure on tiny
numbers: it proves the benchmark works end to end, not how fast anything is.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from bench.table import Row, as_json, render

#: Measure id -> module under ``bench``.
MEASURES = {
    "P1": "bench.sweep",
    "P2": "bench.signal_throughput",
    "P3": "bench.dispatcher_tick",
    "P4": "bench.cap_utilization",
    "P5": "bench.worker_memory",
    "P6": "bench.startup",
    "P7": "bench.profiles",
    "P8": "bench.signals_beside_dreams",
    "Q1": "bench.memory_quality",
}


def machine() -> str:
    cores = os.cpu_count()
    try:
        with open("/proc/meminfo") as meminfo:
            mem_kb = int(meminfo.readline().split()[1])
        memory = f", {mem_kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = ""
    return f"{platform.machine()}, {cores} cores{memory}, Python {platform.python_version()}, {platform.system()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("measures", nargs="*", metavar="P", help="measures to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny numbers: a smoke run, not a measurement")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON after the table")
    args = parser.parse_args(argv)
    chosen = [m.upper() for m in args.measures] or list(MEASURES)
    unknown = [m for m in chosen if m not in MEASURES]
    if unknown:
        parser.error(f"unknown measure(s) {', '.join(unknown)}; choose from {', '.join(MEASURES)}")

    from worker.logging_setup import configure_logging
    from worker.settings import Settings

    # The table goes to stdout alone; what the code under test logs goes to stderr.
    configure_logging(Settings(_env_file=None, log_level="WARNING"))  # type: ignore[call-arg]
    rows: list[Row] = []
    started = time.perf_counter()
    for measure in chosen:
        print(f"== {measure} ({MEASURES[measure]})", file=sys.stderr, flush=True)
        module = importlib.import_module(MEASURES[measure])
        rows.extend(module.measure(args.quick))
    print(
        f"\nmachine: {machine()}; {'quick mode' if args.quick else 'full run'} in "
        f"{time.perf_counter() - started:.0f} s\n"
    )
    print(render(rows))
    if args.json:
        print(as_json(rows))
    return 0 if all(r.passed is not False for r in rows) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
