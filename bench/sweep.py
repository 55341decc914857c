"""P1: a full dream sweep (prune + contradictions, no model) four ways, on identical copies.

One PostgreSQL database is seeded once (:mod:`bench.workload`) and copied with
``CREATE DATABASE copy TEMPLATE seeded`` for each way:

- **real path**: beat's dispatcher (:func:`schedules.dispatcher.dispatch`) claims the
  due users and sends ``dream.run_users`` chunks through Redis (a throwaway
  ``redis-server``) to a real ``celery worker`` with concurrency 2; timed from the claim
  until every user's ledger row is closed;
- **cron pass**: ``reverie run --all --json`` as a real process (no broker, its
  default ``REVERIE_CRON_CONCURRENCY``), timed from its start to its exit, start-up
  included;
- **floor**: the same archive, delete, event and flag work as a handful of set-based
  statements over the whole table, in one transaction: the least the database can do;
- **per-row**: what a straightforward port of EDDI does: per user, one transaction that
  loads the user's entries, decides in Python, archives and deletes (and records) one
  row at a time, flags one row at a time. At full size it is timed on a seeded random
  sample of users and scaled linearly (the row says so).

The real path and the cron pass run with ``REVERIE_BUILD_PROFILES=false``: the floor
does the maintenance work only, and what profiles add is P7's measure (goal <= 1.2x).
The cron pass is also run with profiles built (the default), shown beside the floor
with the two goals multiplied (2.0 x 1.2 = 2.4x).

All are then checked to have done the same work: the same rows archived and
removed, the same rows flagged, the same contradictions recorded.

    python -m bench.sweep                       # 10,000 users x 100 entries
    python -m bench.sweep --users 1000 --entries 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from bench.table import Row, ratio, render, seconds
from bench.workload import MemoryWorkload, seed_memories

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REVERIE = str(Path(sys.executable).with_name("reverie"))
PRUNE_DAYS = 90
PROTECTED = ("property", "legacy")
GOAL_REAL_RATIO = 1.3
GOAL_CRON_RATIO = 2.0
GOAL_PROFILES_RATIO = 1.2  # P7's goal: what building profiles may add to a sweep
GOAL_SPEEDUP = 30.0
#: Per-row users timed at full size (then scaled): a seeded random sample.
PER_ROW_SAMPLE = 1_000


def _url(database: str) -> str:
    return ADMIN_URL.rsplit("/", 1)[0] + "/" + database


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log(message: str) -> None:
    print(f"  [P1] {message}", file=sys.stderr, flush=True)


# -- databases ---------------------------------------------------------------------------


@contextmanager
def databases(prefix: str) -> Iterator[Callable[[str | None], str]]:
    """``make(template)`` creates a throwaway database (a copy of ``template``); all are
    dropped at the end."""
    made: list[str] = []

    def make(template: str | None) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(query)
        made.append(name)
        return name

    try:
        yield make
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            for name in made:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _env(url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "REVERIE_DATABASE_URL": url,
        "REVERIE_SUMMARIZE_INTERACTIONS": "false",
        "REVERIE_PRUNE_STALE_AFTER_DAYS": str(PRUNE_DAYS),
        "REVERIE_LOG_LEVEL": "WARNING",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **extra,
    }


def seed_template(make: Callable[[str | None], str], workload: MemoryWorkload) -> str:
    """The seeded database: schema, memories, and every user due now."""
    name = make(None)
    url = _url(name)
    subprocess.run([REVERIE, "migrate"], env=_env(url), check=True, capture_output=True)
    started = time.perf_counter()
    with psycopg.connect(url) as conn:
        rows = seed_memories(conn, workload)
        conn.execute(
            "INSERT INTO dream_user_state (user_id, next_dream_at) "
            "SELECT DISTINCT user_id, timezone('utc', now()) - interval '1 minute' FROM usermemories"
        )
        conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        # The seeded tables only: Reverie's own stay as a fresh migrate leaves them (never
        # analyzed, so the planner sizes them by their pages as they grow, as it would on
        # a new install between autovacuum's looks).
        conn.execute("VACUUM ANALYZE usermemories")
        conn.execute("VACUUM ANALYZE dream_user_state")
    took = time.perf_counter() - started
    _log(f"seeded {rows:,} rows ({workload.users:,} users x {workload.entries}) in {took:.1f}s")
    return name


# -- the work done, to compare the three ways ---------------------------------------------


@dataclass(frozen=True)
class Work:
    archived: int
    remaining: int
    flagged: int
    contradictions: int
    archived_digest: str
    flagged_digest: str

    def summary(self) -> str:
        return (
            f"{self.archived:,} archived+removed, {self.flagged:,} flagged, "
            f"{self.contradictions:,} contradictions recorded, {self.remaining:,} left"
        )


def work_done(url: str, users: Sequence[str] | None = None) -> Work:
    """What a way did (to ``users`` only, if given): counts and digests of the row ids."""
    scope = "TRUE" if users is None else "user_id = ANY(%(users)s)"
    params = {"users": list(users or [])}
    with psycopg.connect(url) as conn:

        def one(query: str) -> Any:
            row = conn.execute(query.replace("{scope}", scope), params).fetchone()
            assert row is not None
            return row[0]

        return Work(
            archived=one("SELECT count(*) FROM dream_archive WHERE reason = 'prune' AND {scope}"),
            remaining=one("SELECT count(*) FROM usermemories WHERE {scope}"),
            flagged=one("SELECT count(*) FROM usermemories WHERE conflicted AND {scope}"),
            contradictions=one("SELECT count(*) FROM dream_contradictions WHERE {scope}"),
            archived_digest=one(
                "SELECT coalesce(md5(string_agg(entry_id, ',' ORDER BY entry_id)), '') FROM dream_archive "
                "WHERE reason = 'prune' AND {scope}"
            ),
            flagged_digest=one(
                "SELECT coalesce(md5(string_agg(id, ',' ORDER BY id)), '') FROM usermemories "
                "WHERE conflicted AND {scope}"
            ),
        )


# -- (a) the floor -------------------------------------------------------------------------

_NORM_KEY = r"trim(both '_' from regexp_replace(lower(trim(key)), '[\s_.\-]+', '_', 'g'))"

FLOOR_SQL = (
    """
