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

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from tests.processes import Db, Service, session_end_payload, wait_until
from worker.settings import Settings

pytestmark = pytest.mark.acceptance

REDIS_DB_URL = os.environ.get("REVERIE_TEST_ACCEPTANCE_REDIS_URL", "redis://127.0.0.1:6379/12")
USERS = [f"acc-user-{i:02d}" for i in range(20)]
SLEEPER = "acc-sleeper"


def insert_signals(db: Db, start: int, count: int) -> list[int]:
    """``count`` session ends by plain SQL, each with one fact to extract."""
    return [
        db.insert_signal("session_end", USERS[n % len(USERS)], session_end_payload(n))
        for n in range(start, start + count)
    ]


@pytest.fixture()
def service(pg_settings: Settings, tmp_path: Path) -> Iterator[Service]:
    client = redis_lib.Redis.from_url(REDIS_DB_URL)
    client.flushdb()
    running = Service(tmp_path, pg_settings.database_url, REDIS_DB_URL)
    yield running
    running.stop_all()
    client.flushdb()
    client.close()


@pytest.fixture()
def db(pg_settings: Settings) -> Iterator[Db]:
    handle = Db(pg_settings.database_url)
    yield handle
    handle.close()


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
    first = insert_signals(db, 0, 20)
    service.beat()
    worker1 = service.worker()

    wait_until("the first signals are done", lambda: db.statuses(first) == {"done": 20}, 120, service)
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
    second = insert_signals(db, 20, 300)
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
    # Generous: the point is that all are done once, not how fast a loaded machine goes.
    wait_until("every signal of the killed worker is done", lambda: db.statuses(second) == {"done": 300}, 180, service)
    _assert_applied_once(db, first + second)

    # -- 3. SIGTERM: a warm shutdown finishes what it started --------------------------
    worker2 = service.procs[-1]
    third = insert_signals(db, 320, 150)
    wait_until(
        "the worker is busy with the third batch",
        lambda: db.statuses(third).get("done", 0) >= 5,
        30,
        service,
    )
    os.kill(worker2.pid, signal.SIGTERM)
    # Generous: a loaded machine's warm shutdown finishes its tasks in flight first (one
    # took over 30 s on a busy CI host); the point is the exit status and nothing half-done.
    assert worker2.wait(timeout=120) == 0
    # Nothing is left half-done: a task that started has finished.
    assert db.statuses(third).get("processing", 0) == 0

    service.worker()
    wait_until("every signal is done after the restart", lambda: db.statuses(third) == {"done": 150}, 180, service)
    _assert_applied_once(db, first + second + third)


def test_beat_adopts_the_users_already_there_when_it_starts(service: Service, db: Db) -> None:
    """A deployment pointed at a database that already holds users: they are scheduled
    within the first seconds of beat, not an hour later, spread over the interval. And
    an idle deployment is quiet at INFO: the housekeeping ticks every second leave no
    line unless they did something."""
    for n in range(30):
        db.run("INSERT INTO usermemories (user_id, key, value) VALUES (%s, 'k', '\"v\"')", f"existing-{n:02d}")
    service.worker()
    wait_until("the worker is ready", service.worker_ready, 90, service)
    service.beat()
    wait_until(
        "beat's start adopts the existing users",
        lambda: db.value("SELECT count(*) FROM dream_user_state WHERE user_id LIKE 'existing-%%'") == 30,
        60,
        service,
    )
    spread = db.value(
        "SELECT count(DISTINCT date_trunc('hour', next_dream_at)) FROM dream_user_state "
        "WHERE user_id LIKE 'existing-%%'"
    )
    assert spread > 5
    # Users due now prove the ticks run: their runs are dispatched and succeed.
    db.run("UPDATE dream_user_state SET next_dream_at = timezone('utc', now()) - interval '1 minute'")
    wait_until(
        "the due users are dispatched and dreamed",
        lambda: db.value("SELECT count(*) FROM dream_runs WHERE status = 'succeeded'") >= 30,
        90,
        service,
    )
    # The last runs close and log after the count is reached: wait until nothing runs
    # and the logs have stopped growing before the quiet time starts.
    _wait_until_no_run_is_running(db, service)
    wait_until("the logs settle", lambda: _logs_still_for(service, 2.0), 60, service)
    idle_from = {log.name: len(log.read_text().splitlines()) for log in service.tmp.glob("*.log")}
    time.sleep(6)  # six dispatch and sweep ticks (1 s each), nothing to do
    logs = {log.name: log.read_text() for log in service.tmp.glob("*.log")}
    everything = "\n".join(logs.values())
    assert "dispatch.tick" in everything  # the tick that did something said so
    for quiet in ("Task schedules.dispatch[", "Sending due task dispatch-due-users", "Task schedules.sweep["):
        assert quiet not in everything, quiet
    grown = {name: text.splitlines()[idle_from[name] :] for name, text in logs.items()}
    assert all(len(lines) <= 3 for lines in grown.values()), grown


