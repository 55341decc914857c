"""Wake-ups: the producer's message after commit, on the real Redis, and an enqueue
that succeeds (and stays fast) when the broker is down."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import select

from store.db import session_scope
from store.models import Signal
from worker import wakeup
from worker.logs import user_ref
from worker.producer import enqueue_signal
from worker.settings import Settings, get_settings

PAYLOAD = {"events": [{"action": "digest", "at": "2025-01-06T09:00:00"}]}


@pytest.fixture(autouse=True)
def _no_quiet_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeup, "_quiet_until", 0.0)


@pytest.fixture()
def broker_settings(make_settings: Any, redis_url: str) -> Settings:
    settings: Settings = make_settings(broker_url=redis_url)
    return settings


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url)
    yield client
    client.close()


def _messages(client: redis_lib.Redis, queue: str) -> list[tuple[str, list[Any]]]:
    """(task name, positional args) of each message waiting in ``queue``."""
    found = []
    for raw in client.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        body = json.loads(base64.b64decode(envelope["body"]))
        assert envelope["content-type"] == "application/json"
        found.append((envelope["headers"]["task"], body[0]))
    return found


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_enqueue_sends_one_json_wake_up_to_the_signals_queue(
    broker_settings: Settings, redis_client: redis_lib.Redis
) -> None:
    result = enqueue_signal("activity", "u1", PAYLOAD, settings=broker_settings)
    duplicate = enqueue_signal("activity", "u1", PAYLOAD, settings=broker_settings)

    assert duplicate.created is False
    assert _messages(redis_client, "signals") == [("signals.process", [result.signal_id])]


def test_with_a_caller_session_the_wake_up_waits_for_the_commit(
    broker_settings: Settings, redis_client: redis_lib.Redis
) -> None:
    with session_scope(broker_settings) as session:
        result = enqueue_signal("activity", "u2", PAYLOAD, session=session, settings=broker_settings)
        assert _messages(redis_client, "signals") == []
    assert _messages(redis_client, "signals") == [("signals.process", [result.signal_id])]


def test_a_rolled_back_enqueue_sends_nothing(broker_settings: Settings, redis_client: redis_lib.Redis) -> None:
    with pytest.raises(RuntimeError), session_scope(broker_settings) as session:
        enqueue_signal("activity", "u3", PAYLOAD, session=session, settings=broker_settings)
        raise RuntimeError("the caller's transaction fails")

    assert _messages(redis_client, "signals") == []


def test_enqueue_succeeds_quickly_when_the_broker_is_down(make_settings: Any) -> None:
    settings: Settings = make_settings(broker_url=f"redis://127.0.0.1:{_closed_port()}/0")

    started = time.monotonic()
    first = enqueue_signal("activity", "u4", PAYLOAD, settings=settings)
    second = enqueue_signal("activity", "u5", PAYLOAD, settings=settings)
    elapsed = time.monotonic() - started

    assert first.created and second.created
    assert elapsed < 2.0
    with session_scope(settings) as session:
        rows = session.scalars(select(Signal.status).where(Signal.user_id.in_(["u4", "u5"]))).all()
    # The rows are the truth: both wait for the sweeper.
    assert rows == ["pending", "pending"]


def test_an_empty_broker_url_means_cron_mode_and_sends_nothing(make_settings: Any) -> None:
    settings: Settings = make_settings(broker_url="")

    assert wakeup.wake_signal(settings, 1) is False
    assert wakeup.wake_signals(settings, [1, 2]) == 0


def test_sweeper_wake_ups_and_dispatched_runs_are_routed_to_their_queues(
    broker_settings: Settings, redis_client: redis_lib.Redis
) -> None:
    # Declare every queue with its binding, as a worker does on start-up.
    celery = wakeup._app_for(broker_settings)
    with celery.connection_for_write() as connection:
        for queue in celery.conf.task_queues:
            queue.bind(connection.default_channel).declare()

    assert wakeup.wake_signals(broker_settings, [7, 8]) == 2
    wakeup.send_user_runs(broker_settings, ["a", "b"])

    assert _messages(redis_client, "housekeeping") == []

    assert sorted(_messages(redis_client, "signals")) == [("signals.process", [7]), ("signals.process", [8])]
    assert _messages(redis_client, "dreams") == [("dream.run_users", [["a", "b"]])]


def test_celery_shows_the_arguments_of_a_task_naming_users_by_their_references(
    broker_settings: Settings, redis_client: redis_lib.Redis
) -> None:
    """Task events and Celery's log lines show a message's ``argsrepr``: for a task whose
    arguments name users, their log references, whoever sends it (the dispatcher, a
    retry, which gives Celery's own repr, or an application's ``dream.run_user``)."""
    celery = wakeup._app_for(broker_settings)
    with celery.connection_for_write() as connection:
        for queue in celery.conf.task_queues:
            queue.bind(connection.default_channel).declare()
    wakeup.send_user_runs(broker_settings, ["a", "b"])
    celery.send_task("dream.run_users", args=[["c"]], argsrepr="(['c'],)")  # as a retry sends it
    celery.send_task("dream.run_user", args=["d"])
    celery.send_task("dream.run_user", kwargs={"user_id": "e"})
    celery.send_task("signals.process", args=[7])
    key = get_settings().log_hash_key  # the process's, as its log lines use

    def shown(queue: str) -> list[tuple[str, str]]:
        headers = [json.loads(raw)["headers"] for raw in redis_client.lrange(queue, 0, -1)]
        return sorted((h["argsrepr"], h["kwargsrepr"]) for h in headers)

    ref = {u: user_ref(u, key) for u in "abcde"}
    assert shown("dreams") == sorted(
        [
            (repr([[ref["a"], ref["b"]]]), "{}"),
            (repr([[ref["c"]]]), "{}"),
            (repr([ref["d"]]), "{}"),
            ("[]", repr({"user_id": ref["e"]})),
        ]
    )
    assert shown("signals") == [("[7]", "{}")]  # another task's: as Celery shows it


def test_importing_the_producer_loads_neither_celery_nor_kombu_nor_litellm() -> None:
    code = (
        "import sys, worker.producer, worker.wakeup\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu', 'litellm'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)

    assert out.stdout.strip() == ""


def test_signals_put_back_by_retry_are_woken_at_once(broker_settings: Settings, redis_client: redis_lib.Redis) -> None:
    # Putting a signal back inserts no row, so PostgreSQL sends no notice: without a
    # wake-up of its own it waited for the sweeper (a minute).
    from sqlalchemy import update

    from store.models import Signal

    first = enqueue_signal("activity", "u1", PAYLOAD, idempotency_key="r1", settings=broker_settings).signal_id
    second = enqueue_signal("activity", "u1", PAYLOAD, idempotency_key="r2", settings=broker_settings).signal_id
    with session_scope(broker_settings) as session:
        session.execute(update(Signal).where(Signal.id.in_([first, second])).values(status="dead", attempts=5))
    redis_client.flushdb()
    from tests.test_cli import run

    env = {"REVERIE_DATABASE_URL": broker_settings.database_url, "REVERIE_BROKER_URL": broker_settings.broker_url}
    result = run(["signals", "retry", "--all-dead"], env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(args for _, args in _messages(redis_client, "signals")) == sorted([[first], [second]])
