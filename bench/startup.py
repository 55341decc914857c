"""P6: ``reverie --help`` start-up time against the bare interpreter's.

Runs the installed console script (``reverie`` beside this interpreter) with
``--help`` and ``python -c pass`` with the same interpreter, alternately, each as a
subprocess, and keeps the median wall time of each. Goal: ``reverie --help`` under half
a second. A second row lists the heavy packages imported at start-up (read from
``python -X importtime``): the CLI imports each command's dependencies only when that
command runs, so none of them should be there.

    python -m bench P6
    python bench/startup.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.table import Row, ratio, render, seconds

GOAL_SECONDS = 0.5
RUNS = 15
QUICK_RUNS = 3
#: Packages that cost tenths of a second each to import and that ``--help`` never needs.
HEAVY = ("litellm", "celery", "kombu", "sqlalchemy", "alembic", "psycopg", "redis", "jsonschema", "prometheus_client")


def console_script() -> Path:
    """The ``reverie`` script installed with this interpreter."""
    script = Path(sys.executable).parent / "reverie"
    if not script.exists():
        raise SystemExit(f"no console script at {script}: pip install -e . first")
    return script


def _wall(argv: list[str], cwd: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed


def heavy_imports(script: Path, cwd: str, env: dict[str, str]) -> list[str]:
    """Top-level packages from ``HEAVY`` that ``reverie --help`` imports."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(script), "--help"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    modules = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    return sorted(modules & set(HEAVY))


def measure(quick: bool) -> list[Row]:
    """The P6 rows (``quick``: a few runs each instead of ``RUNS``)."""
    runs = QUICK_RUNS if quick else RUNS
    script = console_script()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with tempfile.TemporaryDirectory() as cwd:  # no stray .env read from the working directory
        cli: list[float] = []
        bare: list[float] = []
        _wall([str(script), "--help"], cwd, env)  # warm the file cache
        for _ in range(runs):
            cli.append(_wall([str(script), "--help"], cwd, env))
            bare.append(_wall([sys.executable, "-c", "pass"], cwd, env))
        heavy = heavy_imports(script, cwd, env)
    cli_s, bare_s = statistics.median(cli), statistics.median(bare)
    return [
        Row(
            "P6",
            f"reverie --help, median of {runs}",
            seconds(cli_s),
            baseline=f"{seconds(bare_s)} (python -c pass)",
            ratio=ratio(cli_s, bare_s),
            goal=f"< {seconds(GOAL_SECONDS)}",
            passed=cli_s < GOAL_SECONDS,
        ),
        Row(
            "P6",
            "heavy packages imported by reverie --help",
            ", ".join(heavy) or "none",
            goal="none of " + "/".join(HEAVY[:3]) + "/...",
            passed=not heavy,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few runs each: a smoke run")
    args = parser.parse_args(argv)
    rows = measure(args.quick)
    print(render(rows))
    return 0 if all(r.passed is not False for r in rows) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