def _wait_until_no_run_is_running(db: Db, service: Service) -> None:
    wait_until(
        "no run is left running",
        lambda: db.value("SELECT count(*) FROM dream_runs WHERE status = 'running'") == 0,
        60,
        service,
    )


def _logs_still_for(service: Service, seconds: float) -> bool:
    """True when no log of the service grew for `seconds`."""
    before = {log.name: log.stat().st_size for log in service.tmp.glob("*.log")}
    time.sleep(seconds)
    return before == {log.name: log.stat().st_size for log in service.tmp.glob("*.log")}


def test_at_debug_no_log_line_names_a_user_or_quotes_a_value(pg_settings: Settings, tmp_path: Path) -> None:
    """``REVERIE_LOG_LEVEL=DEBUG`` is a documented level: Celery's own debug lines (the
    pool's "TaskPool: Apply", which prints a task's whole request and body) must not
    carry the user ids a dispatch sends, nor a signal's values."""
    client = redis_lib.Redis.from_url(REDIS_DB_URL)
    client.flushdb()
    user = "plainuser7731"  # no e-mail shape, nothing random-looking: only its value identifies it
    value = "marzipan-cathedral"
    service = Service(tmp_path, pg_settings.database_url, REDIS_DB_URL, REVERIE_LOG_LEVEL="DEBUG")
    db = Db(pg_settings.database_url)
    try:
        db.run("INSERT INTO usermemories (user_id, key, value) VALUES (%s, 'k', '\"v\"')", user)
        payload = {
            "conversation_id": "c-debug",
            "messages": [{"role": "user", "content": f"My favorite dessert is {value}."}],
        }
        signal_id = db.insert_signal("session_end", user, payload)
        service.worker(loglevel="DEBUG")
        wait_until("the worker is ready", service.worker_ready, 90, service)
        service.beat(loglevel="DEBUG")
        wait_until("the signal is processed", lambda: db.statuses([signal_id]) == {"done": 1}, 90, service)
        db.run("UPDATE dream_user_state SET next_dream_at = timezone('utc', now()) - interval '1 minute'")
        wait_until(
            "the user is dispatched and dreamed",
            lambda: db.value("SELECT count(*) FROM dream_runs WHERE user_id = %s AND status = 'succeeded'", user) >= 1,
            90,
            service,
        )
        _wait_until_no_run_is_running(db, service)
        time.sleep(2)  # the run's last lines (at DEBUG the ticks go on logging: no quiet to wait for)
        logs = {log.name: log.read_text(errors="replace") for log in tmp_path.glob("*.log")}
        everything = "\n".join(logs.values())
        # The run was logged at DEBUG (so the lines looked at are the debug ones).
        assert "TaskPool: Apply" in everything or '"level": "debug"' in everything, service.logs()
        leaks = [line for line in everything.splitlines() if user in line or value in line]
        assert not leaks, leaks[:3]
    finally:
        service.stop_all()
        db.close()
        client.flushdb()
        client.close()
