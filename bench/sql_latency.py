"""P2, SQL producers: enqueue-to-done latency of signals that a producer only INSERTs
(no wake-up of its own; PostgreSQL's notice and the worker's listener wake the worker),
beside the Python helper's latency measured in the same run.

Run inside :func:`bench.signal_throughput.run`, on its worker (no beat, so no sweeper):

1. idle: signals one at a time, each INSERTed once the previous one is done;
2. loaded: plain INSERTs at half the maximum ``activity`` rate, from producer threads.

Latency is ``processed_at - enqueued_at`` of each row. Goals: p99 < 2 s idle and < 5 s
at half the maximum rate, every signal ``done`` once.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from bench.signal_workload import SignalSpec, signals

if TYPE_CHECKING:
    from bench.signal_throughput import Bench

GOAL_IDLE_P99_SECONDS = 2.0
GOAL_LOADED_P99_SECONDS = 5.0
#: Pause between idle signals, so each one finds the worker idle.
IDLE_GAP_SECONDS = 0.2
PRODUCER_THREADS = 2
INSERT = "INSERT INTO dream_signals (kind, user_id, agent_id, payload) VALUES (%s, %s, %s, %s) RETURNING id"


@dataclass(frozen=True)
class Latency:
    what: str
    count: int
    p50: float
    p99: float
    statuses: dict[str, int]
    rate: float = 0.0

    @property
    def complete(self) -> bool:
        return self.statuses.get("done", 0) == self.count


def _insert(conn: psycopg.Connection[tuple[object, ...]], spec: SignalSpec) -> int:
    row = conn.execute(INSERT, (spec.kind, spec.user_id, spec.agent_id, json.dumps(spec.payload))).fetchone()
    assert row is not None
    return int(row[0])  # type: ignore[call-overload]


def _measure(bench: Bench, what: str, ids: list[int], rate: float = 0.0) -> Latency:
    from bench.signal_throughput import wait_final

    wait_final(bench, ids, bench.procs[-1], timeout=300)
    with bench.conn() as conn:
        # By id, not by id range: the two ways' signals are interleaved.
        statuses = {
            str(status): int(count)  # type: ignore[call-overload]
            for status, count in conn.execute(
                "SELECT status, count(*) FROM dream_signals WHERE id = ANY(%s) GROUP BY status", (ids,)
            )
        }
        lags = sorted(
            float(row[0])  # type: ignore[arg-type]
            for row in conn.execute(
                "SELECT extract(epoch FROM processed_at - enqueued_at) FROM dream_signals WHERE id = ANY(%s)",
                (ids,),
            )
        )
    return Latency(
        what,
        len(ids),
        p50=statistics.median(lags),
        p99=lags[min(len(lags) - 1, int(0.99 * len(lags)))],
        statuses=statuses,
        rate=rate,
    )


def idle(bench: Bench, count: int, *, seed: int) -> tuple[Latency, Latency]:
    """(SQL INSERT, helper) latencies, one signal at a time, alternating the two ways."""
    from worker.producer import enqueue_signal

    specs = list(signals("activity", 2 * count, seed=seed, start=seed * 1_000_000))
    by_sql: list[int] = []
    by_helper: list[int] = []
    with bench.conn() as conn:
        for n, spec in enumerate(specs):
            if n % 2 == 0:
                signal_id = _insert(conn, spec)
                by_sql.append(signal_id)
            else:
                signal_id = enqueue_signal(
                    spec.kind, spec.user_id, spec.payload, agent_id=spec.agent_id, settings=bench.settings
                ).signal_id
                by_helper.append(signal_id)
            _wait_done(bench, signal_id)
            time.sleep(IDLE_GAP_SECONDS)
    return _measure(bench, "sql", by_sql), _measure(bench, "helper", by_helper)


def _wait_done(bench: Bench, signal_id: int, timeout: float = 120.0) -> None:
    from bench.signal_throughput import wait_final

    wait_final(bench, [signal_id], bench.procs[-1], timeout=timeout)


def loaded(bench: Bench, rate: float, seconds: float, *, seed: int) -> Latency:
    """Plain INSERTs at ``rate`` per second for ``seconds`` (signal ``n`` due at
    ``n / rate``), from :data:`PRODUCER_THREADS` threads with a connection each."""
    total = max(int(rate * seconds), 1)
    specs = list(signals("activity", total, seed=seed, start=seed * 1_000_000))
    ids: list[int] = []
    failures: list[BaseException] = []
    started = time.perf_counter() + 0.2

    def produce(offset: int) -> None:
        try:
            with bench.conn() as conn:
                for n in range(offset, total, PRODUCER_THREADS):
                    delay = started + n / rate - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    ids.append(_insert(conn, specs[n]))
        except Exception as exc:
            failures.append(exc)

    _run_threads(produce, PRODUCER_THREADS)
    produced = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"a SQL producer failed: {failures[0]!r}")
    return _measure(bench, "sql", ids, rate=len(ids) / produced if produced > 0 else 0.0)


def _run_threads(target: Callable[[int], None], count: int) -> None:
    threads = [threading.Thread(target=target, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
