"""The metric families of docs/reference.md (Metrics), as a scraper and node-exporter see them."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import stat
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from store.db import session_scope
from store.signals import insert_signal
from worker.metrics_server import serve
from worker.metrics_textfile import write_textfile
from worker.producer import enqueue_signal
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]

#: docs/reference.md, Metrics: family -> (type, label names).
DOCUMENTED_FAMILIES: dict[str, tuple[str, frozenset[str]]] = {
    "dream_users_processed": ("counter", frozenset()),
    "dream_entries_pruned": ("counter", frozenset()),
    "dream_contradictions_found": ("counter", frozenset()),
    "dream_entries_summarized": ("counter", frozenset()),
    "dream_cycles_failed": ("counter", frozenset()),
    "dream_duration_seconds": ("histogram", frozenset()),
    "dream_signals_processed": ("counter", frozenset({"kind", "outcome"})),
    "dream_signal_lag_seconds": ("histogram", frozenset({"kind"})),
    "dream_signals_pending": ("gauge", frozenset({"kind"})),
    "dream_memory_writes": ("counter", frozenset({"source", "action"})),
    "dream_llm_cost_usd": ("counter", frozenset({"model", "purpose"})),
    "dream_llm_tokens": ("counter", frozenset({"model", "direction"})),
    "dream_llm_requests": ("counter", frozenset({"model", "outcome"})),
    "dream_budget_exhausted": ("counter", frozenset({"scope"})),
}

USERS = ("user-7f3a-alice@corp", "user-91bc-bob", "user-aa02-carol")

# A worker stand-in: the real signal pass in two forked children (as prefork runs
# them), each marked dead when it exits, then the parent serves the aggregate.
SERVED_PROCESS = textwrap.dedent(
    """
    import multiprocessing, sys
    from pathlib import Path
    from worker.metrics_server import prepare_multiprocess_dir, mark_dead
    prepare_multiprocess_dir(Path(sys.argv[1]))
    from worker.settings import Settings
    from worker.metrics_server import serve, refresh_pending_gauge
    from worker import metrics
    from worker.logging_setup import configure_logging
    settings = Settings(_env_file=None, database_url=sys.argv[2], metrics_port=int(sys.argv[3]), log_format="json")
    configure_logging(settings, stream=sys.stderr)

    def session_end(user, text):
        from worker.producer import enqueue_signal
        payload = {"conversation_id": text, "messages": [{"role": "user", "content": text}]}
        enqueue_signal("session_end", user, payload, settings=settings)

    def signal_pass():
        from tasks.signals import process_pending
        process_pending(settings)

    def later_signal_pass():
        session_end("user-aa02-carol", "my pet name is Rex")
        signal_pass()

    def dream_stand_in():
        # What a finished dream run counts; the run itself is the dream engine's.
        metrics.USERS_PROCESSED.inc()
        metrics.DURATION.observe(0.2)

    # Loaded once in the parent, as a preforking worker would, not once per child.
    from worker.llm import _load
    _load()
    ctx = multiprocessing.get_context("fork")
    for target in (signal_pass, later_signal_pass, dream_stand_in):
        child = ctx.Process(target=target)
        child.start()
        child.join()
        assert child.exitcode == 0, child.exitcode
        mark_dead(child.pid)
    session_end("user-91bc-bob", "my home city is Lyon")  # left waiting
    refresh_pending_gauge(settings)
    server = serve(settings, addr="127.0.0.1")
    print("ready", flush=True)
    sys.stdin.read()
    server.close()
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def session_end(text: str) -> dict[str, object]:
    return {"conversation_id": "c-1", "messages": [{"role": "user", "content": text}]}


def enqueue_work(settings: Settings) -> None:
    """Three session ends and one malformed feedback, inserted as any producer may."""
    for n, user in enumerate(USERS):
        enqueue_signal("session_end", user, session_end(f"my favorite color is blue {n}"), settings=settings)
    with session_scope(settings) as session:
        # Inserted by hand, as any producer may: the worker, not the producer, rejects it.
        insert_signal(
            session,
            kind="feedback",
            user_id=USERS[0],
            payload={"deliverable_id": "d"},
            agent_id=None,
            idempotency_key="bad-feedback",
            fallback_key="bad-feedback",
        )


