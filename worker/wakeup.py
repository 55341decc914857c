"""Wake-ups: the messages that tell a worker a row in PostgreSQL is ready.

The row is the truth and a wake-up is only a hint, so a lost one costs latency, never
work: beat's sweeper sends it again. Importing this module imports neither Celery nor
kombu; they are loaded on the first send. An empty ``REVERIE_BROKER_URL`` means no
broker (cron mode): nothing is sent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from worker.errors import BrokerUnavailable
from worker.logs import get_logger
from worker.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

PROCESS_SIGNAL = "signals.process"
RUN_USERS = "dream.run_users"
RESENT_KEY_PREFIX = "reverie:resent:"

#: After a failed send, the producer's wake-ups are skipped this long, so an absent
#: broker costs one failed connect (and one warning) per window, not one per signal.
QUIET_SECONDS = 30.0

log = get_logger(__name__)
_apps: dict[str, Celery] = {}
_lock = threading.Lock()
_publish_lock = threading.Lock()
#: (pid, broker URL) -> (connection, producer or None before the first connect).
_producers: dict[tuple[int, str], tuple[Any, Any]] = {}
_quiet_until = 0.0


def _fresh_locks_in_child() -> None:
    global _lock, _publish_lock  # noqa: PLW0603 - replaced, never shared with the parent
    # The worker's main process publishes from its signal listener thread; a pool child
    # forked while that thread held a lock would otherwise wait on it forever.
    _lock = threading.Lock()
    _publish_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks_in_child)


def _app_for(settings: Settings) -> Celery:
    from worker.app import app, create_app

    if settings.broker_url == app.conf.broker_url:
        return app
    with _lock:
        if settings.broker_url not in _apps:
            _apps[settings.broker_url] = create_app(settings)
        return _apps[settings.broker_url]


def publish(settings: Settings, task_name: str, args_list: Sequence[list[Any]]) -> int:
    """Send one ``task_name`` message per argument list, routed like the app routes it.
    Returns the number sent; raises :class:`BrokerUnavailable` (with ``sent``) when the
    broker fails part-way.

    The connection is kept for the next call (one per process and broker): a producer
    that enqueues signal after signal pays the connect and the queue declarations
    once. A kept connection that has gone stale is replaced once, never in a loop.
    """
    if not settings.broker_url or not args_list:
        return 0
    celery = _app_for(settings)
    sent = 0
    with _publish_lock:
        for attempt in (1, 2):
            try:
                producer = _producer(celery)
                for args in args_list[sent:]:
                    celery.send_task(task_name, args=args, producer=producer, retry=False)
                    sent += 1
                return sent
            except _broker_errors(celery) as exc:
                fresh = _forget_producer(celery)
                if attempt == 2 or fresh:
                    raise BrokerUnavailable(_first_line(exc), sent=sent) from exc
    return sent


def _broker_errors(celery: Celery) -> tuple[type[BaseException], ...]:
    from kombu.exceptions import KombuError

    connection = _producers.get((os.getpid(), celery.conf.broker_url))
    driver = () if connection is None else (*connection[0].connection_errors, *connection[0].channel_errors)
    return (KombuError, OSError, *driver)


def _producer(celery: Celery) -> Any:
    key = (os.getpid(), celery.conf.broker_url)
    kept = _producers.get(key)
    if kept is None:
        connection = celery.connection_for_write()
        # Stored before connecting, so a failed connect is recognised as fresh.
        _producers[key] = (connection, None)
        # No retry loop here: a producer must not hang on an absent broker.
        connection.ensure_connection(max_retries=0)
        kept = _producers[key] = (connection, celery.amqp.Producer(connection))
    return kept[1]


def _forget_producer(celery: Celery) -> bool:
    """Drop this process's kept connection; True if it had never published."""
    kept = _producers.pop((os.getpid(), celery.conf.broker_url), None)
    if kept is None:
        return True
    with contextlib.suppress(Exception):
        kept[0].release()
    return kept[1] is None


def not_resent_within(settings: Settings, signal_ids: Sequence[int], seconds: int) -> list[int]:
    """The ids among ``signal_ids`` that got no re-sent wake-up in the last ``seconds``,
    marked as re-sent now (a key with that time to live in the broker's Redis), so the
    sweeper sends each stranded signal at most one wake-up per window. Raises
    :class:`BrokerUnavailable`."""
    if not settings.broker_url or not signal_ids:
        return []
    import redis

    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5)
    try:
        with client.pipeline(transaction=False) as pipe:
            for signal_id in signal_ids:
                pipe.set(f"{RESENT_KEY_PREFIX}{signal_id}", 1, nx=True, ex=max(seconds, 1))
            marked = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        raise BrokerUnavailable(_first_line(exc)) from exc
    finally:
        client.close()
    return [signal_id for signal_id, fresh in zip(signal_ids, marked, strict=True) if fresh]


def wake_signal(settings: Settings, signal_id: int) -> bool:
    """The producer's wake-up, called after the signal's row is committed.

    Never raises for a broker problem: it logs a warning and returns False, and the
    sweeper delivers the signal later.
    """
    global _quiet_until  # noqa: PLW0603 - one process-wide window, shared by every caller
    if not settings.broker_url or time.monotonic() < _quiet_until:
        return False
    try:
        publish(settings, PROCESS_SIGNAL, [[signal_id]])
    except BrokerUnavailable as exc:
        _quiet_until = time.monotonic() + QUIET_SECONDS
        log.warning(
            "wakeup.broker_unavailable",
            signal_id=signal_id,
            error=exc.reason,
            skipping_seconds=QUIET_SECONDS,
        )
        return False
    return True


def wake_signals(settings: Settings, signal_ids: Sequence[int]) -> int:
    """Wake-ups for many signals (the sweeper). Raises :class:`BrokerUnavailable`."""
    return publish(settings, PROCESS_SIGNAL, [[signal_id] for signal_id in signal_ids])


def send_user_runs(settings: Settings, user_ids: list[str]) -> None:
    """One ``dream.run_users`` message for a chunk of users (the dispatcher)."""
    publish(settings, RUN_USERS, [[user_ids]])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