WITH gone AS (
    DELETE FROM usermemories m
    WHERE coalesce(updated_at, created_at) < %(cutoff)s
      AND coalesce(access_count, 0) = 0
      AND key NOT LIKE '\\_gdpr\\_%%'
      AND coalesce(category, 'fact') <> ALL(%(protected)s)
    RETURNING m.*
), archived AS (
    INSERT INTO dream_archive (user_id, entry_id, reason, row, archived_at)
    SELECT user_id, id, 'prune', to_jsonb(gone), %(at)s FROM gone
)
INSERT INTO dream_events (user_id, entry_id, key, action, source, at)
SELECT user_id, id, key, 'delete', 'prune', %(at)s FROM gone
""",
    f"""
WITH keyed AS (
    SELECT id, user_id, {_NORM_KEY} AS norm_key, coalesce(value::text, 'null') AS v
    FROM usermemories WHERE key NOT LIKE '\\_gdpr\\_%%'
), contradicting AS (
    SELECT user_id, norm_key FROM keyed GROUP BY user_id, norm_key HAVING count(DISTINCT v) > 1
), flagged AS (
    UPDATE usermemories m SET conflicted = true
    FROM keyed JOIN contradicting USING (user_id, norm_key)
    WHERE m.id = keyed.id
    RETURNING m.id, m.user_id, keyed.norm_key
)
INSERT INTO dream_contradictions (user_id, norm_key, entry_ids, fingerprint, status, resolution, found_at)
SELECT user_id, norm_key, jsonb_agg(id ORDER BY id),
       encode(sha256(convert_to(string_agg(id, ',' ORDER BY id), 'UTF8')), 'hex'), 'open', 'flag', %(at)s
