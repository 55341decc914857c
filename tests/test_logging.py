"""Logs tell an operator what happened and leak nothing a user said."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from celery import signals

import worker.celery_hooks  # noqa: F401 - connects the handlers under test
from worker.logging_setup import configure_logging, redact_text
from worker.logs import get_logger, user_ref
from worker.producer import enqueue_signal
from worker.settings import Settings, get_settings
from worker.url_secrets import mask_secrets, mask_url

SECRET = "sk-proj-Zq8XvL2mN4pR7tY1wK9bC3dF6gH0jS5a"
EMAIL = "dana.whitfield+memo@example.org"
USER = "user-5521-dana"


@pytest.fixture()
def captured(pg_settings: Settings) -> Iterator[io.StringIO]:
    """Everything Reverie and its libraries log, as the worker would write it."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging(pg_settings.model_copy(update={"log_format": "json", "log_level": "DEBUG"}), stream=stream)
    yield stream
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    structlog.reset_defaults()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


class FakeTask:
    name = "signals.process"

    @staticmethod
    def run(signal_id: int) -> str:
        return "done"


def test_session_end_with_secret_and_email_leaks_neither(pg_settings: Settings, captured: io.StringIO) -> None:
    from tasks.signals import process_signal

    transcript = f"my api key is {SECRET}. my email is {EMAIL}. my favorite color is teal"
    payload = {"conversation_id": "conv-1", "messages": [{"role": "user", "content": transcript}]}
    signal_id = enqueue_signal("session_end", USER, payload, settings=pg_settings).signal_id

    # The task boundary, as Celery drives it: prerun binds context, postrun clears it.
    signals.task_prerun.send(sender=FakeTask, task_id="t-123", task=FakeTask, args=(signal_id,), kwargs={})
    outcome = process_signal(pg_settings, signal_id)
    # What the real processing wrote: not even the extracted memory value is in it.
    assert "teal" not in captured.getvalue()
    # Careless lines, from Reverie and from libraries: every one must come out clean.
    log = get_logger("tasks.signals")
    log.info("debug dump", user_id=USER, payload=payload, note=f"user said {transcript}")
    logging.getLogger("celery.app.trace").info("Task received: args=(%r,)", transcript)
    logging.getLogger("LiteLLM").info("POST Request Sent: %s", transcript)
    logging.getLogger("sqlalchemy.engine.Engine").info("[generated] (%r,)", transcript)
    try:
        raise ValueError(f"could not parse {transcript}")
    except ValueError:
        log.exception("parse failed")
    signals.task_postrun.send(sender=FakeTask, task_id="t-123", task=FakeTask, state="SUCCESS")
    log.info("after the task")

    output = captured.getvalue()
    assert outcome == "done"
    assert SECRET not in output
    assert SECRET[8:24] not in output
    assert EMAIL not in output
    assert "dana.whitfield" not in output
    assert USER not in output

    records = lines(captured)
    done = [r for r in records if r.get("signal_id") == signal_id and r["event"] == "signal_done"]
    assert done, records
    # The operator can tell which signal, whose (as a hash), in which task, and how it ended.
    assert done[0]["task_id"] == "t-123"
    assert done[0]["task_name"] == "signals.process"
    assert done[0]["kind"] == "session_end"
    assert user_ref(USER, pg_settings.log_hash_key) in {r.get("user") for r in records} | {
        r.get("user_id") for r in records
    }
    # The library line about the transcript is kept, with the content gone.
    assert any(r["logger"] == "celery.app.trace" for r in records)
    # litellm stays at WARNING: its request line (the prompt) is not written at all.
    assert not any(r["logger"] == "LiteLLM" for r in records)
    assert not any(r["logger"].startswith("sqlalchemy.engine") for r in records)
    # The positional signal id is bound for every line of the task, down to its end.
    finished = next(r for r in records if r["event"] == "task finished")
    assert (finished["signal_id"], finished["state"], finished["task_id"]) == (signal_id, "SUCCESS", "t-123")
    # Context is cleared when the task ends.
    after = next(r for r in records if r["event"] == "after the task")
    assert "task_id" not in after and "signal_id" not in after


class FakeRunTask:
    name = "dream.run_user"

    @staticmethod
    def run(user_id: str = "", run_id: int | None = None) -> str:
        return "ok"


def test_failed_task_is_logged_by_type_without_its_message(captured: io.StringIO) -> None:
    signals.task_prerun.send(sender=FakeRunTask, task_id="t-9", task=FakeRunTask, args=(), kwargs={"run_id": 77})
    signals.task_failure.send(sender=FakeRunTask, task_id="t-9", exception=KeyError(f"row {EMAIL}"))
    signals.task_postrun.send(sender=FakeRunTask, task_id="t-9", task=FakeRunTask, state="FAILURE")

    records = lines(captured)
    failed = next(r for r in records if r["event"] == "task failed")
    assert failed["error_type"] == "KeyError"
    assert failed["run_id"] == 77 and failed["task_id"] == "t-9"
    assert EMAIL not in captured.getvalue()


