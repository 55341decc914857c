"""P5: the worker's memory while it processes a long stream of signals.

A real ``celery worker`` (``-c 2``, the production configuration: no
``worker_max_tasks_per_child``) on a throwaway Redis and PostgreSQL processes
``--signals`` signals of a realistic mix (:data:`bench.signal_workload.MIX`: mostly
activity and session ends, some feedback), INSERTed by plain SQL in chunks and woken
in bulk (the sweeper's :func:`worker.wakeup.wake_signals`), the backlog kept under
:data:`MAX_BACKLOG`. The RSS of the worker's parent and of each pool child is read
from ``/proc`` every :data:`SAMPLE_SECONDS`, and their PSS (the same memory with the
pages the children share with the parent, such as the preloaded LLM gateway, counted
once across the processes) is shown beside it.

Goals, per process: flat after warm-up (the median RSS of the last fifth of the run
at most the first fifth's plus :data:`TOLERANCE_MB`, warm-up being the first
:data:`WARMUP_SHARE` of the signals) and below :data:`LIMIT_MB`.

    python -m bench.worker_memory [--quick] [--signals N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.signal_throughput import Bench, bench_environment, count_final, insert_rows, wake
from bench.signal_workload import mixed_signals
from bench.table import Row, render

LIMIT_MB = 250.0
#: Allowed growth of the median RSS from the first to the last fifth after warm-up.
TOLERANCE_MB = 5.0
WARMUP_SHARE = 0.1
SAMPLE_SECONDS = 0.5
CHUNK = 1000
MAX_BACKLOG = 3000
FULL = 100_000
QUICK = 200


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def pss_mb(pid: int) -> float | None:
    """Proportional set size of ``pid`` in MiB: pages shared with the parent and the
    other children count a share each (None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in task.read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(out)


@dataclass
class Sampler:
    """RSS samples of a worker parent and its pool children, tagged with progress."""

    parent: int
    progress: list[int]  # [signals finished], updated by the producer
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    pss_peak: dict[str, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    pids: dict[str, int] = field(default_factory=dict)

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            procs = {"parent": self.parent}
            for n, child in enumerate(children(self.parent)):
                procs[f"child {n + 1}"] = child
            for name, pid in procs.items():
                if self.pids.setdefault(name, pid) != pid:
                    # A replaced child would be a recycled process: record it apart.
                    name = f"{name} (pid {pid})"
                    self.pids.setdefault(name, pid)
                value = rss_mb(pid)
                if value is not None:
                    self.samples.setdefault(name, []).append((self.progress[0], value))
                pss = pss_mb(pid)
                if pss is not None:
                    self.pss_peak[name] = max(pss, self.pss_peak.get(name, 0.0))


@dataclass
class Verdict:
    name: str
    first: float
    last: float
    peak: float
    pss_peak: float

    @property
    def growth(self) -> float:
        return self.last - self.first


def verdicts(sampler: Sampler, total: int) -> list[Verdict]:
    out = []
    warm = int(total * WARMUP_SHARE)
    for name, samples in sampler.samples.items():
        steady = [mb for done, mb in samples if done >= warm]
        if len(steady) < 5:
            steady = [mb for _, mb in samples]
        fifth = max(len(steady) // 5, 1)
        out.append(
            Verdict(
                name,
                statistics.median(steady[:fifth]),
                statistics.median(steady[-fifth:]),
                max(mb for _, mb in samples),
                sampler.pss_peak.get(name, float("nan")),
            )
        )
    return out


def run_stream(bench: Bench, total: int, sampler: Sampler) -> dict[str, int]:
    """Feed ``total`` mixed signals, at most :data:`MAX_BACKLOG` waiting; wait for all."""
    worker = bench.procs[-1]
    sent = 0
    first_id: int | None = None
    last_id = 0
    counts: dict[str, int] = {}
    reported = 0
    while True:
        if first_id is not None:
            counts = count_final(bench, first_id, last_id)
            sampler.progress[0] = sum(counts.get(s, 0) for s in ("done", "rejected", "dead"))
        if sent >= total and sampler.progress[0] >= total:
            return counts
        if sampler.progress[0] >= reported + total // 10:
            reported = sampler.progress[0]
            print(f"  {reported} of {total} signals finished", file=sys.stderr, flush=True)
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited ({worker.returncode}): {bench.log_tail('memory')}")
        if sent < total and sent - sampler.progress[0] < MAX_BACKLOG:
            size = min(CHUNK, total - sent)
            ids = insert_rows(bench, mixed_signals(size, seed=11, start=sent))
            wake(bench, ids)
            first_id = ids[0] if first_id is None else first_id
            last_id = ids[-1]
            sent += size
        else:
            time.sleep(1.0)


def measure_stream(total: int) -> tuple[list[Verdict], dict[str, int], float]:
    with bench_environment() as bench:
        worker = bench.start_worker("worker.app", "memory")
        sampler = Sampler(worker.pid, [0])
        thread = threading.Thread(target=sampler.run, daemon=True)
        thread.start()
        started = time.perf_counter()
        try:
            counts = run_stream(bench, total, sampler)
        finally:
            sampler.stop.set()
            thread.join(timeout=5)
        elapsed = time.perf_counter() - started
    return verdicts(sampler, total), counts, elapsed


def rows(total: int, found: list[Verdict], counts: dict[str, int], elapsed: float) -> list[Row]:
    done = counts.get("done", 0)
    out = [
        Row(
            "P5",
            f"{total} mixed signals through a worker (c=2, no child recycling)",
            f"{done} done in {elapsed:.0f} s ({done / elapsed:.0f}/s)",
            goal=f"all {total} done",
            passed=done == total,
        )
    ]
    for v in found:
        out.append(
            Row(
                "P5",
                f"RSS {v.name}: median first fifth -> last fifth after warm-up",
                f"{v.first:.1f} -> {v.last:.1f} MB",
                ratio=f"{v.growth:+.1f} MB",
                goal=f"growth <= {TOLERANCE_MB:.0f} MB",
                passed=v.growth <= TOLERANCE_MB,
            )
        )
        out.append(
            Row(
                "P5",
                f"RSS {v.name}: peak",
                f"{v.peak:.1f} MB",
                goal=f"< {LIMIT_MB:.0f} MB",
                passed=v.peak < LIMIT_MB,
            )
        )
        out.append(Row("P5", f"PSS {v.name}: peak (shared pages split among sharers)", f"{v.pss_peak:.1f} MB"))
    return out


def measure(quick: bool) -> list[Row]:
    total = QUICK if quick else FULL
    found, counts, elapsed = measure_stream(total)
    return rows(total, found, counts, elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few hundred signals: a smoke run")
    parser.add_argument("--signals", type=int, help=f"signals to process (default {FULL})")
    args = parser.parse_args(argv)
    total = args.signals or (QUICK if args.quick else FULL)
    found, counts, elapsed = measure_stream(total)
    table = rows(total, found, counts, elapsed)
    print(render(table))
    return 0 if all(r.passed is not False for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