FROM flagged GROUP BY user_id, norm_key
""",
)


def run_floor(url: str, at: datetime) -> float:
    params = {"cutoff": at - timedelta(days=PRUNE_DAYS), "protected": list(PROTECTED), "at": at}
    with psycopg.connect(url) as conn:
        started = time.perf_counter()
        for statement in FLOOR_SQL:
            conn.execute(statement, params)
        conn.commit()
        return time.perf_counter() - started


# -- (b) per row, the way EDDI does it --------------------------------------------------------


def run_per_row(url: str, users: Sequence[str], at: datetime) -> float:
    from tasks.contradictions import canonical_value, normalise_key

    cutoff = at - timedelta(days=PRUNE_DAYS)
    with psycopg.connect(url, row_factory=dict_row) as conn:
        started = time.perf_counter()
        for user_id in users:
            with conn.transaction():
                rows = conn.execute("SELECT * FROM usermemories WHERE user_id = %s", (user_id,)).fetchall()
                kept = []
                for row in rows:
                    touched = row["updated_at"] or row["created_at"]
                    if (
                        touched < cutoff
                        and not row["access_count"]
                        and not row["key"].startswith("_gdpr_")
                        and (row["category"] or "fact") not in PROTECTED
                    ):
                        archived = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}
                        conn.execute(
                            "INSERT INTO dream_archive (user_id, entry_id, reason, row, archived_at) "
                            "VALUES (%s, %s, 'prune', %s, %s)",
                            (user_id, row["id"], Jsonb(archived), at),
                        )
                        conn.execute("DELETE FROM usermemories WHERE id = %s", (row["id"],))
                        conn.execute(
                            "INSERT INTO dream_events (user_id, entry_id, key, action, source, at) "
                            "VALUES (%s, %s, %s, 'delete', 'prune', %s)",
                            (user_id, row["id"], row["key"], at),
                        )
                    else:
                        kept.append(row)
                groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
                for row in kept:
                    if not row["key"].startswith("_gdpr_"):
                        groups[normalise_key(row["key"])].append(row)
                for norm_key, group in groups.items():
                    if len({canonical_value(r["value"]) for r in group}) < 2:
                        continue
                    for row in group:
                        conn.execute("UPDATE usermemories SET conflicted = true WHERE id = %s", (row["id"],))
                    ids = sorted(r["id"] for r in group)
                    conn.execute(
                        "INSERT INTO dream_contradictions "
                        "(user_id, norm_key, entry_ids, fingerprint, status, resolution, found_at) "
                        "VALUES (%s, %s, %s, md5(%s), 'open', 'flag', %s)",
                        (user_id, norm_key, Jsonb(ids), ",".join(ids), at),
                    )
        return time.perf_counter() - started


# -- the real path: dispatcher -> Redis -> celery worker --------------------------------------


@contextmanager
def _process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _wait_for(what: str, check: Callable[[], bool], timeout: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tail = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs.glob("*.log"))
            raise RuntimeError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.1)


def run_real(url: str, users: int, *, profiles: bool = False) -> float:
    """Time one dispatcher tick's users through Redis and a real worker, claim to last run closed."""
    from schedules import dispatcher
    from worker.app import create_app
    from worker.settings import Settings
    from worker.wakeup import send_user_runs

    tmp = Path(tempfile.mkdtemp(prefix="reverie-sweep-"))
    port = _free_port()
    broker = f"redis://127.0.0.1:{port}/0"
    redis_argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    env = _env(
        url,
        REVERIE_BROKER_URL=broker,
        REVERIE_METRICS_PORT=str(_free_port()),
        REVERIE_BUILD_PROFILES=str(profiles).lower(),
    )
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp / "metrics")
    (tmp / "metrics").mkdir()
    worker_argv = [sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q", "dreams", "-c", "2"]
    worker_argv += ["--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"]
    settings = Settings(_env_file=None, database_url=url, broker_url=broker)
    try:
        with _process(redis_argv, tmp / "redis.log"), _process(worker_argv, tmp / "worker.log", env):
            control = create_app(settings).control
            _wait_for("the worker", lambda: bool(control.ping(timeout=0.5)), 120, tmp)
            with psycopg.connect(url, autocommit=True) as conn:

                def closed() -> int:
                    row = conn.execute("SELECT count(*) FROM dream_runs WHERE finished_at IS NOT NULL").fetchone()
                    return int(row[0]) if row else 0

                started = time.perf_counter()
                result = dispatcher.dispatch(settings, lambda chunk: send_user_runs(settings, chunk))
                _wait_for(f"{users} runs", lambda: closed() >= users, 3600, tmp)
                elapsed = time.perf_counter() - started
            if result.claimed != users:
                raise RuntimeError(f"the dispatcher claimed {result.claimed} users, not {users}")
            return elapsed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- the cron pass: ``reverie run --all`` in a process of its own ------------------------------


def run_cron(url: str, users: int, *, profiles: bool = False) -> float:
    """Time ``reverie run --all --json`` from its start to its exit (start-up included)."""
    started = time.perf_counter()
    argv = [REVERIE, "run", "--all", "--json"]
    env = _env(url, REVERIE_BUILD_PROFILES=str(profiles).lower())
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"reverie run --all failed ({done.returncode}): {done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    if report["users_processed"] != users:
        raise RuntimeError(f"reverie run --all dreamed {report['users_processed']} users, not {users}")
    return elapsed


# -- the measure ---------------------------------------------------------------------------------


def sweep(users: int, entries: int, *, sample: int | None, seed: int = 42) -> list[Row]:
    workload = MemoryWorkload(seed=seed, users=users, entries=entries)
    user_ids = [workload.user_id(u) for u in range(users)]
    sampled = sorted(random.Random(seed).sample(user_ids, sample)) if sample and sample < users else user_ids
    with databases("reverie_sweep") as make:
        template = seed_template(make, workload)
        real_db, cron_db, floor_db, row_db, profiled_db = (_url(make(template)) for _ in range(5))
        at = datetime.now(UTC).replace(tzinfo=None)
        floor = run_floor(floor_db, at)
        _log(f"floor: {floor:.2f}s")
        per_row = run_per_row(row_db, sampled, at)
        per_row_total = per_row * users / len(sampled)
        _log(f"per-row: {per_row:.1f}s for {len(sampled):,} users")
        cron = run_cron(cron_db, users)
        _log(f"cron pass: {cron:.2f}s")
        profiled = run_cron(profiled_db, users, profiles=True)
        _log(f"cron pass with profiles: {profiled:.2f}s")
        real = run_real(real_db, users)
        _log(f"real path: {real:.2f}s")
        works = {
            "real": work_done(real_db),
            "cron": work_done(cron_db),
            "cron with profiles": work_done(profiled_db),
            "floor": work_done(floor_db),
        }
        on_sample = {name: work_done(db, sampled) for name, db in (("real", real_db), ("cron", cron_db))}
        on_sample["floor"] = work_done(floor_db, sampled)
        on_sample["per-row"] = work_done(row_db, sampled)
    same = len(set(works.values())) == 1 and len(set(on_sample.values())) == 1
    size = f"{users:,} users x {entries} entries"
    row_what = "per-row (EDDI way: per user load, decide in Python, delete/flag one row at a time)"
    if len(sampled) < users:
        row_what += f"; timed on a seeded random sample of {len(sampled):,} users, scaled x{users / len(sampled):g}"
    speedup = per_row_total / real if real else float("inf")
    return [
        Row(
            "P1",
            f"dream sweep, real path (dispatcher -> Redis -> celery worker -c 2), profiles off, {size}",
            seconds(real),
            f"floor {seconds(floor)}",
            ratio(real, floor),
            f"<= {GOAL_REAL_RATIO:g}x floor",
            real <= GOAL_REAL_RATIO * floor,
        ),
        Row(
            "P1",
            f"dream sweep, cron pass (`reverie run --all`, no broker, start-up included), profiles off, {size}",
            seconds(cron),
            f"floor {seconds(floor)}",
            ratio(cron, floor),
            f"<= {GOAL_CRON_RATIO:g}x floor",
            cron <= GOAL_CRON_RATIO * floor,
        ),
        Row(
            "P1",
            f"dream sweep, cron pass as above with profiles built (the default), {size}",
            seconds(profiled),
            f"floor {seconds(floor)}",
            ratio(profiled, floor),
            f"<= {GOAL_CRON_RATIO * GOAL_PROFILES_RATIO:g}x floor",
            profiled <= GOAL_CRON_RATIO * GOAL_PROFILES_RATIO * floor,
        ),
        Row(
            "P1",
            "dream sweep, real path vs per-row",
            seconds(real),
            f"per-row {seconds(per_row_total)}",
            f"{speedup:.1f}x faster",
            f">= {GOAL_SPEEDUP:g}x faster",
            speedup >= GOAL_SPEEDUP,
        ),
        Row("P1", f"floor: set-based SQL over the whole table, one transaction, {size}", seconds(floor)),
        Row("P1", row_what, seconds(per_row_total)),
        Row(
            "P1",
            "same work by every way (real, cron, cron with profiles, floor, per-row)"
            + (f"; per-row compared on its {len(sampled):,} users" if len(sampled) < users else ""),
            works["real"].summary()
            + ("" if same else "".join(f" | {name}: {work.summary()}" for name, work in works.items())),
            ratio="same rows" if same else "DIFFERENT",
            goal="identical",
            passed=same,
        ),
    ]


def measure(quick: bool) -> list[Row]:
    if quick:
        return sweep(20, 10, sample=None)
    return sweep(10_000, 100, sample=PER_ROW_SAMPLE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=100)
    parser.add_argument("--sample", type=int, default=PER_ROW_SAMPLE, help="per-row users timed, then scaled")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = sweep(args.users, args.entries, sample=args.sample, seed=args.seed)
    print(render(rows))
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
