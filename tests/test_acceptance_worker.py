"""The service end to end: a real ``celery worker`` and a real beat (``reverie beat``)
against the real Redis and PostgreSQL. The test only writes rows by plain SQL, as a
producer in another language would, and reads the outcome; it never calls the app.

1. Signals inserted without any wake-up are found by beat's sweeper and processed; a
   user whose dream time has passed is claimed by beat's dispatcher and dreamed.
2. The worker is SIGKILLed while it processes; a new worker finishes every signal,
   each with its effect applied exactly once.
3. A SIGTERM shutdown finishes what it started and loses nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis as redis_lib

from worker.settings import Settings

pytestmark = pytest.mark.acceptance

REDIS_DB_URL = os.environ.get("REVERIE_TEST_ACCEPTANCE_REDIS_URL", "redis://127.0.0.1:6379/12")
USERS = [f"acc-user-{i:02d}" for i in range(20)]
SLEEPER = "acc-sleeper"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """Worker and beat subprocesses, each in its own process group, logs in files."""

    def __init__(self, tmp: Path, database_url: str) -> None:
        self.tmp = tmp
        self.env = {
            **os.environ,
            "REVERIE_DATABASE_URL": database_url,
            "REVERIE_BROKER_URL": REDIS_DB_URL,
            "REVERIE_DISPATCH_INTERVAL_SECONDS": "1",
            "REVERIE_SWEEP_INTERVAL_SECONDS": "1",
            "REVERIE_SWEEP_GRACE_SECONDS": "1",
            "REVERIE_SIGNAL_LEASE_SECONDS": "5",
            "REVERIE_LOG_FORMAT": "json",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.count = 0

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # The child keeps its own copy of the descriptor; ours is closed at once.
        with (self.tmp / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv, cwd=self.tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def worker(self) -> subprocess.Popen[bytes]:
        self.count += 1
        name = f"worker{self.count}"
        env = {
            **self.env,
            "REVERIE_METRICS_PORT": str(_free_port()),
            "PROMETHEUS_MULTIPROC_DIR": str(self.tmp / f"metrics-{name}"),
        }
        argv = [sys.executable, "-m", "celery", "-A", "worker.app", "worker"]
        argv += ["-Q", "signals,dreams,housekeeping", "-c", "2", "-n", f"{name}@%h", "--loglevel", "INFO"]
        argv += ["--without-gossip", "--without-mingle"]
        return self._start(name, argv, env)

    def beat(self) -> subprocess.Popen[bytes]:
        reverie = str(Path(sys.executable).parent / "reverie")
        argv = [reverie, "beat", "--schedule", str(self.tmp / "beat-state"), "--loglevel", "INFO"]
        return self._start("beat", argv, {**self.env, "REVERIE_METRICS_PORT": str(_free_port())})

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log"))


class Db:
    """Plain SQL on the test database (psycopg, autocommit): no Reverie code."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url.replace("+psycopg", ""), autocommit=True)

    def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def run(self, query: str, *params: Any) -> None:
        self.conn.execute(query, params)  # type: ignore[arg-type]

    def value(self, query: str, *params: Any) -> Any:
        return self.rows(query, *params)[0][0]

    def insert_signals(self, start: int, count: int) -> list[int]:
        ids = []
        for n in range(start, start + count):
            user = USERS[n % len(USERS)]
            payload = {
                "conversation_id": f"conv-{n}",
                "messages": [
                    {"role": "user", "content": f"Hello. My item {n} colour is shade{n}."},
                    {"role": "assistant", "content": "Noted."},
                ],
            }
            row = self.rows(
                "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('session_end', %s, %s) RETURNING id",
                user,
                json.dumps(payload),
            )
            ids.append(row[0][0])
        return ids

    def statuses(self, ids: list[int]) -> dict[str, int]:
        rows = self.rows("SELECT status, count(*) FROM dream_signals WHERE id = ANY(%s) GROUP BY status", ids)
        return {status: count for status, count in rows}


def wait_until(what: str, check: Callable[[], bool], timeout: float, service: Service) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting until {what}\n{service.logs()}")


