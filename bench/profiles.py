"""P7: profiles: how fast they are read, and what building them adds to a dream sweep.

(a) **Read latency**, on PostgreSQL with 100,000 users' profiles in ``dream_profiles``:
real profiles built from a seeded workload (:mod:`bench.workload`) for the first
``TEMPLATE_USERS`` users, copied to the others (each user keeps an agent-less profile and
one per agent). Random users and agents are then read, one read at a time, through
:func:`worker.profiles_reader.get_for_prompt` (in the caller's session, as an application
would; and with a budget smaller than the stored one, the cut made without a tokenizer)
and through the plain SQL any language would run (psycopg). p50 and p99; goal p99 < 2 ms.

(b) **A dream sweep with profiles on and off**, on two copies of one seeded database
(``CREATE DATABASE ... TEMPLATE``): the pass ``reverie run`` makes (prune, contradictions,
no summaries), every user due, once with ``REVERIE_BUILD_PROFILES=false`` and once with
profiles built (every user's first build: the most a sweep can have to build); the
pairs are alternated over ``--rounds`` pairs of copies and the best of each kept.
Goal: on <= 1.2x off, measured in the same run.

(c) **A second sweep where nobody changed**, on the profiles-on copy: every user is due
again and no row changed, so no profile may be rebuilt (goal 0), counted in the
database (profiles whose ``built_at`` is after the second sweep began).

(d) **A later sweep after the application changed a share of the users** (one entry
each, ``--changed``, a tenth by default), on both copies of each pair: what a nightly
sweep costs once the profiles exist, against the same sweep with them off. Shown
beside (b), not instead of it: (b) is the most a sweep can have to build.

    python -m bench.profiles                                  # 100,000 users; sweep 1,000 x 50
    python -m bench.profiles --users 20000 --sweep-users 500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import psycopg

from bench.sweep import REVERIE, _env, _url, databases
from bench.table import Row, ratio, render, seconds
from bench.workload import MemoryWorkload, seed_memories

if TYPE_CHECKING:
    from worker.settings import Settings

GOAL_P99_SECONDS = 0.002
GOAL_SWEEP_RATIO = 1.2
#: Users whose profiles are built for real; the others get copies of theirs.
TEMPLATE_USERS = 500
READS = 5_000
READ_SQL = (
    "SELECT text, tokens, budget, entries_included, entries_left_out, built_at FROM dream_profiles "
    "WHERE user_id = %s AND agent_id IN (%s, '') ORDER BY agent_id DESC LIMIT 1"
)
COPY_SQL = """
INSERT INTO dream_profiles (user_id, agent_id, text, tokens, budget, entries_included, entries_left_out,
    layout, tokenizer, built_at, source_rows, source_updated_at, source_recalls, source_conflicted, source_content)
SELECT 'user-' || lpad(g::text, 6, '0'), p.agent_id, p.text, p.tokens, p.budget, p.entries_included,
    p.entries_left_out, p.layout, p.tokenizer, p.built_at, p.source_rows, p.source_updated_at, p.source_recalls,
    p.source_conflicted, p.source_content
