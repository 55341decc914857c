"""Signals written by plain SQL reach ``done`` in seconds, with real ``celery worker``
processes on the real Redis and PostgreSQL and no beat, so no sweeper: only
PostgreSQL's notices (and the listener's catch-up) can wake the workers.

1. one INSERT, and one INSERT of 500 rows, are done without a wake-up from the producer;
2. with two workers, each signal takes effect once, and killing the worker whose
   listener is active hands listening over to the other;
3. the listener's database connection terminated: it reconnects, and a signal inserted
   meanwhile is done.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from store.notices import APPLICATION_NAME
from tests.processes import Db, Service, session_end_payload, wait_until
from worker.settings import Settings

pytestmark = pytest.mark.acceptance

REDIS_DB_URL = os.environ.get("REVERIE_TEST_ACCEPTANCE_REDIS_URL", "redis://127.0.0.1:6379/12")
ACTIVE = "signal listener active"
STANDBY = "signal listener standby"
DISCONNECTED = "signal listener disconnected"


@pytest.fixture()
def service(pg_settings: Settings, tmp_path: Path) -> Iterator[Service]:
    client = redis_lib.Redis.from_url(REDIS_DB_URL)
    client.flushdb()
    # No beat: the sweeper never runs, and its grace is beyond any wait here anyway.
    running = Service(
        tmp_path,
        pg_settings.database_url,
        REDIS_DB_URL,
        REVERIE_SWEEP_GRACE_SECONDS="86400",
        REVERIE_SIGNAL_LISTENER_RETRY_SECONDS="1",
    )
    yield running
    running.stop_all()
    client.flushdb()
    client.close()


@pytest.fixture()
def db(pg_settings: Settings) -> Iterator[Db]:
    handle = Db(pg_settings.database_url)
    yield handle
    handle.close()


def _events(service: Service, worker: int) -> list[str]:
    """The listener's state changes in a worker's log, in order."""
    log = service.tmp / f"worker{worker}.log"
    found = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        try:
            event = json.loads(line).get("event", "")
        except (ValueError, AttributeError):
            continue
        if isinstance(event, str) and event.startswith("signal listener"):
            found.append(event)
    return found


def _insert_bulk(db: Db, start: int, count: int) -> list[int]:
    rows = db.rows(
        "INSERT INTO dream_signals (kind, user_id, payload) "
        "SELECT 'session_end', 'bulk-user-' || (g %% 20), p::jsonb FROM unnest(%s::text[]) WITH ORDINALITY AS t(p, g) "
        "RETURNING id",
        [json.dumps(session_end_payload(n)) for n in range(start, start + count)],
    )
    return [row[0] for row in rows]


def _assert_applied_once(db: Db, ids: list[int]) -> None:
    assert db.statuses(ids) == {"done": len(ids)}
    per_signal = dict(
        db.rows("SELECT signal_id, count(*) FROM dream_events WHERE signal_id = ANY(%s) GROUP BY signal_id", ids)
    )
    assert per_signal == {signal_id: 1 for signal_id in ids}
    duplicates = db.value(
        "SELECT count(*) FROM (SELECT user_id, key FROM usermemories GROUP BY user_id, key HAVING count(*) > 1) d"
    )
    assert duplicates == 0


def test_a_plain_insert_and_a_bulk_insert_are_done_without_the_sweeper(service: Service, db: Db) -> None:
    service.worker()
    wait_until("the worker's listener is active", lambda: ACTIVE in _events(service, 1), 60, service)

    one = db.insert_signal("session_end", "sql-user", session_end_payload(0))
    wait_until("the plain INSERT is done", lambda: db.statuses([one]) == {"done": 1}, 30, service)

    bulk = _insert_bulk(db, 1, 500)
    assert len(bulk) == 500
    wait_until("every row of the bulk INSERT is done", lambda: db.statuses(bulk) == {"done": 500}, 120, service)
    _assert_applied_once(db, [one, *bulk])


def test_two_workers_apply_each_signal_once_and_listening_moves_when_the_active_one_dies(
    service: Service, db: Db
) -> None:
    first = service.worker()
    wait_until("the first worker's listener is active", lambda: ACTIVE in _events(service, 1), 60, service)
    service.worker()
    wait_until("the second worker's listener stands by", lambda: STANDBY in _events(service, 2), 60, service)

    ids = [db.insert_signal("session_end", f"pair-user-{n % 10}", session_end_payload(n)) for n in range(100)]
    wait_until("every signal is done", lambda: db.statuses(ids) == {"done": 100}, 120, service)
    _assert_applied_once(db, ids)
    assert ACTIVE not in _events(service, 2)

    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    wait_until("the second worker's listener took over", lambda: ACTIVE in _events(service, 2), 60, service)

    later = db.insert_signal("session_end", "after-kill", session_end_payload(100))
    wait_until("a signal inserted after the handover is done", lambda: db.statuses([later]) == {"done": 1}, 30, service)
    _assert_applied_once(db, [*ids, later])


def test_a_terminated_listener_connection_reconnects_and_a_signal_inserted_meanwhile_is_done(
    service: Service, db: Db
) -> None:
    service.worker()
    wait_until("the worker's listener is active", lambda: ACTIVE in _events(service, 1), 60, service)

    db.run(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s "
        "AND datname = current_database()",
        APPLICATION_NAME,
    )
    missed = db.insert_signal("session_end", "while-down", session_end_payload(0))

    wait_until("the listener saw its connection go", lambda: DISCONNECTED in _events(service, 1), 30, service)
    wait_until(
        "the listener is active again",
        lambda: _events(service, 1).count(ACTIVE) >= 2,
        60,
        service,
    )
    wait_until("the signal inserted meanwhile is done", lambda: db.statuses([missed]) == {"done": 1}, 30, service)
    _assert_applied_once(db, [missed])
    assert service.procs[0].poll() is None
