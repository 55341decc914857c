"""P7 by step: what each step of a first profile build adds to a dream sweep.

The sweep of ``python -m bench.profiles`` (b): ``reverie run``'s pass over 1,000 seeded
users, every user's first build. Each round sweeps one fresh copy of the seeded database
per variant, in turn (the order reversed every other round): profiles off, then the
build stopped after each of its steps (stopped in this process for the measure only, by
replacing the next step with one that does nothing):

* ``read``: who changed and their shown rows are read; nothing is built or written;
* ``built``: the profiles are built too, and not written;
* ``whole``: the build as it runs.

Each variant's figure is its best sweep against the best sweep with profiles off (the
goal's measure), and the median of its ratio to the off sweep of the same round.

    python -m bench.profile_steps                  # 8 rounds
    python -m bench.profile_steps --rounds 3 --users 300
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import psycopg

from bench.profiles import GOAL_SWEEP_RATIO, _migrated, _seed, _settings, _sweep, load_average
from bench.sweep import _url, databases
from bench.table import Row, render, seconds
from bench.workload import MemoryWorkload

VARIANTS = ("off", "read", "built", "whole")


def _log(message: str) -> None:
    print(f"  [P7 steps] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stopped_after(variant: str) -> Iterator[None]:
    """The build stopped after ``variant``'s last step, for the sweeps run inside."""
    import tasks.dream
    import tasks.profiles

    def nothing_built(settings: Any, read: Any, **_: Any) -> Any:
        return tasks.profiles.Composed({user_id: [] for user_id in read.users})

    with contextlib.ExitStack() as stopped:
        if variant == "read":
            stopped.enter_context(mock.patch.object(tasks.profiles, "compose", nothing_built))
        if variant in ("read", "built"):
            # Not even the write's savepoint and its delete of the users' old profiles.
            stopped.enter_context(mock.patch.object(tasks.dream, "_save_profiles", lambda *_: ([], [])))
        yield


def _profiles_in(url: str) -> int:
    with psycopg.connect(url) as conn:
        found = conn.execute("SELECT count(*) FROM dream_profiles").fetchone()
    return int(found[0]) if found else 0


def run(users: int, entries: int, rounds: int) -> dict[str, list[float]]:
    taken: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    with databases("reverie_p7steps") as make:
        template = _migrated(make)
        rows = _seed(_url(template), MemoryWorkload(seed=42, users=users, entries=entries), due=True)
        _log(f"seeded {rows:,} rows ({users:,} users x {entries}); {load_average()}")
        # Warm-up on a copy (the template stays as seeded): imports, the tokenizer, connections.
        from schedules.cron import run_once
        from store.db import dispose_engines

        run_once(_settings(_url(make(template))), users=[f"user-{u:06d}" for u in range(min(users, 20))])
        dispose_engines()
        # As `reverie run` and the worker do once loaded: the collector is kept off it.
        from worker.heap import freeze_loaded

        freeze_loaded()
        for index in range(rounds):
            copies = {variant: _url(make(template)) for variant in VARIANTS}
            # Each round in the other order: what drifts within a round favours none.
            for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                with stopped_after(variant):
                    took, done = _sweep(copies[variant], build_profiles=variant != "off")
                if done != users:
                    raise RuntimeError(f"{variant}: {done} users processed, not {users}")
                written = _profiles_in(copies[variant])
                if (written > 0) != (variant == "whole"):
                    raise RuntimeError(f"{variant}: {written} profiles written")
                taken[variant].append(took)
            _log(f"round {index + 1}: " + ", ".join(f"{v} {taken[v][-1]:.2f}s" for v in VARIANTS))
    return taken


def rows_of(taken: dict[str, list[float]], users: int, entries: int) -> list[Row]:
    off = taken["off"]
    out = [Row("P7", f"dream sweep, profiles off, {users:,} users x {entries}, best of {len(off)}", seconds(min(off)))]
    what = {
        "read": "the build's read only (who changed, their shown rows): nothing built or written",
        "built": "the read and the profiles built, not written",
        "whole": "the whole first build",
    }
    for variant in VARIANTS[1:]:
        mine = taken[variant]
        per_round = statistics.median(m / o for m, o in zip(mine, off, strict=True))
        out.append(
            Row(
                "P7",
                f"{what[variant]}, best of {len(mine)} (median of the rounds' ratios {per_round:.2f}x)",
                seconds(min(mine)),
                f"profiles off {seconds(min(off))}",
                f"{min(mine) / min(off):.2f}x",
                f"(the goal, whole build: <= {GOAL_SWEEP_RATIO}x)",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_steps", description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    from worker.logging_setup import configure_logging
    from worker.settings import Settings

    configure_logging(Settings(_env_file=None, log_level="WARNING"))  # type: ignore[call-arg]
    taken = run(args.users, args.entries, args.rounds)
    print(render(rows_of(taken, args.users, args.entries)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
