"""P2: signal ingestion end to end against a no-op Celery task on the same worker.

A real ``celery worker`` (``-c 2``, the project's configuration and hooks) on a
throwaway Redis (its own ``redis-server`` on a free loopback port) and a throwaway
PostgreSQL database, offline model. Measured in one run:

1. the maximum rate of a no-op task (:mod:`bench.noop_app`): a backlog of messages
   drained by the worker (tasks/s);
2. the maximum rate of ``activity`` and of ``session_end`` signals: rows INSERTed by
   plain SQL in one transaction, then one wake-up per row sent in bulk over one
   connection (the sweeper's :func:`worker.wakeup.wake_signals`); from the first
   wake-up sent to the last row ``done``;
3. a sustained run at half the ``activity`` maximum: a producer calls
   :func:`worker.producer.enqueue_signal` (row, commit, wake-up) at a fixed rate;
   latency is ``processed_at - enqueued_at`` of each row;
4. the same latency for producers that only INSERT (:mod:`bench.sql_latency`): idle,
   and at half the maximum rate.

Goals: activity throughput >= 75 % of the no-op task's; p99 latency < 2 s at half the
maximum rate.

    python -m bench.signal_throughput [--quick] [--size N] [--seconds S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import psycopg
import redis as redis_lib
from psycopg import sql

from bench import sql_latency
from bench.signal_workload import SignalSpec, signals
from bench.table import Row, render
from bench.table import seconds as in_seconds
from store.migrate import upgrade
from worker.settings import Settings

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
ROOT = Path(__file__).resolve().parents[1]
QUEUE = "signals"
#: Finished statuses: the worker has nothing more to do with the row.
FINAL = ("done", "rejected", "dead")

GOAL_RATIO = 0.75
#: Producers of the sustained run: processes, and threads in each.
PRODUCER_PROCESSES = 2
PRODUCER_THREADS = 2
GOAL_P99_SECONDS = 2.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _raise_on_term(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so every ``finally`` stops what the bench started.
    raise KeyboardInterrupt(f"signal {signum}")


@dataclass
class Bench:
    """A throwaway database and Redis, and the worker processes started on them."""

    settings: Settings
    tmp: Path
    db_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def conn(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.db_url, autocommit=True)

    def redis(self) -> redis_lib.Redis:
        return redis_lib.Redis.from_url(self.settings.broker_url)

    def start_worker(self, app: str, name: str) -> subprocess.Popen[bytes]:
        env = {
            **self.env,
            "REVERIE_METRICS_PORT": str(_free_port()),
            "PROMETHEUS_MULTIPROC_DIR": str(self.tmp / f"metrics-{name}"),
        }
        argv = [sys.executable, "-m", "celery", "-A", app, "worker", "-Q", QUEUE, "-c", "2"]
        argv += ["-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
        with (self.tmp / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop_worker(self, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # Pool children left behind by a hard kill share the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc in self.procs:
            self.procs.remove(proc)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@contextlib.contextmanager
def bench_environment(*, extra_env: dict[str, str] | None = None) -> Iterator[Bench]:
    """A migrated throwaway database and a private ``redis-server``; everything is
    stopped and dropped on the way out, on failure and on Ctrl-C or SIGTERM too."""
    previous = signal.signal(signal.SIGTERM, _raise_on_term)
    tmp = Path(tempfile.mkdtemp(prefix="reverie-bench-signals-"))
    name = f"reverie_bench_sig_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    base = ADMIN_URL.rsplit("/", 1)[0]
    db_url = f"{base}/{name}"
    redis_port = _free_port()
    redis_proc: subprocess.Popen[bytes] | None = None
    bench: Bench | None = None
    created = False
    try:
        redis_proc = subprocess.Popen(
            [
                *(shutil.which("redis-server") or "redis-server", "--port", str(redis_port)),
                *("--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        created = True
        broker = f"redis://127.0.0.1:{redis_port}/0"
        sa_url = db_url.replace("postgresql://", "postgresql+psycopg://", 1)
        env_settings = {
            "REVERIE_DATABASE_URL": sa_url,
            "REVERIE_BROKER_URL": broker,
            "REVERIE_LLM_MODEL": "offline",
            # The day's cost cap is not what is measured: thousands of offline calls
            # would spend the default 5 USD and leave signals waiting for budget.
            "REVERIE_MAX_COST_PER_DAY": "1000000",
            "REVERIE_LOG_FORMAT": "json",
            **(extra_env or {}),
        }
        env = {**os.environ, **env_settings, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        settings = Settings(
            _env_file=None,
            database_url=sa_url,
            broker_url=broker,
            llm_model="offline",
            max_cost_per_day=1_000_000,
        )
        _wait_for_redis(broker)
        upgrade(settings)
        bench = Bench(settings, tmp, db_url, env=env)
        yield bench
    finally:
        if bench is not None:
            for proc in list(bench.procs):
                bench.stop_worker(proc, timeout=10)
        from store.db import dispose_engines

        dispose_engines()
        if redis_proc is not None:
            redis_proc.terminate()
            try:
                redis_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                redis_proc.kill()
                redis_proc.wait(timeout=10)
        if created:
            with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _wait_for_redis(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    client = redis_lib.Redis.from_url(url)
    while True:
        try:
            client.ping()
            return
        except redis_lib.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            client.close()


# -- producing ---------------------------------------------------------------------------


def insert_rows(bench: Bench, specs: Iterable[SignalSpec]) -> list[int]:
    """INSERT the signals by plain SQL in one transaction (as any producer may); their ids."""
    rows = [(s.kind, s.user_id, s.agent_id, json.dumps(s.payload)) for s in specs]
    with psycopg.connect(bench.db_url) as conn, conn.cursor() as cur:
        # These rows are woken in bulk by :func:`wake`, as the sweeper would: no notices.
        cur.execute("SELECT set_config('reverie.woken', 'on', true)")
        cur.executemany(
            "INSERT INTO dream_signals (kind, user_id, agent_id, payload) VALUES (%s, %s, %s, %s) RETURNING id",
            rows,
            returning=True,
        )
        ids: list[int] = []
        while True:
            row = cur.fetchone()
            if row is not None:
                ids.append(int(row[0]))
            if not cur.nextset():
                break
    return ids


def wake(bench: Bench, ids: list[int]) -> None:
    from worker.wakeup import wake_signals

    wake_signals(bench.settings, ids)


def count_final(bench: Bench, first_id: int, last_id: int) -> dict[str, int]:
    with bench.conn() as conn:
        rows = conn.execute(
            "SELECT status, count(*) FROM dream_signals WHERE id BETWEEN %s AND %s GROUP BY status",
            (first_id, last_id),
        ).fetchall()
    return {str(status): int(count) for status, count in rows}  # type: ignore[call-overload]


def wait_final(bench: Bench, ids: list[int], worker: subprocess.Popen[bytes], timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = count_final(bench, min(ids), max(ids))
        if sum(counts.get(s, 0) for s in FINAL) >= len(ids):
            return counts
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited ({worker.returncode}): {bench.log_tail(_name(worker, bench))}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"signals not finished after {timeout:.0f} s: {counts}")
        time.sleep(0.05)


def _name(worker: subprocess.Popen[bytes], bench: Bench) -> str:
    argv = worker.args if isinstance(worker.args, list) else []
    return str(argv[argv.index("-n") + 1]).split("@")[0] if "-n" in argv else "worker"


def last_processed(bench: Bench, first_id: int, last_id: int) -> datetime:
    with bench.conn() as conn:
        value = conn.execute(
            "SELECT max(processed_at) FROM dream_signals WHERE id BETWEEN %s AND %s", (first_id, last_id)
        ).fetchone()
    assert value is not None and isinstance(value[0], datetime)
    return value[0].replace(tzinfo=UTC)


# -- the measures ------------------------------------------------------------------------


@dataclass
class Drain:
    what: str
    count: int
    seconds: float
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0


def drain_noop(bench: Bench, count: int, warmup: int) -> Drain:
    """No-op tasks/s: a backlog of ``count`` messages, from the first send to the last ack."""
    from bench.noop_app import NOOP_TASK
    from worker.wakeup import publish

    worker = bench.start_worker("bench.noop_app", "noop")
    client = bench.redis()
    try:
        for size in (warmup, count):
            started = time.perf_counter()
            publish(bench.settings, NOOP_TASK, [[i] for i in range(size)])
            deadline = time.monotonic() + 600
            while client.llen(QUEUE) or client.hlen("unacked"):
                if worker.poll() is not None:
                    raise RuntimeError(f"the no-op worker exited: {bench.log_tail('noop')}")
                if time.monotonic() > deadline:
                    raise RuntimeError("no-op backlog not drained in 600 s")
                time.sleep(0.002)
            elapsed = time.perf_counter() - started
    finally:
        client.close()
        bench.stop_worker(worker)
    return Drain("no-op task", count, elapsed)


def drain_signals(bench: Bench, kind: str, count: int, *, seed: int) -> Drain:
    """Signals/s: ``count`` rows INSERTed and committed, then woken in bulk; from the
    first wake-up sent to the last ``processed_at``. The worker must already run."""
    ids = insert_rows(bench, signals(kind, count, seed=seed, start=seed * 1_000_000))
    worker = bench.procs[-1]
    started = datetime.now(UTC)
    wake(bench, ids)
    statuses = wait_final(bench, ids, worker, timeout=900)
    finished = last_processed(bench, min(ids), max(ids))
    return Drain(kind, count, (finished - started).total_seconds(), statuses)


@dataclass
class Sustained:
    target_rate: float
    achieved_rate: float
    seconds: float
    count: int
    p50: float
    p99: float
    worst: float
    statuses: dict[str, int]


def _produce(
    bench: Bench, specs: list[SignalSpec], offsets: list[int], step: int, rate: float, started: float
) -> list[int]:
    """Enqueue ``specs[offset::step]`` for each offset (one thread each), signal ``n``
    at ``started + n / rate``; the ids, in no particular order."""
    from worker.producer import enqueue_signal

    ids: list[int] = []
    failures: list[BaseException] = []

    def produce(offset: int) -> None:
        try:
            for n in range(offset, len(specs), step):
                delay = started + n / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                spec = specs[n]
                done = enqueue_signal(
                    spec.kind, spec.user_id, spec.payload, agent_id=spec.agent_id, settings=bench.settings
                )
                ids.append(done.signal_id)
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=produce, args=(offset,), daemon=True) for offset in offsets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"a producer failed: {failures[0]!r}")
    return ids


def _producer_process(
    bench: Bench, specs: list[SignalSpec], offsets: list[int], step: int, rate: float, started: float, out: Any
) -> None:
    try:
        out.put(_produce(bench, specs, offsets, step, rate, started))
    except BaseException as exc:
        out.put(repr(exc))


def sustained(bench: Bench, kind: str, rate: float, seconds: float, *, seed: int) -> Sustained:
    """``enqueue_signal`` at ``rate`` per second for ``seconds``; latency of each row.

    Signal ``n`` is due at ``n / rate`` seconds. :data:`PRODUCER_PROCESSES` processes
    of :data:`PRODUCER_THREADS` threads share the schedule, so one slow enqueue (or
    the producers' own CPU) does not hold back the next ones.
    """
    total = max(int(rate * seconds), 1)
    specs = list(signals(kind, total, seed=seed, start=seed * 1_000_000))
    step = PRODUCER_PROCESSES * PRODUCER_THREADS
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    started = time.perf_counter() + 0.5
    procs = [
        context.Process(
            target=_producer_process,
            args=(bench, specs, list(range(p, step, PRODUCER_PROCESSES)), step, rate, started, out),
            daemon=True,
        )
        for p in range(PRODUCER_PROCESSES)
    ]
    for proc in procs:
        proc.start()
    ids: list[int] = []
    try:
        for _ in procs:
            part = out.get(timeout=seconds * 10 + 120)
            if isinstance(part, str):
                raise RuntimeError(f"a producer process failed: {part}")
            ids.extend(part)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    produced = time.perf_counter() - started
    if len(ids) != total:
        raise RuntimeError(f"the producers enqueued {len(ids)} of {total} signals")
    statuses = wait_final(bench, ids, bench.procs[-1], timeout=300)
    with bench.conn() as conn:
        lags = [
            float(row[0])  # type: ignore[arg-type]
            for row in conn.execute(
                "SELECT extract(epoch FROM processed_at - enqueued_at) FROM dream_signals WHERE id = ANY(%s)",
                (ids,),
            )
        ]
    lags.sort()
    return Sustained(
        target_rate=rate,
        achieved_rate=len(ids) / produced if produced > 0 else 0.0,
        seconds=produced,
        count=len(ids),
        p50=statistics.median(lags),
        p99=lags[min(len(lags) - 1, int(0.99 * len(lags)))],
        worst=lags[-1],
        statuses=statuses,
    )


def warm_signals(bench: Bench, kinds: Iterable[str], per_kind: int) -> None:
    """A few signals of each kind first, so imports and pools are warm when timing starts."""
    for n, kind in enumerate(kinds):
        ids = insert_rows(bench, signals(kind, per_kind, seed=900 + n, start=(900 + n) * 1_000_000))
        wake(bench, ids)
        wait_final(bench, ids, bench.procs[-1], timeout=120)


@dataclass(frozen=True)
class Size:
    noop: int
    signals: int
    seconds: float


FULL = Size(noop=6000, signals=3000, seconds=60.0)
QUICK = Size(noop=40, signals=30, seconds=3.0)


def run(size: Size) -> list[Row]:
    with bench_environment() as bench:
        noop = drain_noop(bench, size.noop, warmup=max(size.noop // 10, 10))
        print(f"  no-op: {noop.count} in {noop.seconds:.2f} s = {noop.rate:.0f}/s", file=sys.stderr, flush=True)
        bench.start_worker("worker.app", "signals")
        warm_signals(bench, ("activity", "session_end"), per_kind=max(size.signals // 20, 10))
        activity = drain_signals(bench, "activity", size.signals, seed=1)
        print(f"  activity: {activity.rate:.0f}/s {activity.statuses}", file=sys.stderr, flush=True)
        # Each session end makes a model call (budget reservation and settlement included): fewer of them.
        session_end = drain_signals(bench, "session_end", max(size.signals // 3, 10), seed=2)
        print(f"  session_end: {session_end.rate:.0f}/s {session_end.statuses}", file=sys.stderr, flush=True)
        steady = sustained(bench, "activity", activity.rate / 2, size.seconds, seed=3)
        print(f"  sustained: {steady}", file=sys.stderr, flush=True)
        by_sql, by_helper = sql_latency.idle(bench, max(size.signals // 30, 5), seed=4)
        print(f"  idle: sql {by_sql}, helper {by_helper}", file=sys.stderr, flush=True)
        sql_loaded = sql_latency.loaded(bench, activity.rate / 2, size.seconds, seed=5)
        print(f"  sql at half max: {sql_loaded}", file=sys.stderr, flush=True)
    return rows(noop, activity, session_end, steady) + sql_rows(by_sql, by_helper, sql_loaded, steady)


def rows(noop: Drain, activity: Drain, session_end: Drain, steady: Sustained) -> list[Row]:
    how = "SQL INSERT + bulk wake-ups"
    out = [
        Row("P2", f"no-op Celery task, backlog of {noop.count} drained (c=2)", f"{noop.rate:.0f} tasks/s"),
    ]
    for drain in (activity, session_end):
        ratio = drain.rate / noop.rate if noop.rate else 0.0
        complete = drain.statuses.get("done", 0) == drain.count
        passed = (ratio >= GOAL_RATIO and complete) if drain.what == "activity" else None
        goal = f">= {GOAL_RATIO:.0%} of no-op" if drain.what == "activity" else "-"
        note = "" if complete else f" ({drain.statuses})"
        out.append(
            Row(
                "P2",
                f"{drain.what} signals, backlog of {drain.count} to done ({how})",
                f"{drain.rate:.0f} signals/s{note}",
                baseline=f"{noop.rate:.0f} tasks/s",
                ratio=f"{ratio:.2f}x",
                goal=goal,
                passed=passed,
            )
        )
    complete = steady.statuses.get("done", 0) == steady.count
    out.append(
        Row(
            "P2",
            f"activity at {steady.achieved_rate:.0f}/s (target: half max, {steady.target_rate:.0f}/s) "
            f"for {steady.seconds:.0f} s (enqueue_signal, {PRODUCER_PROCESSES}x{PRODUCER_THREADS} producers), "
            "latency p50",
            f"{steady.p50 * 1000:.0f} ms",
        )
    )
    out.append(
        Row(
            "P2",
            f"activity at half max, latency p99 (enqueued_at -> processed_at, {steady.count} signals)",
            f"{steady.p99 * 1000:.0f} ms" + ("" if complete else f" ({steady.statuses})"),
            goal=f"< {GOAL_P99_SECONDS:.0f} s",
            passed=steady.p99 < GOAL_P99_SECONDS and complete,
        )
    )
    return out


def sql_rows(
    by_sql: sql_latency.Latency, by_helper: sql_latency.Latency, loaded: sql_latency.Latency, steady: Sustained
) -> list[Row]:
    """The SQL producer's latency rows, each beside the helper's in the same run."""
    idle_goal = sql_latency.GOAL_IDLE_P99_SECONDS
    loaded_goal = sql_latency.GOAL_LOADED_P99_SECONDS
    return [
        Row(
            "P2",
            f"plain SQL INSERT (no wake-up sent), idle, one at a time ({by_sql.count} signals), latency p50",
            in_seconds(by_sql.p50),
            baseline=f"{in_seconds(by_helper.p50)} (enqueue_signal)",
        ),
        Row(
            "P2",
            "plain SQL INSERT, idle, latency p99 (enqueued_at -> processed_at)",
            in_seconds(by_sql.p99) + ("" if by_sql.complete else f" ({by_sql.statuses})"),
            baseline=f"{in_seconds(by_helper.p99)} (enqueue_signal)",
            goal=f"< {idle_goal:.0f} s",
            passed=by_sql.p99 < idle_goal and by_sql.complete and by_helper.complete,
        ),
        Row(
            "P2",
            f"plain SQL INSERT at {loaded.rate:.0f}/s (half max), {loaded.count} signals, latency p50",
            in_seconds(loaded.p50),
            baseline=f"{in_seconds(steady.p50)} (enqueue_signal)",
        ),
        Row(
            "P2",
            "plain SQL INSERT at half max, latency p99, every signal done once",
            in_seconds(loaded.p99) + ("" if loaded.complete else f" ({loaded.statuses})"),
            baseline=f"{in_seconds(steady.p99)} (enqueue_signal)",
            goal=f"< {loaded_goal:.0f} s",
            passed=loaded.p99 < loaded_goal and loaded.complete,
        ),
    ]


def measure(quick: bool) -> list[Row]:
    return run(QUICK if quick else FULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.signal_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny numbers: a smoke run")
    parser.add_argument("--size", type=int, help="signals per drain (no-op: twice as many)")
    parser.add_argument("--seconds", type=float, help="length of the sustained run")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.size:
        size = Size(noop=2 * args.size, signals=args.size, seconds=size.seconds)
    if args.seconds:
        size = Size(noop=size.noop, signals=size.signals, seconds=args.seconds)
    table = run(size)
    print(render(table))
    return 0 if all(r.passed is not False for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