FROM generate_series(%(first)s::int, %(last)s::int) AS g
JOIN dream_profiles p ON p.user_id = 'user-' || lpad((g %% %(template)s::int)::text, 6, '0')
"""


def _log(message: str) -> None:
    print(f"  [P7] {message}", file=sys.stderr, flush=True)


def load_average() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def _settings(url: str, **overrides: object) -> Settings:
    from worker.settings import Settings

    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=url.replace("postgresql://", "postgresql+psycopg://", 1),
        broker_url="",
        summarize_interactions=False,
        log_level="WARNING",
        **overrides,
    )


def _migrated(make: Callable[[str | None], str]) -> str:
    import subprocess

    name = make(None)
    subprocess.run([REVERIE, "migrate"], env=_env(_url(name)), check=True, capture_output=True)
    return name


def _seed(url: str, workload: MemoryWorkload, *, due: bool) -> int:
    with psycopg.connect(url) as conn:
        rows = seed_memories(conn, workload)
        if due:
            conn.execute(
                "INSERT INTO dream_user_state (user_id, next_dream_at) SELECT DISTINCT user_id, "
                "timezone('utc', now()) - interval '1 minute' FROM usermemories "
                "ON CONFLICT (user_id) DO UPDATE SET next_dream_at = EXCLUDED.next_dream_at"
            )
        conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE usermemories")
    return rows


# -- (a) reads -------------------------------------------------------------------------------


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def build_profiles(url: str, users: int, entries: int) -> int:
    """Real profiles for the template users, copied to ``users`` users; returns rows."""
    from store.db import dispose_engines, session_scope
    from tasks import profiles
    from worker.policy import book

    template = min(TEMPLATE_USERS, users)
    workload = MemoryWorkload(seed=7, users=template, entries=entries)
    _seed(url, workload, due=False)
    settings = _settings(url)
    ids = [workload.user_id(u) for u in range(template)]
    started = time.perf_counter()
    for start in range(0, len(ids), 100):
        with session_scope(settings) as session:
            profiles.refresh(session, settings, ids[start : start + 100], book=book(settings, {}))
    _log(f"built the profiles of {template:,} users in {time.perf_counter() - started:.1f}s")
    dispose_engines()
    with psycopg.connect(url) as conn:
        step = 20_000
        for first in range(template, users, step):
            conn.execute(COPY_SQL, {"first": first, "last": min(users, first + step) - 1, "template": template})
            conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE dream_profiles")
        row = conn.execute("SELECT count(*), pg_total_relation_size('dream_profiles') FROM dream_profiles").fetchone()
    assert row is not None
    _log(f"{row[0]:,} profiles of {users:,} users, {row[1] / 2**20:.0f} MiB")
    return int(row[0])


def read_latency(url: str, users: int, reads: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 (seconds) of one read, four ways."""
    from sqlalchemy.orm import Session

    from store.db import dispose_engines, get_engine
    from worker.profiles_reader import get_for_prompt

    settings = _settings(url)
    rng = random.Random(11)
    agents = ["agent-0", "agent-1", "agent-2", "agent-3", None]
    picks = [(f"user-{rng.randrange(users):06d}", rng.choice(agents)) for _ in range(reads)]
    out: dict[str, tuple[float, float]] = {}
    with Session(get_engine(settings)) as session:
        for label, budget in (
            ("get_for_prompt in the caller's transaction", None),
            ("get_for_prompt in the caller's transaction, budget 100 (cut without a tokenizer)", 100),
        ):
            samples = []
            for index, (user, agent) in enumerate(picks[:200] + picks):
                started = time.perf_counter()
                profile = get_for_prompt(user, agent, budget, session=session)
                if index >= 200:  # the first 200: warm-up (connection, statement cache)
                    samples.append(time.perf_counter() - started)
                assert profile.built_at is not None
                if index % 50 == 49:
                    session.rollback()  # the application's transaction ends now and then
            session.rollback()
            out[label] = _percentiles(samples)
        samples = []
        for index, (user, agent) in enumerate(picks[:200] + picks):
            started = time.perf_counter()
            get_for_prompt(user, agent, settings=settings)
            if index >= 200:
                samples.append(time.perf_counter() - started)
        own = "get_for_prompt with no session given (a connection of its read pool, the SELECT alone: no transaction)"
        out[own] = _percentiles(samples)
    dispose_engines()
    with psycopg.connect(url, autocommit=True) as conn:
        samples = []
        for index, (user, agent) in enumerate(picks[:200] + picks):
            started = time.perf_counter()
            row = conn.execute(READ_SQL, (user, agent or "")).fetchone()
            if index >= 200:
                samples.append(time.perf_counter() - started)
            assert row is not None
        out["plain SQL (psycopg, autocommit)"] = _percentiles(samples)
    return out


# -- (b), (c) sweeps -----------------------------------------------------------------------------


def _sweep(url: str, **overrides: object) -> tuple[float, int]:
    """One ``reverie run`` pass over every due user; (seconds, users processed)."""
    from schedules.cron import run_once
    from store.db import dispose_engines

    settings = _settings(url, **overrides)
    started = time.perf_counter()
    report = run_once(settings)
    took = time.perf_counter() - started
    dispose_engines()
    if report.users_failed or report.errors:
        raise RuntimeError(f"the sweep failed: {report.errors[:3]}")
    return took, report.users_processed


def _application_changes(url: str, share: float) -> int:
    """The application updates one entry (the first by id) of about ``share`` of the
    users, picked by a hash of their id (the same ones on every copy), and every user is
    made due again; returns the users changed."""
    step = max(1, round(1 / share))
    with psycopg.connect(url, autocommit=True) as conn:
        changed = conn.execute(
            "WITH picked AS (SELECT user_id FROM (SELECT DISTINCT user_id FROM usermemories) u"
            "  WHERE abs(hashtext(user_id)) %% %s = 0),"
            " one AS (SELECT DISTINCT ON (user_id) user_id, id FROM usermemories"
            "  WHERE user_id IN (SELECT user_id FROM picked) ORDER BY user_id, id)"
            " UPDATE usermemories m SET value = to_jsonb('changed by the application'::text),"
            "  updated_at = timezone('utc', now()) FROM one WHERE m.user_id = one.user_id AND m.id = one.id",
            (step,),
        ).rowcount
        conn.execute("UPDATE dream_user_state SET next_dream_at = timezone('utc', now()) - interval '1 minute'")
    return changed


