"""The Celery app: ``celery -A worker.app worker|beat`` (``reverie worker|beat``).

Configured for a Redis broker that may go away at any moment. The database rows are the
truth and a message is only a wake-up: every kind of work that goes through the broker
is found again from PostgreSQL if its message is lost (a signal by beat's sweeper, from
its row and its lease; a scheduled dream by the dispatcher, when the claim's lease on
the user runs out; periodic work by beat's next tick), and every task is safe to run
twice. So the broker is asked for as little as possible:

- a message is acknowledged when a worker process takes it, and Redis keeps no copy of
  it after that (no ack emulation: no unacknowledged-message hash, no visibility
  timeout, nothing to restore or acknowledge through a connection that has just
  dropped). With ack emulation, kombu 5.7 sometimes failed exactly there when Redis
  restarted, and Celery stopped the worker as "unrecoverable"; a worker holds at most
  one message per process (prefetch 1);
- when Redis goes away the worker reconnects by itself, for as long as it takes
  (Celery's default gives up after 100 attempts, about 45 minutes, and the worker
  then stops consuming for good); a half-open connection is noticed within the
  socket timeout and Redis's health checks instead of hanging a publish forever;
- tasks still running when the broker connection drops are left to finish: their
  work is in PostgreSQL and commits or rolls back on its own;
- future work is kept in PostgreSQL (``available_at``, ``next_dream_at``), never as a
  long countdown in the broker;
- no result backend, JSON only, stable namespaced task names, one queue per kind of
  work so a backlog of dreams never delays signals.

Engines and sessions are made per worker process after fork, never at import.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_process_init
from kombu.entity import Exchange, Queue

import worker.celery_hooks  # noqa: F401  (logging context, metrics, task events)
from schedules.beat import beat_schedule
from store.db import dispose_engines
from worker import signal_listener  # noqa: F401  (PostgreSQL's notices of new signals)
from worker.settings import Settings, get_settings

SIGNALS_QUEUE = "signals"
DREAMS_QUEUE = "dreams"
HOUSEKEEPING_QUEUE = "housekeeping"
QUEUES = (SIGNALS_QUEUE, DREAMS_QUEUE, HOUSEKEEPING_QUEUE)

#: Seconds a command may wait on the broker's socket before the connection counts as lost.
BROKER_SOCKET_TIMEOUT = 30

ROUTES = {
    "signals.*": {"queue": SIGNALS_QUEUE},
    "dream.*": {"queue": DREAMS_QUEUE},
    "schedules.*": {"queue": HOUSEKEEPING_QUEUE},
    "activity.*": {"queue": HOUSEKEEPING_QUEUE},
    "metrics.*": {"queue": HOUSEKEEPING_QUEUE},
    "retention.*": {"queue": HOUSEKEEPING_QUEUE},
}


def celery_config(settings: Settings) -> dict[str, Any]:
    """The app's configuration for ``settings`` (a plain dict, so tests can read it)."""
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        "broker_transport_options": {
            # A message leaves Redis when it is delivered (see the module's docstring).
            "ack_emulation": False,
            "socket_connect_timeout": 5,
            # Longer than BRPOP's own 1 s timeout; bounds a command on a dead connection.
            "socket_timeout": BROKER_SOCKET_TIMEOUT,
            "socket_keepalive": True,
            "health_check_interval": 25,
            "fanout_prefix": True,
            "fanout_patterns": True,
        },
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Default limits for a task that declares none; each task in worker.jobs sets its own.
        "task_soft_time_limit": 240,
        "task_time_limit": 300,
        # Each queue on its own direct exchange and key: a message reaches one queue only.
        "task_queues": [
            Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]
            for name in QUEUES
        ],
        "task_default_queue": HOUSEKEEPING_QUEUE,
        "task_routes": ROUTES,
        "task_create_missing_queues": False,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_concurrency": settings.worker_concurrency,
        "worker_hijack_root_logger": False,
        "beat_schedule": beat_schedule(settings, signals_queue=SIGNALS_QUEUE),
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings) -> Celery:
    """A Celery app for ``settings`` with the tasks of :mod:`worker.jobs` included."""
    celery = Celery("reverie", include=["worker.jobs"])
    celery.conf.update(celery_config(settings))
    return celery


def _fresh_engines(**_: Any) -> None:
    # A forked child must not reuse the parent's pooled connections.
    dispose_engines()


worker_process_init.connect(_fresh_engines)


app = create_app(get_settings())
