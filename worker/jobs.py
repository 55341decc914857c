"""The Celery tasks: thin wrappers that take ids, call a plain function, and return.

Each function called here opens its own transaction(s) through ``store.db`` and commits
at its boundary; follow-up messages are sent only after that commit. Arguments are ids
(JSON), never objects or user data.

Retry policy: only typed transient errors (:class:`~worker.errors.TransientError`,
:class:`~worker.errors.DatabaseUnavailable`) are retried, with exponential backoff
capped at a few minutes. A retry is only a shortcut: if its message is lost, the work
is found again from PostgreSQL (a signal by the sweeper, a dispatched user when the
dispatch lease ends). Anything else is a bug or bad
input and fails the task once. Periodic tasks never retry: the next tick does the
same work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded

from schedules import dispatcher, sweeper
from schedules.beat import periods
from tasks.activity import detect_routines
from tasks.dream import (
    DREAM_SOFT_TIME_LIMIT_SECONDS,
    DREAM_TIME_LIMIT_SECONDS,
    UNKNOWN_USER,
    dream_user,
    dream_users,
)
from tasks.retention import purge_expired
from tasks.signals import process_signal
from worker import periodic
from worker.app import app
from worker.errors import BrokerUnavailable, DatabaseUnavailable, TransientError
from worker.logs import get_logger
from worker.metrics_server import refresh_pending_gauge
from worker.settings import get_settings
from worker.wakeup import not_resent_within, send_user_runs, wake_signals

log = get_logger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

TRANSIENT = (TransientError, DatabaseUnavailable)
#: Longest wait before a retry, so no retry is a long countdown in the broker.
RETRY_BACKOFF_MAX = 300
RETRY = {
    "autoretry_for": TRANSIENT,
    "retry_backoff": 5,
    "retry_backoff_max": RETRY_BACKOFF_MAX,
    "retry_jitter": True,
    "max_retries": 8,
}
#: A chunk of users hands what is left to a new message after this long, so one
#: message never holds a worker near its time limit.
CHUNK_BUDGET_SECONDS = 600.0


def first_of_its_period(task: Task) -> bool:
    """Whether this message of a periodic task should run (see :mod:`worker.periodic`)."""
    settings = get_settings()
    name = task.name
    return periodic.claim(settings, name, task.request.expires, task.request.id, periods(settings)[name])


def task(name: str, **options: Any) -> Callable[[F], F]:
    """``app.task`` with a type, so the task bodies stay type-checked."""
    decorator: Callable[[F], F] = app.task(name=name, **options)
    return decorator


@task("signals.process", soft_time_limit=240, time_limit=300, **RETRY)
def process(signal_id: int) -> str:
    """Process one signal by id; a wake-up for a finished signal is a no-op."""
    return process_signal(get_settings(), signal_id)


@task("dream.run_user", soft_time_limit=DREAM_SOFT_TIME_LIMIT_SECONDS, time_limit=DREAM_TIME_LIMIT_SECONDS, **RETRY)
def run_user(user_id: str) -> str:
    """One user's dream on demand; returns the run's status."""
    return dream_user(get_settings(), user_id, trigger="manual").status


@task(
    "dream.run_users",
    bind=True,
    soft_time_limit=DREAM_SOFT_TIME_LIMIT_SECONDS,
    time_limit=DREAM_TIME_LIMIT_SECONDS,
    max_retries=8,
)
def run_users(self: Task, user_ids: list[str]) -> dict[str, int]:
    """A chunk of dispatched users, dreamed together (see :func:`tasks.dream.dream_users`)."""
    settings = get_settings()
    try:
        outcomes = dream_users(
            settings,
            user_ids,
            trigger="schedule",
            interrupts=(SoftTimeLimitExceeded,),
            budget_seconds=CHUNK_BUDGET_SECONDS,
        )
    except TRANSIENT as exc:
        countdown = min(5 * 2**self.request.retries, RETRY_BACKOFF_MAX)
        raise self.retry(args=[user_ids], exc=exc, countdown=countdown) from exc
    statuses = [o.status for o in outcomes]
    unknown = sum(1 for o in outcomes if o.status == "skipped" and o.error == UNKNOWN_USER)
    return {
        "dreamed": statuses.count("succeeded"),
        "busy": statuses.count("skipped") - unknown,
        "unknown": unknown,
        "failed": statuses.count("failed"),
        "handed_on": 0,
    }


@task("schedules.dispatch", soft_time_limit=100, time_limit=120)
def dispatch() -> int:
    """Beat's tick: claim the due users and send their runs in chunks."""
    settings = get_settings()
    return dispatcher.dispatch(settings, lambda chunk: send_user_runs(settings, chunk)).sent


@task("schedules.sweep", bind=True, soft_time_limit=100, time_limit=120)
def sweep(self: Task) -> int | None:
    """Re-send wake-ups for signals that are not moving (None: this period's sweep ran)."""
    if not first_of_its_period(self):
        return None
    settings = get_settings()

    def send(signal_ids: list[int]) -> int:
        return wake_signals(settings, signal_ids)

    try:
        return sweeper.sweep(settings, send, lambda ids, window: not_resent_within(settings, ids, window))
    except BrokerUnavailable as exc:
        # The next sweep tries again; the rows wait in PostgreSQL meanwhile.
        log.warning("sweep.broker_unavailable", sent=exc.sent, error=exc.reason)
        return exc.sent


@task("schedules.adopt", bind=True, soft_time_limit=1700, time_limit=1800)
def adopt(self: Task, at_start: bool = False) -> int | None:
    """Schedule the memory table's users that have no schedule row yet. ``at_start``:
    the adoption beat sends when it starts, which always runs (a beat restarted after
    pointing it at a database full of users must not wait for the hourly one)."""
    if not at_start and not first_of_its_period(self):
        return None
    return dispatcher.adopt(get_settings())


@task("activity.routines", bind=True, soft_time_limit=3300, time_limit=3600, **RETRY)
def routines(self: Task) -> int | None:
    """The daily routine detection over recent activity events."""
    if not first_of_its_period(self):
        return None
    return detect_routines(get_settings())


@task("retention.purge", bind=True, soft_time_limit=1700, time_limit=1800)
def purge(self: Task) -> dict[str, int] | None:
    """Purge what is past its retention (archive, signal payloads, events, runs, spend)."""
    if not first_of_its_period(self):
        return None
    return asdict(purge_expired(get_settings()))


@task("metrics.refresh_pending", soft_time_limit=25, time_limit=30)
def refresh_pending() -> dict[str, Any]:
    """Refresh ``dream_signals_pending`` from the database."""
    return dict(refresh_pending_gauge(get_settings()))
