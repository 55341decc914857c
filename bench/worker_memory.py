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

The same stream then goes through a second worker with ``REVERIE_KEY_MATCHING=off``
(no key-matching model loaded): the baseline, measured in the same run. The worker's
total is the sum of its three processes' PSS, each shared page counted once.

Goals: per process, flat after warm-up (the median RSS of the last fifth of the run at
most the first fifth's plus :data:`TOLERANCE_MB`, warm-up being the first
:data:`WARMUP_SHARE` of the signals) and below :data:`LIMIT_MB`; the three processes
together, with the key matcher loaded, at most :data:`TOTAL_LIMIT_MB` of PSS, read at one
moment (one sampling pass). The sum of each process's own peak is shown too, but it
overstates: the parent's peak comes before the pool forks, when the pages it later
shares with the children still count in full for it alone.

    python -m bench.worker_memory [--quick] [--signals N] [--breakdown]

``--breakdown`` also prints, once the stream is done, where each process's memory is:
its PSS and private dirty pages by mapping (the heap, anonymous memory, each library).
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
#: PSS of the parent and both children together, with the key matcher loaded.
TOTAL_LIMIT_MB = 520.0
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


def breakdown(pid: int, top: int = 8) -> list[tuple[str, float, float]]:
    """Where ``pid``'s memory is: (mapping, PSS MiB, private dirty MiB) for the mappings
    with the most private dirty pages (files by base name; the heap and anonymous memory
    as ``[heap]`` and ``[anon]``)."""
    pss: dict[str, int] = {}
    dirty: dict[str, int] = {}
    name = "[anon]"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if not parts[0].endswith(":"):
            path = " ".join(parts[5:])
            name = Path(path).name if path.startswith("/") else path or "[anon]"
        elif parts[0] == "Pss:":
            pss[name] = pss.get(name, 0) + int(parts[1])
        elif parts[0] == "Private_Dirty:":
            dirty[name] = dirty.get(name, 0) + int(parts[1])
    ranked = sorted(pss, key=lambda n: (dirty.get(n, 0), pss[n]), reverse=True)[:top]
    return [(n, pss[n] / 1024, dirty.get(n, 0) / 1024) for n in ranked]


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
    #: The highest PSS of the parent and all its children read in one sampling pass.
    total_peak: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)
    pids: dict[str, int] = field(default_factory=dict)

    def processes(self) -> dict[str, int]:
        procs = {"parent": self.parent}
        for n, child in enumerate(children(self.parent)):
            procs[f"child {n + 1}"] = child
        return procs

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            total = 0.0
            for name, pid in self.processes().items():
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
                    total += pss
            self.total_peak = max(self.total_peak, total)


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


@dataclass
class Stream:
    """What one worker did with the stream, and its memory."""

    found: list[Verdict]
    counts: dict[str, int]
    elapsed: float
    total_peak: float
    #: Process name -> its mappings with the most private dirty pages, once the stream is done.
    where: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return self.counts.get("done", 0)

    @property
    def sum_of_peaks(self) -> float:
        return sum(v.pss_peak for v in self.found)


def measure_stream(total: int, key_matching: str | None = None) -> Stream:
    """Run the stream through a worker; ``key_matching`` sets ``REVERIE_KEY_MATCHING``
    (None: the default, the matcher with its model)."""
    extra = {} if key_matching is None else {"REVERIE_KEY_MATCHING": key_matching}
    with bench_environment(extra_env=extra) as bench:
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
        where = {name: breakdown(pid) for name, pid in sampler.processes().items()}
    return Stream(verdicts(sampler, total), counts, elapsed, sampler.total_peak, where)


def rows(total: int, stream: Stream, baseline: Stream) -> list[Row]:
    done, elapsed = stream.done, stream.elapsed
    out = [
        Row(
            "P5",
            f"{total} mixed signals through a worker (c=2, no child recycling)",
            f"{done} done in {elapsed:.0f} s ({done / elapsed:.0f}/s)",
            baseline=f"key matching off: {baseline.done} done in {baseline.elapsed:.0f} s",
            goal=f"all {total} done",
            passed=done == total and baseline.done == total,
        )
    ]
    found = stream.found
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
        off = next((b.pss_peak for b in baseline.found if b.name == v.name), None)
        out.append(
            Row(
                "P5",
                f"PSS {v.name}: peak (shared pages split among sharers)",
                f"{v.pss_peak:.1f} MB",
                baseline="-" if off is None else f"{off:.1f} MB (key matching off)",
                ratio="-" if off is None else f"{v.pss_peak - off:+.1f} MB",
            )
        )
    out.append(
        Row(
            "P5",
            "PSS total: parent and children at one moment, the highest (each shared page counted once)",
            f"{stream.total_peak:.1f} MB",
            baseline=f"{baseline.total_peak:.1f} MB (key matching off)",
            ratio=f"{stream.total_peak - baseline.total_peak:+.1f} MB",
            goal=f"<= {TOTAL_LIMIT_MB:.0f} MB",
            passed=stream.total_peak <= TOTAL_LIMIT_MB,
        )
    )
    out.append(
        Row(
            "P5",
            "PSS total: sum of each process's own peak (counts the parent's pages before the fork again)",
            f"{stream.sum_of_peaks:.1f} MB",
            baseline=f"{baseline.sum_of_peaks:.1f} MB (key matching off)",
            ratio=f"{stream.sum_of_peaks - baseline.sum_of_peaks:+.1f} MB",
        )
    )
    return out


def both(total: int) -> tuple[Stream, Stream]:
    """The stream with the key matcher as configured, then with key matching off."""
    return measure_stream(total), measure_stream(total, key_matching="off")


def print_breakdown(label: str, stream: Stream) -> None:
    for name, mappings in stream.where.items():
        print(f"{label}, {name}, once the stream was done (PSS / private dirty MiB):", file=sys.stderr)
        for mapping, pss, dirty in mappings:
            print(f"  {mapping:<48} {pss:7.1f} {dirty:7.1f}", file=sys.stderr)


def measure(quick: bool) -> list[Row]:
    total = QUICK if quick else FULL
    return rows(total, *both(total))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few hundred signals: a smoke run")
    parser.add_argument("--signals", type=int, help=f"signals to process (default {FULL})")
    parser.add_argument("--breakdown", action="store_true", help="print each process's memory by mapping")
    args = parser.parse_args(argv)
    total = args.signals or (QUICK if args.quick else FULL)
    stream, baseline = both(total)
    if args.breakdown:
        print_breakdown("key matcher", stream)
        print_breakdown("key matching off", baseline)
    table = rows(total, stream, baseline)
    print(render(table))
    return 0 if all(r.passed is not False for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