@pytest.mark.parametrize(
    ("text", "leak"),
    [
        ("Authorization: Bearer abc.def-123_ghi", "abc.def-123_ghi"),
        ("postgresql://reverie:hunter2pass@db:5432/reverie", "hunter2pass"),
        ("password=swordfish123 next", "swordfish123"),
        ('{"api_key": "k-998877"}', "k-998877"),
        ("token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NSJ9.c2lnbmF0dXJlLXZhbHVl", "eyJzdWIiOiIxMjM0NSJ9"),
        ("aws AKIAIOSFODNN7EXAMPLE here", "AKIAIOSFODNN7EXAMPLE"),
        ("random Xk29dLq0Pz7Wm3Rt8Ys1Vb6Nc4Ha", "Xk29dLq0Pz7Wm3Rt8Ys1Vb6Nc4Ha"),
        ("reach me at a.b@c.io", "a.b@c.io"),
        ("[SQL: INSERT ...] [parameters: ('my secret diary',)]", "my secret diary"),
        ("postgresql://u@db/app?sslmode=require&sslpassword=sslpw77", "sslpw77"),
        ("postgresql://u@db/app?password=querypw88", "querypw88"),
        ("redis://:brokerpw@redis:6379/0?token=tok99", "tok99"),
        ("https://h/x?api_key=key55&x=1", "key55"),
    ],
)
def test_redact_text_removes_secret_shapes(text: str, leak: str) -> None:
    assert leak not in redact_text(text)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:pw@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("postgresql://app@db/app?sslmode=require&password=pw", "postgresql://app@db/app?sslmode=require&password=***"),
        (
            "postgresql://db/app?sslpassword=a&secret=b&access_token=c&sslkey=d&application_name=w",
            "postgresql://db/app?sslpassword=***&secret=***&access_token=***&sslkey=***&application_name=w",
        ),
        ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
        ("sqlite:///reverie.db", "sqlite:///reverie.db"),
        # Drivers take a password with these characters unescaped: none of it shows.
        ("postgresql://op:pa/ss@127.0.0.1:5433/app", "postgresql://op:***@127.0.0.1:5433/app"),
        ("postgresql://op:top@sec/ret@db/app", "postgresql://op:***@db/app"),
        ("postgresql://op:pa?ss@db/app", "postgresql://op:***@db/app"),
        ("postgresql://op:pa#ss@db/app?application_name=w", "postgresql://op:***@db/app?application_name=w"),
        # No password: a port is not one, nor an @ in the query.
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("postgresql://db:5432/app?application_name=me@host", "postgresql://db:5432/app?application_name=me@host"),
        ("postgresql://op:@db/app", "postgresql://op:@db/app"),
    ],
)
def test_url_secrets_are_masked_and_the_rest_kept(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert mask_secrets(f"failed at {url}: refused") == f"failed at {shown}: refused"


def test_ids_and_hashes_stay_readable() -> None:
    task_id = "3f2b9c1e-7a4d-4e2b-9f1a-0c5d8e7b6a21"
    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    text = f"Task signals.process[{task_id}] received key={digest}"
    assert redact_text(text) == text


@pytest.fixture()
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from worker import logs
    from worker.settings import get_settings

    monkeypatch.delenv("REVERIE_LOG_HASH_KEY", raising=False)
    monkeypatch.setattr(logs, "_warned", set())
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _public_key_warnings(stream: io.StringIO) -> list[dict[str, Any]]:
    return [line for line in lines(stream) if line.get("event") == "log_hash_key_is_public"]


def _bare_worker_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's start-up without what these tests are not about: its own log
    handler, the model gateway and the metrics endpoint (which logs that it did not start)."""
    from worker import celery_hooks, metrics_server
    from worker.errors import ConfigError

    def no_server(settings: Settings) -> None:
        raise ConfigError("not in this test")

    monkeypatch.setattr(celery_hooks, "configure_logging", lambda settings: None)
    monkeypatch.setattr(celery_hooks, "_preload_gateway", lambda settings: None)
    monkeypatch.setattr(metrics_server, "serve", no_server)


def test_beat_and_worker_warn_once_about_the_public_hash_key(
    captured: io.StringIO, fresh_warnings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bare_worker_start(monkeypatch)
    for _ in range(2):
        signals.beat_init.send(sender=None)
        signals.worker_init.send(sender=None)
    warned = _public_key_warnings(captured)
    assert sorted(line["process"] for line in warned) == ["beat", "worker"]
    assert all(line["level"] == "warning" and "REVERIE_LOG_HASH_KEY" in line["hint"] for line in warned)


def test_a_worker_says_at_start_that_the_database_does_not_fit(
    captured: io.StringIO, fresh_warnings: None, monkeypatch: pytest.MonkeyPatch, pg_settings: Settings
) -> None:
    # What ``reverie run`` refuses (a last-access column the table lacks, a PostgreSQL
    # too old), a worker says in one line when it starts (it still starts: signals need
    # neither), not once per failed dream.
    import store.db

    _bare_worker_start(monkeypatch)
    monkeypatch.setenv("REVERIE_DATABASE_URL", pg_settings.database_url)
    served = store.db.MIN_POSTGRESQL
    for column, oldest, said in (
        ("no_such_col", served, "REVERIE_MEMORY_LAST_ACCESS_COLUMN=no_such_col"),
        (None, 990000, "PostgreSQL 99 or newer is needed"),
        (None, served, None),
    ):
        if column is None:
            monkeypatch.delenv("REVERIE_MEMORY_LAST_ACCESS_COLUMN", raising=False)
        else:
            monkeypatch.setenv("REVERIE_MEMORY_LAST_ACCESS_COLUMN", column)
        monkeypatch.setattr(store.db, "MIN_POSTGRESQL", oldest)
        get_settings.cache_clear()
        before = len(lines(captured))
        signals.worker_init.send(sender=None)
        found = [line for line in lines(captured)[before:] if line.get("event") == "configuration_error"]
        assert len(found) == (said is not None), (column, lines(captured)[before:])
        # The start itself went through (the settings loaded, nothing else failed).
        errors = {line.get("event") for line in lines(captured)[before:] if line.get("level") == "error"}
        assert errors <= {"configuration_error", "metrics endpoint not started"}, errors
        if said:
            assert found[0]["level"] == "error" and said in found[0]["error"]


def test_no_warning_with_a_key_of_ones_own(
    captured: io.StringIO, fresh_warnings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REVERIE_LOG_HASH_KEY", "a-secret-of-our-own")
    signals.beat_init.send(sender=None)
    assert _public_key_warnings(captured) == []


def test_run_errors_in_json_output_mask_url_secrets() -> None:
    from schedules.cron import PassReport
    from tasks.dream import RunOutcome

    report = PassReport()
    error = "database unreachable at postgresql://app:pw1@db/app?sslpassword=pw2: refused"
    report.add(RunOutcome(user_id="u", status="failed", run_id=7, error=error))
    [shown] = report.as_dict()["errors"]
    assert shown == "run 7: database unreachable at postgresql://app:***@db/app?sslpassword=***: refused"


def test_litellm_logs_through_reverie_handler_from_its_first_import() -> None:
    # In any process (``reverie run``, not only a worker's tasks): litellm's own handler,
    # which writes unredacted, is gone as soon as the gateway imports it.
    code = (
        "import logging\n"
        "from worker import llm\n"
        "llm._load()\n"
        "names = ('LiteLLM', 'LiteLLM Router', 'LiteLLM Proxy')\n"
        "print([(len(logging.getLogger(n).handlers), logging.getLogger(n).level >= logging.WARNING) for n in names])\n"
    )
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    assert out.stdout.strip() == str([(0, True)] * 3)


def test_at_debug_celerys_pool_line_with_a_tasks_whole_message_is_not_written(captured: io.StringIO) -> None:
    # The pool's "TaskPool: Apply" line prints a task's request and message body, whose
    # arguments name users; Celery's other debug lines are kept at DEBUG.
    logging.getLogger("celery.pool").debug("TaskPool: Apply (args:%r)", ([[USER]],))
    logging.getLogger("celery.worker.request").debug("Task accepted: %s[%s] pid:%r", "dream.run_users", "t-1", 7)
    records = lines(captured)
    assert USER not in captured.getvalue()
    assert [r["logger"] for r in records] == ["celery.worker.request"]


def test_celerys_error_about_a_message_it_cannot_run_does_not_quote_the_message(captured: io.StringIO) -> None:
    from celery.worker.consumer.consumer import UNKNOWN_TASK_ERROR

    body = repr(json.dumps([[USER], {}, {}]).encode())
    headers = repr({"task": "dream.run_userz", "argsrepr": repr([USER])})
    logging.getLogger("celery.worker.consumer").error(
        UNKNOWN_TASK_ERROR, "dream.run_userz", body, headers, {"routing_key": "dreams"}
    )
    logging.getLogger("celery.worker.consumer").error(
        "Can't decode message body: %r [type:%r encoding:%r headers:%s]\n\nbody: %s", body, "x", "y", headers, body
    )
    assert USER not in captured.getvalue()
    events = [r["event"] for r in lines(captured)]
    assert events[0].startswith("Received unregistered task of type dream.run_userz.")
    assert "The delivery info for this task is:" in events[0]
