"""The Celery app's configuration: a broker that holds nothing that cannot be found
again in PostgreSQL, task names and routes, time limits under the leases that bring
lost work back, the retry policy, beat's schedule, and the `reverie worker|beat`
command lines."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from celery.schedules import crontab

from store import db
from worker import jobs, metrics_server
from worker.app import HOUSEKEEPING_QUEUE, QUEUES, app, celery_config, create_app
from worker.cli import main, service_cmds
from worker.errors import DatabaseUnavailable, TransientError
from worker.settings import Settings

TASKS = {
    "signals.process": "signals",
    "dream.run_user": "dreams",
    "dream.run_users": "dreams",
    "schedules.dispatch": HOUSEKEEPING_QUEUE,
    "schedules.sweep": HOUSEKEEPING_QUEUE,
    "schedules.adopt": HOUSEKEEPING_QUEUE,
    "activity.routines": HOUSEKEEPING_QUEUE,
    "metrics.refresh_pending": HOUSEKEEPING_QUEUE,
    "retention.purge": HOUSEKEEPING_QUEUE,
}
PERIODIC_ONLY = {
    "schedules.dispatch",
    "schedules.sweep",
    "schedules.adopt",
    "metrics.refresh_pending",
    "retention.purge",
}


def _ours() -> dict[str, Any]:
    return {name: task for name, task in app.tasks.items() if not name.startswith("celery.")}


def test_a_message_is_acknowledged_on_receipt_and_redis_keeps_no_copy() -> None:
    conf = app.conf
    # The row is the truth: a lost wake-up is found again from PostgreSQL, so nothing is
    # left unacknowledged in Redis for a dropped connection to restore or acknowledge.
    assert conf.task_acks_late is False
    assert all(not task.acks_late for task in _ours().values())
    assert conf.broker_transport_options["ack_emulation"] is False
    assert "visibility_timeout" not in conf.broker_transport_options
    assert conf.worker_prefetch_multiplier == 1
    # A task running when Redis goes away finishes its database work.
    assert conf.worker_cancel_long_running_tasks_on_connection_loss is False
    assert conf.result_backend is None
    assert conf.task_ignore_result is True
    assert conf.task_serializer == "json"
    assert list(conf.accept_content) == ["json"]
    assert conf.worker_send_task_events is True
    assert conf.task_send_sent_event is True
    assert {queue.name for queue in conf.task_queues} == set(QUEUES)
    # Distinct bindings: a message routed to one queue is delivered to that queue only.
    assert {(queue.exchange.name, queue.routing_key) for queue in conf.task_queues} == {(q, q) for q in QUEUES}


def test_the_worker_reconnects_to_a_lost_broker_for_as_long_as_it_takes() -> None:
    conf = app.conf
    assert conf.broker_connection_retry is True
    assert conf.broker_connection_retry_on_startup is True
    # None is "forever"; Celery's default (100) stops consuming after about 45 minutes.
    assert conf.broker_connection_max_retries is None
    options = conf.broker_transport_options
    # A dead connection fails a command within the socket timeout instead of hanging it;
    # BRPOP waits 1 s at a time, well inside it.
    assert 1 < options["socket_timeout"] <= 60
    assert options["socket_keepalive"] is True
    assert options["health_check_interval"] > 0


def test_broker_comes_from_the_settings(redis_url: str) -> None:
    settings = Settings(_env_file=None, broker_url=redis_url)  # type: ignore[call-arg]
    assert create_app(settings).conf.broker_url == redis_url
    assert celery_config(settings)["worker_concurrency"] == settings.worker_concurrency


def test_every_task_has_a_stable_name_and_its_own_queue() -> None:
    assert set(_ours()) == set(TASKS)
    for name, queue in TASKS.items():
        route = app.amqp.router.route({}, name)
        assert route["queue"].name == queue, name


def test_no_run_outlives_the_lease_that_would_send_it_again() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    for name, task in _ours().items():
        assert task.time_limit is not None and task.soft_time_limit is not None, name
        assert task.soft_time_limit < task.time_limit, name
    # A dispatched chunk still running is never dispatched again: its hard limit ends
    # before the dispatch lease does.
    assert app.tasks["dream.run_users"].time_limit < settings.dispatch_lease_seconds
    # A signal's processing ends (or is stopped) before its lease lets another worker in.
    assert app.tasks["signals.process"].time_limit <= settings.signal_lease_seconds
    assert app.tasks["dream.run_users"].soft_time_limit > jobs.CHUNK_BUDGET_SECONDS


def test_only_typed_transient_errors_are_retried() -> None:
    for name, task in _ours().items():
        retried = tuple(getattr(task, "autoretry_for", ()) or ())
        if name in PERIODIC_ONLY:
            assert retried == (), name
        else:
            assert retried in ((), jobs.TRANSIENT), name
            assert Exception not in retried
    assert (TransientError, DatabaseUnavailable) == jobs.TRANSIENT


def test_beat_schedule_names_real_tasks_on_the_configured_intervals() -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, dispatch_interval_seconds=2, sweep_interval_seconds=7, purge_interval_seconds=900
    )
    schedule = celery_config(settings)["beat_schedule"]
    by_task = {entry["task"]: entry for entry in schedule.values()}

    assert set(by_task) <= set(TASKS)
    assert by_task["schedules.dispatch"]["schedule"] == 2
    assert by_task["schedules.sweep"]["schedule"] == 7
    assert by_task["retention.purge"]["schedule"] == 900
    routines = by_task["activity.routines"]["schedule"]
    assert isinstance(routines, crontab)
    assert routines.remaining_estimate(routines.now()) <= timedelta(days=1)
    for entry in schedule.values():
        # A tick that waited past the next one is dropped, not piled up.
        assert entry["options"]["expires"] > 0


def test_importing_the_app_connects_to_nothing() -> None:
    code = (
        "import store.db, worker.app, worker.jobs\n"
        "assert store.db._engines == {}, store.db._engines\n"
        "assert worker.app.app.pool is not None\n"
        "print(len(worker.app.app.tasks))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_forked_worker_process_starts_without_the_parents_engines(pg_settings: Settings) -> None:
    from celery.signals import worker_process_init

    db.get_engine(pg_settings)
    assert db._engines
    worker_process_init.send(sender=None)
    assert db._engines == {}


@pytest.fixture()
def exec_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_execv(path: str, argv: list[str]) -> None:
        calls.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(service_cmds.os, "execv", fake_execv)
    monkeypatch.setattr(metrics_server, "prepare_multiprocess_dir", lambda: None)
    return calls


def test_reverie_worker_runs_celery_worker_with_defaults_and_pass_through(exec_calls: list[list[str]]) -> None:
    with pytest.raises(SystemExit):
        main(["worker", "--concurrency", "3", "--pool", "solo"])

    argv = exec_calls[0]
    assert argv[:6] == [sys.executable, "-m", "celery", "-A", "worker.app", "worker"]
    assert argv[argv.index("--queues") + 1] == "signals,dreams,housekeeping"
    assert argv[argv.index("--concurrency") + 1] == "3"
    assert argv[-2:] == ["--pool", "solo"]


def test_reverie_beat_runs_celery_beat(exec_calls: list[list[str]]) -> None:
    with pytest.raises(SystemExit):
        main(["beat", "--schedule", "/tmp/beat-state"])

    argv = exec_calls[0]
    assert argv[:6] == [sys.executable, "-m", "celery", "-A", "worker.app", "beat"]
    assert argv[argv.index("--schedule") + 1] == "/tmp/beat-state"


def test_reverie_worker_rejects_an_unknown_queue(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--queues", "signals,nope"])

    assert exit_info.value.code == 2
    assert "unknown queue(s) nope" in capsys.readouterr().err