@pytest.fixture()
def service(pg_settings: Settings, tmp_path: Path) -> Iterator[Service]:
    client = redis_lib.Redis.from_url(REDIS_DB_URL)
    client.flushdb()
    running = Service(tmp_path, pg_settings.database_url)
    yield running
    running.stop_all()
    client.flushdb()
    client.close()


@pytest.fixture()
def db(pg_settings: Settings) -> Iterator[Db]:
    handle = Db(pg_settings.database_url)
    yield handle
    handle.conn.close()


def _assert_applied_once(db: Db, ids: list[int]) -> None:
    assert db.statuses(ids) == {"done": len(ids)}
    # One memory write per signal, recorded once, and one row per fact in the table.
    per_signal = dict(
        db.rows("SELECT signal_id, count(*) FROM dream_events WHERE signal_id = ANY(%s) GROUP BY signal_id", ids)
    )
    assert per_signal == {signal_id: 1 for signal_id in ids}
    duplicates = db.value(
        "SELECT count(*) FROM (SELECT user_id, key FROM usermemories GROUP BY user_id, key HAVING count(*) > 1) d"
    )
    assert duplicates == 0


def test_worker_and_beat_process_signals_and_dreams_and_survive_sigkill_and_sigterm(service: Service, db: Db) -> None:
    # -- 1. signals by plain SQL (no wake-up) and a user whose dream is due --------------
    db.run(
        "INSERT INTO usermemories (user_id, key, value, category, created_at, updated_at) VALUES "
        "(%s, 'old_hobby', '\"kites\"', 'fact', now() - interval '200 days', now() - interval '200 days')",
        SLEEPER,
    )
    db.run(
        "INSERT INTO dream_user_state (user_id, next_dream_at) "
        "VALUES (%s, timezone('utc', now()) - interval '1 minute')",
        SLEEPER,
    )
    first = db.insert_signals(0, 20)
    service.beat()
    worker1 = service.worker()

    wait_until("the first signals are done", lambda: db.statuses(first) == {"done": 20}, 45, service)
    wait_until(
        "the due user has dreamed",
        lambda: bool(db.rows("SELECT 1 FROM dream_runs WHERE user_id = %s AND status = 'succeeded'", SLEEPER)),
        20,
        service,
    )
    trigger, pruned = db.rows("SELECT trigger, entries_pruned FROM dream_runs WHERE user_id = %s", SLEEPER)[0]
    assert (trigger, pruned) == ("schedule", 1)
    assert db.value("SELECT count(*) FROM usermemories WHERE user_id = %s", SLEEPER) == 0
    assert db.value("SELECT count(*) FROM dream_archive WHERE user_id = %s", SLEEPER) == 1
    next_at = db.value(
        "SELECT next_dream_at - timezone('utc', now()) FROM dream_user_state WHERE user_id = %s", SLEEPER
    )
    assert next_at.total_seconds() > 3600
    _assert_applied_once(db, first)

    # -- 2. SIGKILL the worker while it processes ---------------------------------------
    second = db.insert_signals(20, 300)
    wait_until(
        "the worker is processing the second batch",
        lambda: db.statuses(second).get("processing", 0) > 0 and db.statuses(second).get("done", 0) >= 5,
        30,
        service,
    )
    os.killpg(worker1.pid, signal.SIGKILL)
    worker1.wait(timeout=10)
    left = db.statuses(second)
    assert left.get("done", 0) < len(second), "the kill came after all the work was done"

    service.worker()
    wait_until("every signal of the killed worker is done", lambda: db.statuses(second) == {"done": 300}, 45, service)
    _assert_applied_once(db, first + second)

    # -- 3. SIGTERM: a warm shutdown finishes what it started --------------------------
    worker2 = service.procs[-1]
    third = db.insert_signals(320, 150)
    wait_until(
        "the worker is busy with the third batch",
        lambda: db.statuses(third).get("done", 0) >= 5,
        30,
        service,
    )
    os.kill(worker2.pid, signal.SIGTERM)
    assert worker2.wait(timeout=30) == 0
    # Nothing is left half-done: a task that started has finished.
    assert db.statuses(third).get("processing", 0) == 0

    service.worker()
    wait_until("every signal is done after the restart", lambda: db.statuses(third) == {"done": 150}, 45, service)
    _assert_applied_once(db, first + second + third)
