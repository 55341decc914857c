"""The producer side: queue one signal for one user (docs/reference.md, Signals).

Importing this module is cheap: it imports neither litellm nor Celery, and it never
connects to a broker. With ``session=`` the row is written inside the caller's
transaction (a transactional outbox); without it, in a transaction of its own.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from store import signals as signal_store
from store.db import session_scope
from store.notices import producer_wakes
from worker.payloads import default_idempotency_key, validate_signal
from worker.settings import Settings, get_settings


@dataclass(frozen=True)
class Enqueued:
    """What happened to an enqueue: ``created`` is False for a duplicate (a no-op)."""

    signal_id: int
    idempotency_key: str
    created: bool


def enqueue_signal(
    kind: str,
    user_id: str,
    payload: dict[str, Any],
    *,
    agent_id: str | None = None,
    idempotency_key: str | None = None,
    session: Session | None = None,
    settings: Settings | None = None,
    payload_text: str | None = None,
) -> Enqueued:
    """Validate and queue a signal. Raises :class:`~worker.errors.InvalidSignal`.

    A second call with the same idempotency key (by default a hash of kind, user and
    canonical payload) writes nothing and returns ``created=False``. ``payload_text``:
    the JSON text ``payload`` was read from, if any (``reverie enqueue``'s file); on
    PostgreSQL it is written as it is, so its numbers keep their digits (``100.50``)
    and its default key is the one the same text sent by SQL gets.
    """
    settings = settings or get_settings()
    validate_signal(kind, user_id, payload, settings, agent_id=agent_id, idempotency_key=idempotency_key)
    fallback = default_idempotency_key(kind, user_id, payload)

    def write(target: Session) -> Enqueued:
        # This helper publishes its own wake-up after commit, so PostgreSQL's notice
        # for the row would only double it; without a broker there is no wake-up to
        # send, and the notice is what reaches a worker.
        skip_notice = producer_wakes(target) if settings.broker_url else nullcontext()
        with skip_notice:
            inserted = signal_store.insert_signal(
                target,
                kind=kind,
                user_id=user_id,
                payload=payload,
                agent_id=agent_id,
                idempotency_key=idempotency_key,
                fallback_key=fallback,
                payload_text=payload_text,
            )
        return Enqueued(inserted.signal_id, inserted.idempotency_key, inserted.created)

    if session is not None:
        result = write(session)
        if result.created:
            _after_commit(session, settings, result.signal_id)
        return result
    with session_scope(settings) as own:
        result = write(own)
    if result.created:
        _wake(settings, result.signal_id)
    return result


def _after_commit(session: Session, settings: Settings, signal_id: int) -> None:
    def fire(_session: Session) -> None:
        _wake(settings, signal_id)

    event.listen(session, "after_commit", fire, once=True)


def _wake(settings: Settings, signal_id: int) -> None:
    # Only after the commit, so the worker never looks for a row it cannot see yet;
    # imported here because the wake-up loads Celery, which producers need not pay for.
    from worker.wakeup import wake_signal

    wake_signal(settings, signal_id)