def sweeps(
    make: Callable[[str | None], str],
    users: int,
    entries: int,
    rounds: int,
    share: float = 0.1,
    later_repeats: int = 3,
) -> dict[str, float]:
    """Sweeps with profiles off and on, alternated over ``rounds`` pairs of copies (the
    best of each kept: on a shared machine the others' load only adds time), then a
    second sweep of the last profiles-on copy, with nobody changed."""
    template = _migrated(make)
    rows = _seed(_url(template), MemoryWorkload(seed=42, users=users, entries=entries), due=True)
    _log(f"sweep: seeded {rows:,} rows ({users:,} users x {entries})")
    copies = [(_url(make(template)), _url(make(template))) for _ in range(rounds)]
    # Warm-up on the template itself (its copies are made): imports, the tokenizer,
    # connections, so no timed sweep pays for them.
    from schedules.cron import run_once
    from store.db import dispose_engines

    run_once(_settings(_url(template)), users=[f"user-{u:06d}" for u in range(min(users, 20))])
    dispose_engines()
    # As `reverie run` and the worker do once loaded: the collector is kept off it.
    from worker.heap import freeze_loaded

    freeze_loaded()
    offs, ons = [], []
    for off_db, on_db in copies:
        off, done_off = _sweep(off_db, build_profiles=False)
        on, done_on = _sweep(on_db)
        _log(f"sweep, profiles off: {off:.2f}s, on: {on:.2f}s")
        if not done_off == done_on == users:
            raise RuntimeError(f"users processed: off {done_off}, on {done_on}, not {users}")
        offs.append(off)
        ons.append(on)
    on_db = copies[-1][1]
    with psycopg.connect(on_db, autocommit=True) as conn:
        built = conn.execute("SELECT count(*) FROM dream_profiles").fetchone()
        conn.execute("UPDATE dream_user_state SET next_dream_at = timezone('utc', now()) - interval '1 minute'")
        mark = conn.execute("SELECT timezone('utc', statement_timestamp())").fetchone()
    assert built is not None and mark is not None
    again, done_again = _sweep(on_db)
    with psycopg.connect(on_db, autocommit=True) as conn:
        rebuilt = conn.execute("SELECT count(*) FROM dream_profiles WHERE built_at >= %s", (mark[0],)).fetchone()
    assert rebuilt is not None
    _log(f"second sweep, nobody changed: {again:.2f}s, {rebuilt[0]} profiles rebuilt")
    if done_again != users:
        raise RuntimeError(f"users processed by the second sweep: {done_again}, not {users}")
    later_offs, later_ons, rebuilt_each = [], [], set()
    # A later sweep is short (under a second): each pair repeats it, for a steadier best.
    for off_db, on_db in [pair for pair in copies for _ in range(later_repeats)]:
        changed = _application_changes(off_db, share)
        if _application_changes(on_db, share) != changed:
            raise RuntimeError("the two copies were changed differently")
        off, _ = _sweep(off_db, build_profiles=False)
        with psycopg.connect(on_db, autocommit=True) as conn:
            mark = conn.execute("SELECT timezone('utc', statement_timestamp())").fetchone()
        assert mark is not None
        on, _ = _sweep(on_db)
        with psycopg.connect(on_db, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(DISTINCT user_id) FROM dream_profiles WHERE built_at >= %s", (mark[0],)
            ).fetchone()
        assert row is not None
        _log(
            f"later sweep, {changed} users changed by the application: off {off:.2f}s, on {on:.2f}s, "
            f"{row[0]} users' profiles rebuilt"
        )
        later_offs.append(off)
        later_ons.append(on)
        rebuilt_each.add(int(row[0]))
    return {
        "later_off": min(later_offs),
        "later_on": min(later_ons),
        "later_offs": later_offs,  # type: ignore[dict-item]
        "later_ons": later_ons,  # type: ignore[dict-item]
        "changed": float(changed),
        # One count when every repeat rebuilt as many users (it should: the same users changed).
        "later_rebuilt": ", ".join(map(str, sorted(rebuilt_each))),  # type: ignore[dict-item]
        "off": min(offs),
        "on": min(ons),
        "offs": offs,  # type: ignore[dict-item]
        "ons": ons,  # type: ignore[dict-item]
        "again": again,
        "built": float(built[0]),
        "rebuilt": float(rebuilt[0]),
    }


