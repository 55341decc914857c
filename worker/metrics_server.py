"""The worker's ``/metrics`` endpoint, aggregating every prefork child.

prometheus-client's multiprocess mode keeps each process's values in files under
``PROMETHEUS_MULTIPROC_DIR``. It decides between in-memory and file-backed values
when it is first imported, so the directory has to be named before that:
:func:`prepare_multiprocess_dir` does it for ``reverie worker``. The worker's parent
then wipes what earlier runs left (:func:`wipe_multiprocess_dir`) and serves the sum
of all files (:func:`serve`); children that exit are marked dead so that their live
gauges stop counting.

``prometheus_client`` (and ``worker.metrics``, which imports it) is imported inside
functions on purpose: importing it here would fix single-process mode before
:func:`prepare_multiprocess_dir` runs.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.errors import ConfigError, DatabaseUnavailable, SchemaMissing
from worker.settings import Settings

# The environment variable is prometheus-client's own switch, not a Reverie setting.
ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")
_PID_FILE = re.compile(r"_(\d+)\.db$")


def multiprocess_dir() -> Path | None:
    """The directory prometheus-client writes to in this process, or ``None``."""
    value = os.environ.get(ENV_VAR) or os.environ.get(ENV_VAR.lower())
    return Path(value) if value else None


def prepare_multiprocess_dir(directory: Path | None = None) -> Path:
    """Switch this process (and the children it forks) to multiprocess metrics.

    Uses ``directory``, else an already set ``PROMETHEUS_MULTIPROC_DIR``, else a new
    directory under the system temp dir; creates it, empties it and exports it.
    Must run before anything imports ``prometheus_client`` (``worker.metrics`` does);
    raises :class:`ConfigError` when that has already happened without it.
    """
    current = multiprocess_dir()
    if "prometheus_client.values" in sys.modules and current is None:
        raise ConfigError(
            f"prometheus_client was imported before {ENV_VAR} was set; "
            "metrics of worker children would be lost (start the worker with `reverie worker`)"
        )
    chosen = directory or current
    if chosen is None:
        # Reverie's own directory, a new one under the temp dir, removed when the worker
        # stops (:func:`remove_own_dir`); those of workers killed outright go now.
        remove_abandoned_dirs()
        chosen = Path(tempfile.mkdtemp(prefix=OWN_PREFIX))
        (chosen / OWNER_FILE).write_text(_host() + "\n", "utf-8")
        hold_own_dir(chosen)
    chosen.mkdir(parents=True, exist_ok=True)
    wipe_multiprocess_dir(chosen)
    os.environ[ENV_VAR] = str(chosen)
    return chosen


#: Reverie's own metrics directories: ``<temp dir>/reverie-metrics-<random>``.
OWN_PREFIX = "reverie-metrics-"
#: In a metrics directory Reverie made (and will remove): the host it was made on. A
#: process using the directory holds a shared lock on it (:func:`hold_own_dir`).
OWNER_FILE = "reverie-owner"
#: A directory nobody holds is abandoned only this long after it was made: the worker
#: takes its lock again once started (``--detach`` forks and closes what it inherited).
ABANDONED_AFTER_SECONDS = 300.0
_held: list[int] = []


def _host() -> str:
    import socket

    return socket.gethostname()


def _is_own(directory: Path) -> bool:
    """Whether Reverie made ``directory`` on this host and it holds nothing but metrics files."""
    try:
        if directory.is_symlink() or (directory / OWNER_FILE).read_text("utf-8").strip() != _host():
            return False
        return all(p.name == OWNER_FILE or (p.is_file() and p.suffix == ".db") for p in directory.iterdir())
    except OSError:
        return False


def hold_own_dir(directory: Path | None = None) -> bool:
    """Hold a shared lock on Reverie's own metrics directory (``directory``, else this
    process's) for the rest of this process and the children it forks: while any of
    them runs, no other worker takes the directory for abandoned. (A lock, not a
    process id: a worker detaches under another id, and containers sharing the temp
    dir do not see each other's processes.) Whether one is held."""
    import fcntl

    directory = directory or multiprocess_dir()
    if directory is None or not (directory / OWNER_FILE).is_file():
        return False
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        return False
    os.set_inheritable(fd, True)  # kept across `reverie worker`'s exec of Celery
    _held.append(fd)
    return True


def _in_use(directory: Path) -> bool:
    import fcntl

    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or not lockable: in use, as far as we know
        return True
    finally:
        os.close(fd)  # the lock, if taken, goes with it
    return False


def remove_own_dir(directory: Path | None = None) -> bool:
    """Remove this process's metrics directory (``directory``: the one it uses) if
    Reverie made it (a worker that stops); a directory the operator named is left as it
    is. Whether it was removed."""
    import shutil

    directory = directory or multiprocess_dir()
    if directory is None or not directory.name.startswith(OWN_PREFIX) or not _is_own(directory):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not directory.exists()


def remove_abandoned_dirs() -> list[Path]:
    """Remove the metrics directories Reverie made on this host that no process holds
    any more (their worker was killed outright, and never removed its own), made more
    than :data:`ABANDONED_AFTER_SECONDS` ago; returns them."""
    import shutil
    import time

    removed: list[Path] = []
    try:
        candidates = [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(OWN_PREFIX)]
    except OSError:
        return removed
    for path in candidates:
        try:
            age = time.time() - (path / OWNER_FILE).stat().st_mtime
        except OSError:
            continue
        if age < ABANDONED_AFTER_SECONDS or not path.is_dir() or not _is_own(path) or _in_use(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def wipe_multiprocess_dir(directory: Path, *, keep_pid: int | None = None) -> int:
    """Delete the value files of earlier processes; return how many were removed.

    Files of ``keep_pid`` (the serving process, whose values are already mapped)
    survive. Files that are not prometheus-client's are left alone.
    """
    removed = 0
    for path in directory.glob("*.db"):
        match = _PID_FILE.search(path.name)
        if match is None or (keep_pid is not None and int(match.group(1)) == keep_pid):
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def mark_dead(pid: int) -> None:
    """Stop counting the live gauges of process ``pid`` (a child that exited)."""
    directory = multiprocess_dir()
    if directory is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_dead_processes(directory: Path) -> list[int]:
    """Mark dead every process with live-gauge files that no longer runs.

    A child killed outright (OOM, hard time limit) never sends
    ``worker_process_shutdown``; this catches it at the next scrape.
    """
    dead: list[int] = []
    for path in directory.glob("gauge_live*.db"):
        match = _LIVE_GAUGE_FILE.match(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not _alive(pid) and pid not in dead:
            dead.append(pid)
    for pid in dead:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    return dead


class _ReapingCollector:
    """MultiProcessCollector that first forgets the live gauges of dead processes."""

    def __init__(self, directory: Path) -> None:
        from prometheus_client import multiprocess

        self._directory = directory
        self._inner = multiprocess.MultiProcessCollector(None, path=str(directory))  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Any]:
        reap_dead_processes(self._directory)
        return self._inner.collect()  # type: ignore[no-untyped-call,no-any-return]


def initialise_label_sets(model: str | None = None) -> None:
    """Create the zero-valued series whose label values are known in advance.

    Every family, with each label value known before anything happens (kinds,
    outcomes, sources, actions, directions, scopes, and ``model``, the configured
    model), is exported from the first scrape: ``rate()``, ``increase()`` and alerts
    see a fresh worker, and the first event does not merely create its series.
    """
    from worker import metrics
    from worker.payloads import KINDS

    for kind in KINDS:
        metrics.SIGNAL_LAG.labels(kind)
        metrics.SIGNALS_PENDING.labels(kind)
        metrics.SIGNALS_DEAD.labels(kind)
        for outcome in metrics.SIGNAL_OUTCOMES:
            metrics.SIGNALS_PROCESSED.labels(kind, outcome)
    # A row inserted with a kind Reverie does not know ends rejected, counted so.
    metrics.SIGNALS_PROCESSED.labels("unknown", "rejected")
    for scope in metrics.BUDGET_SCOPES:
        metrics.BUDGET_EXHAUSTED.labels(scope)
    for source in metrics.MEMORY_WRITE_SOURCES:
        for action in metrics.MEMORY_WRITE_ACTIONS:
            metrics.MEMORY_WRITES.labels(source=source, action=action)
    if model is not None:
        for purpose in metrics.LLM_PURPOSES:
            metrics.LLM_COST.labels(model=model, purpose=purpose)
        for direction in metrics.LLM_DIRECTIONS:
            metrics.LLM_TOKENS.labels(model=model, direction=direction)
            metrics.LLM_USAGE_OVER_RESERVATION.labels(model=model, direction=direction)
        metrics.LLM_UNRECORDED_COST.labels(model=model)
        for outcome in metrics.LLM_OUTCOMES:
            metrics.LLM_REQUESTS.labels(model=model, outcome=outcome)
    for reason in metrics.KEY_MODEL_REASONS:
        metrics.KEY_MODEL_UNAVAILABLE.labels(reason)
    for verdict in metrics.PROFILE_VERDICTS:
        metrics.PROFILE_MODEL_REPLIES.labels(verdict)


def build_registry() -> Any:
    """The registry to expose: all processes' files in multiprocess mode, else this process."""
    from prometheus_client import REGISTRY, CollectorRegistry, ProcessCollector

    directory = multiprocess_dir()
    if directory is None:
        return REGISTRY
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReapingCollector(directory))
    # The serving process's own start time and resources: "how long has the worker been up".
    ProcessCollector(registry=registry)
    return registry


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it."""

    port: int
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(settings: Settings, *, addr: str | None = None) -> MetricsServer:
    """Serve ``/metrics`` on ``settings.metrics_addr`` (or ``addr``) and
    ``settings.metrics_port`` from a daemon thread.

    In multiprocess mode the page sums the files of every process, so one endpoint in
    the worker's parent covers all of its children. Raises :class:`ConfigError` when
    the port is taken.
    """
    from prometheus_client import start_http_server

    import worker.metrics  # noqa: F401 - registers every family in single-process mode

    initialise_label_sets(settings.llm_model)
    _first_gauge_values(settings)
    where = addr or settings.metrics_addr
    try:
        server, thread = start_http_server(settings.metrics_port, addr=where, registry=build_registry())
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {where} port {settings.metrics_port}: {exc.strerror or exc}"
        ) from exc
    return MetricsServer(port=settings.metrics_port, _server=server, _thread=thread)


def _first_gauge_values(settings: Settings) -> None:
    """Give the queue gauges a value before the first scrape.

    They keep the most recent value any process set, and a series nobody has set is not
    exported at all; so read the queue now, or say 0 while the database cannot answer
    (the periodic refresh corrects it). The serving process's connection is closed
    afterwards: a preforking worker's children open their own.
    """
    from store.db import dispose_engines
    from worker import metrics
    from worker.payloads import KINDS

    try:
        refresh_pending_gauge(settings)
    except (DatabaseUnavailable, SchemaMissing):
        for kind in KINDS:
            metrics.SIGNALS_PENDING.labels(kind).set(0)
            metrics.SIGNALS_DEAD.labels(kind).set(0)
        metrics.SIGNALS_OLDEST_PENDING_AGE.set(0)
        metrics.SIGNALS_GAUGES_READ_AT.set(0)  # not read: the stale-gauges alert says so
    finally:
        dispose_engines()


def refresh_pending_gauge(settings: Settings) -> dict[str, int]:
    """Set ``dream_signals_pending{kind}`` (and the dead and oldest-age gauges) from the database.

    Waiting means ``pending`` or ``failed`` (due for a retry). Every kind gets a value,
    zero included, so a drained queue reads 0 rather than a stale number. Returns the
    pending counts by kind. Runs on a short beat interval in the worker.
    """
    from store import signals as signal_store
    from store.db import session_scope
    from store.types import now
    from worker import metrics
    from worker.payloads import KINDS

    with session_scope(settings) as session:
        waiting = signal_store.pending_counts(session)
        by_status = signal_store.count_by_status(session)
        oldest = signal_store.oldest_pending(session)
    pending = {kind: int(waiting.get(kind, 0)) for kind in KINDS}
    for kind, count in pending.items():
        metrics.SIGNALS_PENDING.labels(kind).set(count)
        metrics.SIGNALS_DEAD.labels(kind).set(int(by_status.get((kind, "dead"), 0)))
    age = 0.0 if oldest is None else max((now() - oldest).total_seconds(), 0.0)
    metrics.SIGNALS_OLDEST_PENDING_AGE.set(age)
    metrics.SIGNALS_GAUGES_READ_AT.set_to_current_time()
    return pending
