"""P4: how much of a cost cap summarization really uses, and that it never passes it.

Seeds users whose summarizable groups cost far more than the cap (the offline model,
priced by ``REVERIE_LLM_INPUT_COST_PER_TOKEN`` / ``REVERIE_LLM_OUTPUT_COST_PER_TOKEN``)
into a throwaway PostgreSQL database, then runs the pass ``reverie run --all`` makes
(:func:`schedules.cron.run_once`, through the real gateway and budgets):

* run cap: one pass; every user has far more groups than ``maxCostPerRun`` covers, so
  each user's run is stopped by its own cap; figure: the run's recorded spend / cap;
* day cap: two passes race for ``REVERIE_MAX_COST_PER_DAY`` over many users (the
  per-run cap out of the way): two ``reverie run --all --json`` processes, or in quick
  mode two threads of this process (no second litellm import); figure: the day's
  recorded spend / cap.

Goal: at least 95 % of the cap used, never above 100 %, in every run (the table shows
the least and the most). The databases are dropped afterwards.

    python -m bench P4            # or: python bench/cap_utilization.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.table import Row, render, seconds

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
INPUT_PRICE = 1e-6
OUTPUT_PRICE = 2e-6
GOAL = 95.0

# Groups of 5 to 12 entries (one per agent, so each is a group of its own), values of
# varied length: a realistic spread of prompt and reply sizes.
SEED_SQL = """
INSERT INTO usermemories (id, user_id, key, value, category, visibility, source_agent_id,
                          group_ids, conflicted, access_count, created_at, updated_at)
SELECT md5(u::text || ':' || g::text || ':' || e::text),
       'user-' || lpad(u::text, 5, '0'),
       'note_' || e::text,
       to_jsonb('value ' || left(repeat(md5(u::text || g::text || e::text), 3), 16 + (u * 7 + g * 5 + e * 3) %% 60)),
       'context', 'self', 'agent-' || g::text, '[]'::jsonb, false, 0, ts, ts
FROM generate_series(0, %(users)s - 1) AS u,
     generate_series(0, %(groups)s - 1) AS g,
     LATERAL generate_series(0, 4 + (u + g) %% 8) AS e,
     LATERAL (SELECT timezone('utc', now()) - interval '1 day') AS t(ts)
"""


@dataclass(frozen=True)
class Scenario:
    users: int
    groups: int
    run_cap: float
    day_cap: float
    racers: int
    processes: bool


def _url(database: str, driver: str = "postgresql") -> str:
    return driver + "://" + ADMIN_URL.split("://", 1)[1].rsplit("/", 1)[0] + "/" + database


@contextmanager
def throwaway_database() -> Iterator[str]:
    """A fresh, migrated database (its SQLAlchemy URL); dropped afterwards."""
    name = f"reverie_bench_p4_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _url(name, "postgresql+psycopg")
    try:
        from store.migrate import upgrade

        upgrade(_settings(url, 1.0, 1.0))
        yield url
    finally:
        from store.db import dispose_engines

        dispose_engines()
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _reverie(*args: str) -> list[str]:
    return [sys.executable, "-c", "from worker.cli import main; main()", *args]


def _env(url: str, run_cap: float, day_cap: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env.update(
        {
            "REVERIE_DATABASE_URL": url,
            "REVERIE_BROKER_URL": "",
            "REVERIE_LLM_MODEL": "offline",
            "REVERIE_LLM_INPUT_COST_PER_TOKEN": str(INPUT_PRICE),
            "REVERIE_LLM_OUTPUT_COST_PER_TOKEN": str(OUTPUT_PRICE),
            "REVERIE_MAX_COST_PER_RUN": str(run_cap),
            "REVERIE_MAX_COST_PER_DAY": str(day_cap),
            "REVERIE_SUMMARIZE_INTERACTIONS": "true",
            "REVERIE_PRUNE_STALE_AFTER_DAYS": "0",
            "REVERIE_DETECT_CONTRADICTIONS": "false",
            "REVERIE_LOG_LEVEL": "WARNING",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
    )
    return env


def _settings(url: str, run_cap: float, day_cap: float) -> Any:
    """The settings ``reverie run`` would read from :func:`_env`."""
    from worker.settings import Settings

    env = _env(url, run_cap, day_cap)
    values: dict[str, Any] = {
        key.removeprefix("REVERIE_").lower(): value for key, value in env.items() if key.startswith("REVERIE_")
    }
    return Settings(_env_file=None, **values)


def _seed(url: str, users: int, groups: int) -> int:
    with psycopg.connect(_url(url.rsplit("/", 1)[1]), autocommit=True) as conn:
        conn.execute(SEED_SQL, {"users": users, "groups": groups})
        conn.execute("ANALYZE")
        row = conn.execute("SELECT count(*) FROM usermemories").fetchone()
    return int(row[0]) if row else 0


def _run_all(url: str, scenario: Scenario) -> float:
    """``racers`` racing passes over every user (processes or threads); wall seconds."""
    started = time.perf_counter()
    if scenario.processes:
        env = _env(url, scenario.run_cap, scenario.day_cap)
        procs = [
            subprocess.Popen(
                _reverie("run", "--all", "--json"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for _ in range(scenario.racers)
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"reverie run failed ({proc.returncode}): {err.decode()[-800:]}")
            json.loads(out.decode())  # the pass's --json summary line: it finished
        return time.perf_counter() - started

    from schedules.cron import run_once
    from worker.logging_setup import configure_logging

    settings = _settings(url, scenario.run_cap, scenario.day_cap)
    configure_logging(settings)
    errors: list[BaseException] = []

    def race() -> None:
        try:
            run_once(settings, all_users=True)
        except BaseException as exc:  # reported below, after every racer is done
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(scenario.racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def _spend(url: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(spent, limit) of every run total and of the day, from ``dream_spend`` (nano-USD)."""
    with psycopg.connect(_url(url.rsplit("/", 1)[1])) as conn:
        runs = conn.execute(
            "SELECT spent_nano, limit_nano FROM dream_spend WHERE scope = 'run' AND scope_key NOT LIKE '%%/%%'"
        ).fetchall()
        days = conn.execute("SELECT spent_nano, limit_nano FROM dream_spend WHERE scope = 'day'").fetchall()
        leaked = conn.execute("SELECT coalesce(sum(reserved_nano), 0) FROM dream_spend").fetchone()
    if leaked and leaked[0]:
        raise RuntimeError(f"{leaked[0]} nano-USD still reserved after the runs finished")
    return [(int(s), int(lim)) for s, lim in runs], [(int(s), int(lim)) for s, lim in days]


