"""Celery signal handlers: logging, log context and metrics for every worker process.

Imported by ``worker.app``; importing it connects the handlers. What a worker gets:

* logging configured by :func:`worker.logging_setup.configure_logging` instead of
  Celery's own (Celery's success line no longer prints task return values);
* task events on, so a standard Celery exporter works beside Reverie;
* in the parent, a ``/metrics`` endpoint on ``REVERIE_METRICS_PORT`` summing every
  prefork child (see :mod:`worker.metrics_server`);
* per task, ``task_id``, ``task_name`` and (when the task has them) ``run_id`` and
  ``signal_id`` bound to the structlog context, cleared when the task ends.

The periodic ``dream_signals_pending`` refresh is :func:`refresh_pending_gauge`.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog
from celery import signals
from celery.app import trace as celery_trace

from worker import metrics_server
from worker.errors import ConfigError, ReverieError
from worker.heap import freeze_loaded
from worker.logging_setup import configure_logging, route_litellm_logging
from worker.logs import get_logger, user_ref, warn_if_public_hash_key, warn_of_unknown_settings
from worker.metrics_server import refresh_pending_gauge
from worker.settings import Settings, get_settings

__all__ = ["refresh_pending_gauge"]

log = get_logger("reverie.worker")

_server: metrics_server.MetricsServer | None = None
_started: dict[str, float] = {}
_signatures: dict[Any, inspect.Signature] = {}
# Task keyword arguments worth carrying on every log line of the task (ids only).
_CONTEXT_KWARGS = ("run_id", "signal_id")
# The adoption sent at beat's start is worth nothing once the hourly one has run.
ADOPT_AT_START_EXPIRES = 3600.0


#: Celery's options that come before its command and take a value.
_CELERY_VALUED_OPTIONS = frozenset(
    {"-A", "--app", "-b", "--broker", "--result-backend", "--loader", "--config", "--workdir"}
)


def _celery_command(argv: list[str]) -> str | None:
    """The command of a ``celery`` process (``celery -A worker.app beat``: ``beat``), else None."""
    # ``celery``, or ``python -m celery`` (whose argv[0] is celery's ``__main__.py``).
    if not argv or (Path(argv[0]).name != "celery" and not argv[0].endswith("celery/__main__.py")):
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg in _CELERY_VALUED_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def _refuse_without_a_broker(argv: list[str]) -> None:
    """A worker or beat started with ``celery -A worker.app`` and no broker set: Celery
    would take its own default (an AMQP server on localhost) without a word. It stops
    here, before Celery reads its configuration. (``reverie worker`` and ``reverie beat``
    refuse before they start Celery.)"""
    process = _celery_command(argv)
    # Celery's own ``-b``/``--broker`` is put in CELERY_BROKER_URL before the app is
    # imported, and that variable comes before the app's setting: either is a broker.
    if process not in ("worker", "beat") or get_settings().broker_url or os.environ.get("CELERY_BROKER_URL"):
        return
    configure_logging(get_settings())
    log.error("no broker: REVERIE_BROKER_URL is empty", process=process, hint="cron mode runs `reverie run`")
    raise SystemExit(1)


_refuse_without_a_broker(sys.argv)

# prometheus-client picks file-backed values only if the directory is named before
# its first import. `reverie worker` names it before importing the app; this covers
# `celery -A worker.app worker`, which imports this module before the task modules.
if _celery_command(sys.argv) == "worker" and "prometheus_client.values" not in sys.modules:
    metrics_server.prepare_multiprocess_dir()


def _setup_logging(**_: Any) -> None:
    # Connecting this handler at all stops Celery from installing its own root handler.
    configure_logging(get_settings())


def _celeryd_init(conf: Any = None, **_: Any) -> None:
    if conf is not None:
        conf.worker_send_task_events = True
        conf.task_send_sent_event = True
    # The stock line ends with the task's return value, which is the task's business.
    celery_trace.LOG_SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"


def _worker_init(**_: Any) -> None:
    global _server  # noqa: PLW0603 - one endpoint per worker parent
    # First: a worker that detached (`--detach`, `celery multi`) closed the lock it inherited.
    if metrics_server.hold_own_dir():
        # A cold shutdown (SIGQUIT, a second Ctrl-C) sends no worker_shutdown.
        atexit.register(_remove_metrics_dir, os.getpid())
    settings = get_settings()
    # worker_init comes before Celery's setup_logging; these first lines need the format too.
    configure_logging(settings)
    warn_if_public_hash_key(settings, process="worker")
    warn_of_unknown_settings(process="worker")
    _check_database(settings)
    _preload_key_matcher(settings)
    _preload_gateway(settings)
    directory = metrics_server.multiprocess_dir()
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        removed = metrics_server.wipe_multiprocess_dir(directory, keep_pid=os.getpid())
        log.info("metrics directory wiped", files_removed=removed)
    else:
        log.warning(
            "metrics are not in multiprocess mode; prefork children will not be counted",
            hint=f"set {metrics_server.ENV_VAR} before starting the worker",
        )
    try:
        _server = metrics_server.serve(settings)
    except ReverieError as exc:
        # A worker without metrics still does its job; the scrape will show it down.
        log.error("metrics endpoint not started", error=str(exc))
        return
    log.info("metrics endpoint serving", port=_server.port, path="/metrics")


def _check_database(settings: Settings) -> None:
    """Say at start, in one line, what ``reverie run`` and ``reverie health`` refuse: a
    PostgreSQL older than served, or a last-access column the host's table does not
    have; every dream would fail on either. The worker starts all the same (signals
    need neither): the line says why its dreams fail until the setting or the database
    is mended."""
    from store.db import check_connection, dispose_engines
    from store.memories import check_memory_table

    try:
        check_connection(settings)
        check_memory_table(settings)
    except ConfigError as exc:
        log.error("configuration_error", error=str(exc), hint="work on the memory table fails until this is mended")
    except Exception as exc:
        # The database may not be up yet; the dreams say the rest.
        log.warning("database not checked at start", error_type=type(exc).__name__)
    finally:
        # Nothing opened here is carried into the forked children.
        dispose_engines()


def _preload_key_matcher(settings: Settings) -> None:
    """Load the key matcher (and its model) once in the main process, before the pool
    forks, so the children share its pages instead of each loading its own copy."""
    from worker.keymatch import get_matcher

    started = time.perf_counter()
    try:
        matcher = get_matcher(settings)
    except Exception as exc:
        # The children build it on first use; a worker must not fail to start for it.
        log.warning("key matcher not preloaded", error_type=type(exc).__name__)
        return
    log.info(
        "key matcher preloaded",
        mode=settings.key_matching,
        model=matcher.model_id is not None,
        seconds=round(time.perf_counter() - started, 2),
    )


def _preload_gateway(settings: Settings) -> None:
    """Load the LLM gateway once in the main process, before the pool forks."""
    from worker import llm

    try:
        took = llm.preload(settings)
    except Exception as exc:
        # The children import it again on their first model call, and fail there with a
        # typed error; signals that need no model must not wait for that.
        log.warning("llm gateway not preloaded", error_type=type(exc).__name__)
    else:
        log.info("llm gateway preloaded", seconds=round(took, 2))
    # What is loaded now lives as long as the process: keep the cyclic collector off
    # these objects, so it does not touch (and so copy) their pages in every child.
    freeze_loaded()


def _beat_init(sender: Any = None, **_: Any) -> None:
    """Adopt the users already in the memory table as soon as beat starts, not an
    adoption interval later: a deployment pointed at a database full of users has
    them all scheduled (spread over the dream interval) within the first ticks."""
    from kombu.exceptions import OperationalError as BrokerError

    warn_if_public_hash_key(get_settings(), process="beat")
    warn_of_unknown_settings(process="beat")
    if sender is None:
        return
    try:
        sender.app.send_task("schedules.adopt", kwargs={"at_start": True}, expires=ADOPT_AT_START_EXPIRES)
    except BrokerError as exc:
        # The hourly entry adopts them anyway; beat's own connection errors say the rest.
        log.warning("adoption at start not sent", error_type=type(exc).__name__)
    else:
        log.info("adoption at start sent")


def _worker_shutdown(**_: Any) -> None:
    global _server  # noqa: PLW0603 - one endpoint per worker parent
    if _server is not None:
        _server.close()
        _server = None
    _remove_metrics_dir(os.getpid())


def _remove_metrics_dir(pid: int) -> None:
    # The worker's parent only (a forked child inherits the exit hook), once its pool
    # has stopped: no child writes its values any more.
    if os.getpid() == pid and metrics_server.remove_own_dir():
        log.info("metrics directory removed")


def _worker_process_init(**_: Any) -> None:
    structlog.contextvars.clear_contextvars()
    _started.clear()


def _worker_process_shutdown(pid: int | None = None, **_: Any) -> None:
    metrics_server.mark_dead(pid if pid is not None else os.getpid())


def _signature(run: Any) -> inspect.Signature | None:
    # Computed once per task function, not once per message.
    try:
        cached = _signatures.get(run)
    except TypeError:  # not hashable
        cached = None
    if cached is None:
        try:
            cached = inspect.signature(run)
        except (TypeError, ValueError):
            return None
        with contextlib.suppress(TypeError):
            _signatures[run] = cached
    return cached


def _named_arguments(task: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    # Tasks take ids positionally (`signals.process(signal_id)`); name them by signature.
    run = getattr(task, "run", None)
    signature = _signature(run) if run else None
    try:
        bound = signature.bind_partial(*(args or ()), **(kwargs or {})) if signature else None
    except TypeError:
        bound = None
    if bound is not None:
        return dict(bound.arguments)
    return dict(kwargs) if isinstance(kwargs, dict) else {}


def _task_prerun(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    structlog.contextvars.clear_contextvars()
    context: dict[str, Any] = {"task_id": task_id, "task_name": getattr(task, "name", None)}
    arguments = _named_arguments(task, args, kwargs)
    context.update({key: arguments[key] for key in _CONTEXT_KWARGS if isinstance(arguments.get(key), int | str)})
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})
    if task_id is not None:
        _started[task_id] = time.monotonic()
    if "litellm" in sys.modules:
        route_litellm_logging()


def _task_failure(task_id: str | None = None, exception: BaseException | None = None, **_: Any) -> None:
    # Our own errors say what went wrong without user data; others are named by type only,
    # since a driver's message can quote the row it failed on.
    detail = str(exception) if isinstance(exception, ReverieError) else None
    log.warning("task failed", error_type=type(exception).__name__, error=detail)


def _task_postrun(task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    started = _started.pop(task_id, None) if task_id is not None else None
    elapsed = None if started is None else round(time.monotonic() - started, 4)
    log.debug("task finished", state=state, duration_seconds=elapsed)
    structlog.contextvars.clear_contextvars()


def _show_users_by_reference(sender: str | None = None, headers: Any = None, body: Any = None, **_: Any) -> None:
    """How Celery shows the arguments of a task that names users (task events, its log
    lines): by the users' log references, whoever sends it (the dispatcher, a retry, an
    application's ``dream.run_user``). (``celery inspect`` shows the message's own.)"""
    if sender not in USER_TASKS or not isinstance(headers, dict):
        return
    key = get_settings().log_hash_key
    args, kwargs = (body[0], body[1]) if isinstance(body, list | tuple) and len(body) >= 2 else ((), {})
    headers["argsrepr"] = repr(_by_reference(args, key))
    headers["kwargsrepr"] = repr(_by_reference(kwargs, key))


#: Tasks whose arguments name users (as strings).
USER_TASKS = frozenset({"dream.run_users", "dream.run_user"})


def _by_reference(value: Any, key: str) -> Any:
    if isinstance(value, str):
        return user_ref(value, key)
    if isinstance(value, dict):
        return {name: _by_reference(item, key) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return [_by_reference(item, key) for item in value]
    return value


signals.before_task_publish.connect(_show_users_by_reference)
signals.setup_logging.connect(_setup_logging)
signals.celeryd_init.connect(_celeryd_init)
signals.worker_init.connect(_worker_init)
signals.worker_shutdown.connect(_worker_shutdown)
signals.beat_init.connect(_beat_init)
signals.worker_process_init.connect(_worker_process_init)
signals.worker_process_shutdown.connect(_worker_process_shutdown)
signals.task_prerun.connect(_task_prerun)
signals.task_failure.connect(_task_failure)
signals.task_postrun.connect(_task_postrun)