@contextmanager
def served_metrics(settings: Settings, directory: Path) -> Iterator[int]:
    """Run the stand-in worker; yield the port its parent serves ``/metrics`` on."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    log_path = directory.parent / "served-metrics.log"
    with (
        log_path.open("w") as log_file,
        subprocess.Popen(
            [sys.executable, "-c", SERVED_PROCESS, str(directory), settings.database_url, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            cwd=ROOT,
            env=env,
            text=True,
        ) as proc,
    ):
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if proc.stdout.readline().strip() != "ready":
                proc.kill()
                proc.wait(timeout=10)
                pytest.fail(f"metrics process did not start: {log_path.read_text()[-3000:]}")
            yield port
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body: bytes = response.read()
    return body.decode("utf-8")


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def assert_documented_families(text: str) -> None:
    found = {family.name: family for family in text_string_to_metric_families(text)}
    for name, (kind, labels) in DOCUMENTED_FAMILIES.items():
        assert name in found, f"family {name} missing from the exposition"
        family = found[name]
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (sample.name, sample.labels)


def test_served_endpoint_has_every_family_sums_children_and_no_user_id(pg_settings: Settings, tmp_path: Path) -> None:
    enqueue_work(pg_settings)
    stale = tmp_path / "mp" / "counter_4242424.db"
    stale.parent.mkdir()
    stale.write_bytes(b"left by an earlier run")

    with served_metrics(pg_settings, tmp_path / "mp") as port:
        text = scrape(port)

    assert_documented_families(text)
    # An earlier run's file is wiped at start (its counts are not this worker's).
    assert not stale.exists()
    # Two children processed five signals between them; the parent's page adds them up.
    done = sample_value(text, "dream_signals_processed_total", kind="session_end", outcome="done")
    rejected = sample_value(text, "dream_signals_processed_total", kind="feedback", outcome="rejected")
    assert (done, rejected) == (4.0, 1.0)
    assert sample_value(text, "dream_signal_lag_seconds_count", kind="session_end") == 4.0
    assert sample_value(text, "dream_users_processed_total") == 1.0
    assert sample_value(text, "dream_duration_seconds_count") == 1.0
    # One session_end signal is still waiting, and the gauge says so (zeros for the rest).
    assert sample_value(text, "dream_signals_pending", kind="session_end") == 1.0
    assert sample_value(text, "dream_signals_pending", kind="feedback") == 0.0
    # Known label sets exist from the start, so alerts see the first dead signal.
    assert 'dream_signals_processed_total{kind="activity",outcome="dead"} 0.0' in text
    assert 'dream_budget_exhausted_total{scope="day"} 0.0' in text

    label_values = {
        value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for value in sample.labels.values()
    }
    for user in USERS:
        assert user not in label_values
        assert user not in text


def test_dead_children_live_gauges_are_dropped(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import multiprocessing, os, sys
        from pathlib import Path
        from worker.metrics_server import prepare_multiprocess_dir, reap_dead_processes
        directory = prepare_multiprocess_dir(Path(sys.argv[1]))
        from prometheus_client import Gauge
        g = Gauge("probe_live", "probe", multiprocess_mode="livesum")
        def child():
            g.set(5)
            os._exit(0)  # as if killed: no shutdown hook runs
        p = multiprocessing.get_context("fork").Process(target=child)
        p.start(); p.join()
        before = sorted(f.name for f in directory.glob("gauge_livesum_*.db"))
        print(len(before), reap_dead_processes(directory) == [p.pid],
              sorted(f.name for f in directory.glob("gauge_livesum_*.db")) == [f"gauge_livesum_{os.getpid()}.db"])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    assert out.stdout.split() == ["2", "True", "True"], out.stderr


def _worker_env(settings: Settings, redis_url: str, temp: Path) -> dict[str, str]:
    from tests.processes import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        TMPDIR=str(temp),
        REVERIE_DATABASE_URL=settings.database_url,
        REVERIE_BROKER_URL=redis_url,
        REVERIE_METRICS_PORT=str(free_port()),
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    return env


def _wait_ready(log: Path, alive: Any) -> None:
    import time

    deadline = time.monotonic() + 90
    while "ready." not in (log.read_text(errors="replace") if log.exists() else ""):
        assert alive() and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:] if log.exists() else ""
        time.sleep(0.2)


def _metrics_dirs(temp: Path) -> set[str]:
    return {p.name for p in temp.glob("reverie-metrics-*")}


def _made(temp: Path, name: str, *, host: str | None = None, extra: str | None = None, age: float = 3600) -> Path:
    """A metrics directory as a worker of ``host`` (this one by default) made it ``age`` seconds ago."""
    import socket
    import time

    directory = temp / f"reverie-metrics-{name}"
    directory.mkdir()
    owner = directory / "reverie-owner"
    owner.write_text((host or socket.gethostname()) + "\n")
    (directory / "counter_12345.db").write_bytes(b"\0" * 64)
    if extra:
        (directory / extra).write_text("mine")
    os.utime(owner, (time.time() - age, time.time() - age))
    return directory


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGQUIT"])
def test_a_worker_removes_the_metrics_directory_it_made_and_those_nobody_holds(
    pg_settings: Settings, redis_url: str, tmp_path: Path, stop: str
) -> None:
    """``reverie worker`` with no ``PROMETHEUS_MULTIPROC_DIR`` makes its own directory
    under the temp dir; stopped (SIGTERM), it leaves none behind. One left by a worker
    killed outright (nobody holds it) is removed at the next start; one a running process
    holds, one made moments ago, one made on another host, one holding a file of someone
    else's, and one Reverie did not make are kept. A cold shutdown (SIGQUIT: Celery sends
    no ``worker_shutdown``) removes it too."""
    import fcntl
    import signal

    temp = tmp_path / "tmp"
    temp.mkdir()
    abandoned = _made(temp, "abandoned")
    held = _made(temp, "held")  # a live worker's (in another container, say): it holds the lock
    holder = os.open(held / "reverie-owner", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    kept = [
        held,
        _made(temp, "starting", age=5),  # its worker is still starting: not taken for abandoned
        _made(temp, "elsewhere", host="another-host"),
        _made(temp, "foreign", extra="notes.txt"),
    ]
    unmarked = temp / "reverie-metrics-1"
    unmarked.mkdir()  # no owner file: an older version's, or the operator's own
    kept.append(unmarked)
    before = _metrics_dirs(temp)

    reverie = str(Path(sys.executable).parent / "reverie")
    log = tmp_path / "worker.log"
    try:
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [reverie, "worker", "-c", "1"],
                cwd=tmp_path,
                env=_worker_env(pg_settings, redis_url, temp),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait_ready(log, lambda: worker.poll() is None)
            new = _metrics_dirs(temp) - before
            assert len(new) == 1, sorted(_metrics_dirs(temp))
            own = temp / new.pop()
            assert any(own.glob("*.db"))
            assert not abandoned.exists()
            assert all(d.exists() for d in kept)
            worker.send_signal(getattr(signal, stop))
            assert worker.wait(timeout=60) == 0, log.read_text(errors="replace")[-3000:]
        finally:
            # Its whole process group (its pool children too), whatever failed above.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
    finally:
        os.close(holder)
    assert not own.exists()
    assert _metrics_dirs(temp) == {d.name for d in kept}


def _processes_naming(text: str) -> list[int]:
    """The processes whose command line holds ``text`` (a path unique to one test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def test_a_detached_worker_keeps_its_metrics_directory_until_it_stops_even_cold(
    pg_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    """``--detach`` (as ``celery multi`` starts workers) runs the worker under another
    process id than the one that made its directory: another worker's start does not take
    it for abandoned, its values still count, and a cold shutdown (SIGQUIT, which sends no
    ``worker_shutdown``) removes it all the same."""
    import signal
    import time

    temp = tmp_path / "tmp"
    temp.mkdir()
    env = _worker_env(pg_settings, redis_url, temp)
    reverie = str(Path(sys.executable).parent / "reverie")
    log, pidfile = tmp_path / "detached.log", tmp_path / "detached.pid"
    argv = [reverie, "worker", "-c", "1", "--", "--detach", f"--logfile={log}", f"--pidfile={pidfile}"]
    subprocess.run(argv, cwd=tmp_path, env=env, check=True, timeout=60, capture_output=True)
    port = env["REVERIE_METRICS_PORT"]

    def page() -> str:
        # Detached, the worker writes nowhere we read: its /metrics page says it is up.
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            return ""

    def running() -> int | None:
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if os.path.exists(f"/proc/{pid}") else None

    pid: int | None = None
    try:
        deadline = time.monotonic() + 90
        while "dream_signals_processed_total" not in page() or running() is None:
            # (Under load its page can be up before its pidfile is written.)
            assert time.monotonic() < deadline, "the detached worker never served /metrics, or wrote no pidfile"
            time.sleep(0.3)
        pid = running()
        assert pid is not None
        (name,) = _metrics_dirs(temp)
        own = temp / name
        owner = own / "reverie-owner"
        os.utime(owner, (time.time() - 3600, time.time() - 3600))  # long past its start
        sweep = "from worker.metrics_server import remove_abandoned_dirs; print(remove_abandoned_dirs())"
        swept = subprocess.run(
            [sys.executable, "-c", sweep], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60
        )
        assert swept.stdout.strip() == "[]", swept.stdout
        assert own.is_dir() and any(own.glob("*.db"))
        assert "dream_signals_processed_total" in page()
        os.kill(pid, signal.SIGQUIT)
        # By the process, not its pidfile: Celery removes that before the process is done.
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        # Detached, it is no child of ours, and left behind it would take the next tests'
        # signals: every process started with this test's pidfile goes, whatever failed.
        for left in _processes_naming(str(pidfile)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(left, signal.SIGKILL)
    assert not own.exists(), sorted(p.name for p in own.iterdir())


def test_a_metrics_directory_the_operator_names_is_never_removed(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from worker.metrics_server import prepare_multiprocess_dir, remove_own_dir
        prepare_multiprocess_dir()
        from prometheus_client import Counter
        Counter("probe", "probe").inc()
        print(remove_own_dir())
        """
    )
    named = tmp_path / "named"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(named), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.split() == ["False"], out.stderr
    assert any(named.glob("counter_*.db"))


def test_textfile_has_every_family_and_only_reverie_families(tmp_path: Path) -> None:
    target = tmp_path / "reverie.prom"
    write_textfile(target)

    text = target.read_text("utf-8")
    assert_documented_families(text)
    assert all(name.startswith("dream_") for name in families(text))
    # node-exporter usually runs as another user.
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["reverie.prom"]


def test_textfile_replaces_atomically_and_keeps_the_old_file_on_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = CollectorRegistry()
    counter = Counter("dream_probe", "probe", registry=registry)
    target = tmp_path / "reverie.prom"
    write_textfile(target, registry)
    counter.inc(3)
    inode_before = target.stat().st_ino
    write_textfile(target, registry)
    assert "dream_probe_total 3.0" in target.read_text("utf-8")
    # A new inode: the file was renamed over, never rewritten where a reader could see it half-done.
    assert target.stat().st_ino != inode_before

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    counter.inc()
    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        write_textfile(target, registry)
    assert "dream_probe_total 3.0" in target.read_text("utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["reverie.prom"]


def test_a_fresh_worker_exports_every_family_at_zero_from_the_first_scrape(
    pg_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    """A real worker, nothing done yet: every family, with every label value known in
    advance, is on its first page, at zero, so ``rate()`` and the alerts see it."""
    from tests.processes import Service, wait_until
    from worker import metrics as families
    from worker.payloads import KINDS

    service = Service(tmp_path, pg_settings.database_url, redis_url)
    service.worker()
    try:
        wait_until("the worker is ready", service.worker_ready, 90, service)
        with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as response:
            page = response.read().decode()
    finally:
        service.stop_all()
    samples: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    for name, (kind, labels) in DOCUMENTED_FAMILIES.items():
        series = samples.get(f"{name}_total" if kind == "counter" else f"{name}_count" if kind == "histogram" else name)
        assert series, f"{name} is missing from a fresh worker's first scrape"
        assert all(value == 0 for value in series.values()), (name, series)
        assert all({k for k, _ in key} == labels for key in series), (name, series)

    def has(name: str, **labels: str) -> bool:
        return frozenset(labels.items()) in samples.get(name, {})

    model = "offline"
    for kind in KINDS:
        assert has("dream_signals_pending", kind=kind)
        assert has("dream_signal_lag_seconds_count", kind=kind)
        for outcome in ("done", "rejected", "failed", "dead"):
            assert has("dream_signals_processed_total", kind=kind, outcome=outcome)
    # A row inserted with another kind: rejected, counted under kind "unknown".
    assert has("dream_signals_processed_total", kind="unknown", outcome="rejected")
    for scope in ("run", "day"):
        assert has("dream_budget_exhausted_total", scope=scope)
    for source in ("session_end", "feedback", "activity", "summarize"):
        for action in ("insert", "update", "delete"):
            assert has("dream_memory_writes_total", source=source, action=action)
    for direction in ("input", "output"):
        assert has("dream_llm_tokens_total", model=model, direction=direction)
    for outcome in families.LLM_OUTCOMES:
        assert has("dream_llm_requests_total", model=model, outcome=outcome)
    for purpose in ("extract_facts", "feedback", "summarize", "profile"):
        assert has("dream_llm_cost_usd_total", model=model, purpose=purpose)
    for verdict in families.PROFILE_VERDICTS:
        assert has("dream_profile_model_replies_total", verdict=verdict)


def _samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = path.read_text("utf-8")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _cron_pass(settings: Settings, target: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env.update(REVERIE_DATABASE_URL=settings.database_url, REVERIE_BROKER_URL="")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from worker.cli import main; main()",
            "run",
            "--json",
            "--metrics-textfile",
            str(target),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=True,
    )


def test_textfile_counters_add_up_across_cron_runs(pg_settings: Settings, tmp_path: Path) -> None:
    target = tmp_path / "reverie.prom"
    done = ("dream_signals_processed_total", (("kind", "activity"), ("outcome", "done")))
    lag = ("dream_signal_lag_seconds_count", (("kind", "activity"),))
    created = ("dream_signals_processed_created", (("kind", "activity"), ("outcome", "done")))
    seen = []
    for run, signals in enumerate((2, 1, 0)):
        for i in range(signals):
            event = {"action": f"digest-{run}-{i}", "at": "2026-11-23T09:00:00"}
            enqueue_signal("activity", "ann", {"events": [event]}, settings=pg_settings)
        _cron_pass(pg_settings, target)
        seen.append(_samples(target))
    assert [s[done] for s in seen] == [2.0, 3.0, 3.0]
    assert [s[lag] for s in seen] == [2.0, 3.0, 3.0]
    # Every cumulative sample only grows, and a series keeps the time it began.
    for before, after in itertools.pairwise(seen):
        for key, value in before.items():
            if key[0].endswith(("_total", "_count", "_bucket")):
                assert after[key] >= value, key
    assert len({s[created] for s in seen}) == 1


def test_textfile_writes_in_one_process_count_once(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    counter = Counter("dream_probe", "probe", registry=registry)
    target = tmp_path / "reverie.prom"
    target.write_text("# TYPE dream_probe_total counter\ndream_probe_total 10.0\n")
    counter.inc(2)
    write_textfile(target, registry)
    counter.inc(1)
    write_textfile(target, registry)
    assert "dream_probe_total 13.0" in target.read_text("utf-8")


def test_metrics_address_is_a_setting(sqlite_settings: Settings) -> None:
    assert Settings(_env_file=None).metrics_addr == "0.0.0.0"  # type: ignore[call-arg]
    settings = sqlite_settings.model_copy(update={"metrics_addr": "127.0.0.1", "metrics_port": free_port()})
    server = serve(settings)
    try:
        assert server._server.server_address[:2] == ("127.0.0.1", settings.metrics_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{settings.metrics_port}/metrics", timeout=10) as response:
            assert b"dream_signals_processed_total" in response.read()
    finally:
        server.close()


def _write_twice(target: str, barrier: Any) -> None:
    registry = CollectorRegistry()
    counter = Counter("dream_probe", "probe", registry=registry)
    barrier.wait(timeout=60)
    for _ in range(2):
        counter.inc()
        write_textfile(Path(target), registry)


def test_concurrent_textfile_writers_lose_no_count(tmp_path: Path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    writers = 8
    barrier = ctx.Barrier(writers)
    target = tmp_path / "reverie.prom"
    procs = [ctx.Process(target=_write_twice, args=(str(target), barrier)) for _ in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    assert f"dream_probe_total {2.0 * writers}" in target.read_text("utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["reverie.prom"]