def _row(what: str, shares: list[float], detail: str) -> Row:
    low, high = min(shares), max(shares)
    return Row(
        measure="P4",
        what=what,
        figure=f"{low:.1f} % (least) .. {high:.1f} % (most) {detail}",
        goal=f">= {GOAL:.0f} % of the cap, never above 100 %",
        passed=low >= GOAL and high <= 100.0,
    )


def run_cap_row(quick: bool) -> Row:
    # Each user's groups would cost several times the run cap.
    scenario = Scenario(
        users=2 if quick else 12,
        groups=30 if quick else 150,
        run_cap=0.008 if quick else 0.02,
        day_cap=100.0,
        racers=1,
        processes=False,
    )
    with throwaway_database() as url:
        _seed(url, scenario.users, scenario.groups)
        wall = _run_all(url, scenario)
        runs, _ = _spend(url)
    shares = [100.0 * spent / limit for spent, limit in runs if limit]
    if len(shares) != scenario.users:
        raise RuntimeError(f"expected {scenario.users} runs, found {len(shares)}")
    detail = (
        f"of maxCostPerRun {scenario.run_cap} USD over {len(shares)} runs "
        f"({scenario.groups} groups each, {seconds(wall)})"
    )
    return _row("run-cap utilization (spend / maxCostPerRun)", shares, detail)


def day_cap_row(quick: bool) -> Row:
    # Many users, two racing processes, the day cap far below the work.
    scenario = Scenario(
        users=8 if quick else 50,
        groups=8 if quick else 16,
        run_cap=100.0,
        day_cap=0.008 if quick else 0.1,
        racers=2,
        processes=not quick,
    )
    rounds = 1 if quick else 3
    shares: list[float] = []
    wall = 0.0
    for _ in range(rounds):
        with throwaway_database() as url:
            _seed(url, scenario.users, scenario.groups)
            wall += _run_all(url, scenario)
            _, days = _spend(url)
        if len(days) != 1:
            raise RuntimeError(f"expected one day budget, found {len(days)}")
        shares += [100.0 * spent / limit for spent, limit in days]
    detail = (
        f"of REVERIE_MAX_COST_PER_DAY {scenario.day_cap} USD, {rounds} day(s), {scenario.users} users, "
        f"{scenario.racers} racing {'processes' if scenario.processes else 'threads'} ({seconds(wall)})"
    )
    return _row("day-cap utilization (spend / day cap)", shares, detail)


def measure(quick: bool) -> list[Row]:
    return [run_cap_row(quick), day_cap_row(quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny numbers: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    rows = measure(args.quick)
    print(render(rows))
    return 0 if all(r.passed is not False for r in rows) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
