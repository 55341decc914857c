"""The signal listener in-process, on the real PostgreSQL and Redis: notices become
wake-ups in the signals queue, one listener is active at a time and another takes
over when it goes, and a lost connection is followed by a catch-up of what was missed."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis as redis_lib

from store.notices import APPLICATION_NAME
from worker import wakeup
from worker.settings import Settings
from worker.signal_listener import SignalListener, wanted


@pytest.fixture()
def settings(make_settings: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setattr(wakeup, "_quiet_until", 0.0)
    built: Settings = make_settings(broker_url=redis_url, signal_listener_retry_seconds=0.2)
    return built


@pytest.fixture()
def queue(redis_url: str) -> Iterator[Callable[[], list[int]]]:
    client = redis_lib.Redis.from_url(redis_url)

    def woken() -> list[int]:
        """The signal ids of the wake-ups waiting in the signals queue."""
        ids = []
        for raw in client.lrange("signals", 0, -1):
            envelope = json.loads(raw)
            assert envelope["headers"]["task"] == "signals.process"
            ids.extend(json.loads(base64.b64decode(envelope["body"]))[0])
        return sorted(ids)

    yield woken
    client.close()


@pytest.fixture()
def sql(settings: Settings) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(settings.database_url.replace("+psycopg", ""), autocommit=True)
    yield conn
    conn.close()


@pytest.fixture()
def listeners() -> Iterator[list[SignalListener]]:
    started: list[SignalListener] = []
    yield started
    for listener in started:
        listener.stop()


def _start(settings: Settings, listeners: list[SignalListener]) -> SignalListener:
    listener = SignalListener(settings)
    listener.start()
    listeners.append(listener)
    return listener


def _insert(sql: psycopg.Connection[Any], user: str, count: int = 1) -> list[int]:
    rows = sql.execute(
        "INSERT INTO dream_signals (kind, user_id, payload) "
        "SELECT 'activity', %s || g, '{}'::jsonb FROM generate_series(1, %s) g RETURNING id",
        (user, count),
    ).fetchall()
    return sorted(row[0] for row in rows)


def _wait(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting until {what}")


def _listener_backends(sql: psycopg.Connection[Any]) -> list[int]:
    rows = sql.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
        (APPLICATION_NAME,),
    ).fetchall()
    return [row[0] for row in rows]


def test_rows_ready_before_it_started_are_woken_then_each_new_insert(
    settings: Settings, queue: Callable[[], list[int]], sql: psycopg.Connection[Any], listeners: list[SignalListener]
) -> None:
    before = _insert(sql, "early-", 3)
    listener = _start(settings, listeners)
    _wait("the catch-up woke the earlier rows", lambda: queue() == before)
    assert listener.state == "active"

    bulk = _insert(sql, "bulk-", 500)
    _wait("the bulk insert is woken", lambda: queue() == before + bulk)
    single = _insert(sql, "one-")
    _wait("the single insert is woken", lambda: queue() == before + bulk + single)


def test_one_listener_is_active_and_another_takes_over_when_it_stops(
    settings: Settings, queue: Callable[[], list[int]], sql: psycopg.Connection[Any], listeners: list[SignalListener]
) -> None:
    first = _start(settings, listeners)
    _wait("the first listener is active", lambda: first.state == "active")
    second = _start(settings, listeners)
    _wait("the second listener stands by", lambda: second.state == "standby")

    one = _insert(sql, "a-")
    _wait("the insert is woken", lambda: queue() == one)
    time.sleep(0.5)
    # Only the active listener listens: one wake-up, not two.
    assert queue() == one

    first.stop()
    _wait("the second listener took over", lambda: second.state == "active")
    two = _insert(sql, "b-")
    _wait("the later insert is woken", lambda: set(two) <= set(queue()))


def test_a_terminated_connection_reconnects_and_wakes_what_was_inserted_meanwhile(
    settings: Settings, queue: Callable[[], list[int]], sql: psycopg.Connection[Any], listeners: list[SignalListener]
) -> None:
    listener = _start(settings, listeners)
    _wait("the listener is active", lambda: listener.state == "active")
    [old_pid] = _listener_backends(sql)

    # The insert commits while no listener listens, so its notice is lost.
    sql.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
    _wait("the listener noticed", lambda: listener.state == "disconnected" or old_pid not in _listener_backends(sql))
    missed = _insert(sql, "missed-")

    _wait("the missed insert is woken", lambda: set(missed) <= set(queue()))
    _wait("the listener is active again", lambda: listener.state == "active")
    assert old_pid not in _listener_backends(sql)


def test_a_broker_that_is_away_is_waited_for_and_nothing_is_lost(
    make_settings: Any, redis_url: str, queue: Callable[[], list[int]], listeners: list[SignalListener]
) -> None:
    from tests.test_wakeup import _closed_port

    away: Settings = make_settings(broker_url=f"redis://127.0.0.1:{_closed_port()}/0")
    listener = _start(away.model_copy(update={"signal_listener_retry_seconds": 0.2}), listeners)
    _wait("the listener is active", lambda: listener.state == "active")
    conn = psycopg.connect(away.database_url.replace("+psycopg", ""), autocommit=True)
    try:
        ids = _insert(conn, "while-away-", 2)
        time.sleep(1.0)
        assert listener.state == "active"
        assert listener._thread is not None and listener._thread.is_alive()
        # The broker comes back (here: the listener is pointed at a live one).
        listener.settings = away.model_copy(update={"broker_url": redis_url})
        _wait("the rows inserted while the broker was away are woken", lambda: queue() == ids)
    finally:
        conn.close()


def test_only_a_worker_on_postgresql_with_a_broker_listens(make_settings: Any, sqlite_settings: Settings) -> None:
    assert wanted(make_settings(broker_url="redis://127.0.0.1:6379/0"))
    assert not wanted(make_settings(broker_url=""))
    assert not wanted(make_settings(broker_url="redis://127.0.0.1:6379/0", signal_listener=False))
    assert not wanted(sqlite_settings.model_copy(update={"broker_url": "redis://127.0.0.1:6379/0"}))


def test_a_pool_child_forked_while_the_listener_publishes_can_publish_too() -> None:
    # The listener publishes from a thread of the worker's main process; a child forked
    # at that moment must not inherit the publish lock as held.
    with wakeup._publish_lock:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if wakeup._publish_lock.acquire(timeout=2) else 1)
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0


def test_a_worker_started_before_migrate_says_so_once_and_listens_once_migrated(
    redis_url: str, queue: Callable[[], list[int]], listeners: list[SignalListener], monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    from structlog.testing import capture_logs

    from store.db import dispose_engines
    from store.migrate import upgrade
    from tests.conftest import PG_ADMIN_URL, _base_settings, pg_url_for
    from worker import signal_listener

    monkeypatch.setattr(wakeup, "_quiet_until", 0.0)
    tries: list[float] = []

    class Counted(signal_listener.ListenConnection):
        def __init__(self, settings: Settings) -> None:
            tries.append(time.monotonic())
            super().__init__(settings)

    monkeypatch.setattr(signal_listener, "ListenConnection", Counted)
    name = f"reverie_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        settings = _base_settings(
            database_url=pg_url_for(name), broker_url=redis_url, signal_listener_retry_seconds=0.2
        )
        with capture_logs() as logs:
            listener = _start(settings, listeners)
            _wait("the listener finds no tables", lambda: listener.state == "waiting for migrate")
            time.sleep(4.0)
            # Backed off (0.5 s, 1 s, 2 s, ...), not tried again twice a second.
            assert len(tries) <= 5, len(tries)
            upgrade(settings)
            _wait("the listener is active on the migrated database", lambda: listener.state == "active", 30)
            with psycopg.connect(settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
                ids = _insert(conn, "after-migrate-", 2)
            _wait("the rows inserted once migrated are woken", lambda: queue() == ids)
        failed = [e for e in logs if e["event"] == "signal listener failed"]
        waiting = [e for e in logs if "reverie migrate" in e["event"]]
        assert failed == [] and len(waiting) == 1, logs
        assert waiting[0]["log_level"] == "warning"
    finally:
        for listener in listeners:
            listener.stop()
        listeners.clear()
        dispose_engines()
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
