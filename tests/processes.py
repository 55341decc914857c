"""Real processes for the acceptance and reliability tests: a ``celery worker`` and beat
in their own process groups, a throwaway ``redis-server``, and plain SQL on the test
database (psycopg, no Reverie code), so a test sees only what a user would."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis as redis_lib


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Turns a command into the one that runs it elsewhere (another host's namespace).
Wrap = Callable[[list[str]], list[str]]


def _same(argv: list[str]) -> list[str]:
    return argv


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``proc`` leads (a worker and its pool children)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


class Service:
    """Worker and beat subprocesses, each in its own process group, logs in files."""

    def __init__(self, tmp: Path, database_url: str, broker_url: str, **env: str) -> None:
        self.tmp = tmp
        self.env = {
            **os.environ,
            "REVERIE_DATABASE_URL": database_url,
            "REVERIE_BROKER_URL": broker_url,
            "REVERIE_DISPATCH_INTERVAL_SECONDS": "1",
            "REVERIE_SWEEP_INTERVAL_SECONDS": "1",
            "REVERIE_SWEEP_GRACE_SECONDS": "1",
            "REVERIE_SIGNAL_LEASE_SECONDS": "5",
            "REVERIE_LOG_FORMAT": "json",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            **env,
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.count = 0
        self.metrics_port = 0  # the latest worker's /metrics port

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # The child keeps its own copy of the descriptor; ours is closed at once.
        with (self.tmp / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv, cwd=self.tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def worker(
        self,
        concurrency: int = 2,
        *,
        wrap: Wrap = _same,
        queues: str = "signals,dreams,housekeeping",
        loglevel: str = "INFO",
    ) -> subprocess.Popen[bytes]:
        self.count += 1
        name = f"worker{self.count}"
        self.metrics_port = free_port()
        env = {
            **self.env,
            "REVERIE_METRICS_PORT": str(self.metrics_port),
            "PROMETHEUS_MULTIPROC_DIR": str(self.tmp / f"metrics-{name}"),
        }
        argv = [sys.executable, "-m", "celery", "-A", "worker.app", "worker"]
        argv += ["-Q", queues, "-c", str(concurrency), "-n", f"{name}@%h"]
        argv += ["--loglevel", loglevel, "--without-gossip", "--without-mingle"]
        return self._start(name, wrap(argv), env)

    def worker_ready(self, number: int | None = None) -> bool:
        """Whether the latest worker (or worker ``number``, from 1) has said it is ready
        (connected and consuming)."""
        log = self.tmp / f"worker{number or self.count}.log"
        return log.exists() and "ready." in log.read_text(errors="replace")

    def beat(self, *, wrap: Wrap = _same, loglevel: str = "INFO") -> subprocess.Popen[bytes]:
        reverie = str(Path(sys.executable).parent / "reverie")
        argv = [reverie, "beat", "--schedule", str(self.tmp / "beat-state"), "--loglevel", loglevel]
        return self._start("beat", wrap(argv), {**self.env, "REVERIE_METRICS_PORT": str(free_port())})

    def stop_warm(self, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> bool:
        """Stop a worker as an operator does: ``SIGTERM`` to its main process, a warm
        shutdown that lets the tasks it runs end and starts no new one. Whether it exited
        within ``timeout``."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log"))


class RedisServer:
    """A throwaway ``redis-server`` on a free loopback port (or on ``bind``, run through
    ``wrap``): no persistence, its own directory; it can be stopped and started again
    on the same port."""

    def __init__(self, tmp: Path, *, bind: str = "127.0.0.1", wrap: Wrap = _same) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = tmp / "redis"
        self.dir.mkdir(exist_ok=True)
        self.bind, self.wrap = bind, wrap
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def url(self, db: int = 0) -> str:
        return f"redis://{self.bind}:{self.port}/{db}"

    def start(self) -> None:
        argv = [self.binary, "--bind", self.bind, "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")]
        if self.bind != "127.0.0.1":
            # Clients on other hosts (the test's own bridge): protected mode would refuse them.
            argv += ["--protected-mode", "no"]
        self.proc = subprocess.Popen(self.wrap(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.starts += 1
        deadline = time.monotonic() + 10
        client = redis_lib.Redis(host=self.bind, port=self.port, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                try:
                    if client.ping():
                        return
                except redis_lib.exceptions.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        pytest.fail(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Stop the server at once, as a crash would: whatever it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class Db:
    """Plain SQL on the test database (psycopg, autocommit): no Reverie code."""

    def __init__(self, url: str) -> None:
        self.url = url.replace("+psycopg", "")
        self.conn = psycopg.connect(self.url, autocommit=True)

    def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def run(self, query: str, *params: Any) -> None:
        self.conn.execute(query, params)  # type: ignore[arg-type]

    def value(self, query: str, *params: Any) -> Any:
        return self.rows(query, *params)[0][0]

    def insert_signal(self, kind: str, user_id: str, payload: Any) -> int:
        """A signal as a producer in another language writes it: one ``INSERT``."""
        row = self.rows(
            "INSERT INTO dream_signals (kind, user_id, payload) VALUES (%s, %s, %s) RETURNING id",
            kind,
            user_id,
            json.dumps(payload),
        )
        return int(row[0][0])

    def statuses(self, ids: Sequence[int]) -> dict[str, int]:
        rows = self.rows("SELECT status, count(*) FROM dream_signals WHERE id = ANY(%s) GROUP BY status", list(ids))
        return {status: count for status, count in rows}

    def close(self) -> None:
        self.conn.close()


def session_end_payload(n: int) -> dict[str, Any]:
    """A transcript from which the offline model extracts exactly one fact,
    ``item_<n>_colour = shade<n>``."""
    return {
        "conversation_id": f"conv-{n}",
        "messages": [
            {"role": "user", "content": f"Hello. My item {n} colour is shade{n}."},
            {"role": "assistant", "content": "Noted."},
        ],
    }


def wait_until(what: str, check: Callable[[], bool], timeout: float, service: Service) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting until {what}\n{service.logs()}")