# -- the measure -----------------------------------------------------------------------------


def run(
    users: int, sweep_users: int, entries: int, reads: int, rounds: int = 2, share: float = 0.1, later_repeats: int = 3
) -> list[Row]:
    with databases("reverie_profiles") as make:
        reads_db = _url(_migrated(make))
        count = build_profiles(reads_db, users, entries)
        load_reads = load_average()
        latency = read_latency(reads_db, users, reads)
        _log(f"reads done ({load_reads} before)")
        load_sweeps = load_average()
        sweep = sweeps(make, sweep_users, entries, rounds, share, later_repeats)
    rows = [
        Row(
            "P7",
            f"profile read, {how}: p50 / p99 of {reads:,} random reads, {count:,} profiles of {users:,} users"
            f" ({load_reads})",
            f"{p50 * 1000:.2f} / {p99 * 1000:.2f} ms",
            goal=f"p99 < {GOAL_P99_SECONDS * 1000:g} ms",
            passed=p99 < GOAL_P99_SECONDS,
        )
        for how, (p50, p99) in latency.items()
    ]
    size = f"{sweep_users:,} users x {entries} entries"
    return [
        *rows,
        Row(
            "P7",
            f"dream sweep (reverie run's pass) with profiles built ({int(sweep['built']):,}), {size}, best of "
            f"{rounds} alternated pairs (on {', '.join(seconds(x) for x in sweep['ons'])}; off "
            f"{', '.join(seconds(x) for x in sweep['offs'])}; median of the pairs' own ratios "
            f"{_median_ratio(sweep['ons'], sweep['offs'])}) ({load_sweeps})",
            seconds(sweep["on"]),
            f"profiles off {seconds(sweep['off'])}",
            ratio(sweep["on"], sweep["off"]),
            f"<= {GOAL_SWEEP_RATIO:g}x off",
            sweep["on"] <= GOAL_SWEEP_RATIO * sweep["off"],
        ),
        Row(
            "P7",
            f"later sweep, profiles on: {int(sweep['changed']):,} users ({share:.0%}) changed by the application, "
            f"one entry each; {sweep['later_rebuilt']} users' profiles rebuilt, {size}, best of "
            f"{rounds * later_repeats} alternated pairs ({later_repeats} on each pair of copies) (on "
            f"{', '.join(seconds(x) for x in sweep['later_ons'])}; off "
            f"{', '.join(seconds(x) for x in sweep['later_offs'])})",
            seconds(sweep["later_on"]),
            f"profiles off {seconds(sweep['later_off'])}",
            ratio(sweep["later_on"], sweep["later_off"]),
        ),
        Row(
            "P7",
            f"second sweep, nobody changed: profiles rebuilt, {size}",
            f"{int(sweep['rebuilt'])} rebuilt in {seconds(sweep['again'])}",
            f"profiles off {seconds(sweep['off'])}",
            ratio(sweep["again"], sweep["off"]),
            "0 rebuilt",
            sweep["rebuilt"] == 0,
        ),
    ]


def _median_ratio(ons: Any, offs: Any) -> str:
    """The median of each pair's on/off ratio: steadier than best against best, where
    one fast or slow sweep of either side moves the figure."""
    pairs = list(zip(ons, offs, strict=True))
    return f"{statistics.median(on / off for on, off in pairs):.2f}x"


def measure(quick: bool) -> list[Row]:
    if quick:
        return run(users=1_000, sweep_users=40, entries=20, reads=300, rounds=1, later_repeats=1)
    return run(users=100_000, sweep_users=1_000, entries=50, reads=READS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profiles", description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100_000, help="users with profiles, for the reads")
    parser.add_argument("--sweep-users", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of sweeps (off, on), the best of each kept")
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--reads", type=int, default=READS)
    parser.add_argument("--changed", type=float, default=0.1, help="share of users the application changes, for (d)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.changed <= 1:
        parser.error("--changed is a share of the users: more than 0, at most 1")
    from worker.logging_setup import configure_logging
    from worker.settings import Settings

    configure_logging(Settings(_env_file=None, log_level="WARNING"))  # type: ignore[call-arg]
    started = datetime.now(UTC)
    rows = run(args.users, args.sweep_users, args.entries, args.reads, args.rounds, args.changed)
    print(f"started {started:%Y-%m-%d %H:%M} UTC")
    print(render(rows))
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
