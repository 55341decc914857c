"""The producer side: queue one signal for one user (docs/reference.md, Signals).

Importing this module is cheap: it imports neither litellm nor Celery, and it never
connects to a broker. With ``session=`` the row is written inside the caller's
transaction (a transactional outbox); without it, in a transaction of its own.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from store import signals as signal_store
from store.db import session_scope
from store.notices import producer_wakes
from worker.errors import InvalidSignal
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
) -> Enqueued:
    """Validate and queue a signal. Raises :class:`~worker.errors.InvalidSignal`.

    A second call with the same idempotency key (by default a hash of kind, user and
    canonical payload) writes nothing and returns ``created=False``.
    """
    return _enqueue(
        kind,
        user_id,
        payload,
        None,
        agent_id=agent_id,
        idempotency_key=idempotency_key,
        session=session,
        settings=settings,
    )


def enqueue_signal_json(
    kind: str,
    user_id: str,
    payload_json: str,
    *,
    agent_id: str | None = None,
    idempotency_key: str | None = None,
    session: Session | None = None,
    settings: Settings | None = None,
) -> Enqueued:
    """:func:`enqueue_signal` of a payload given as JSON text (a file's, a request's
    body), as ``reverie enqueue`` sends it. On PostgreSQL the text itself is written, as
    a producer's own ``INSERT`` writes it: its numbers keep their digits (``100.50``),
    and its default key is the one the same text sent by SQL gets. Its size is that
    text's."""
    try:
        payload = json.loads(payload_json)
    except json.JSONDecodeError as exc:
        raise InvalidSignal(
            "payload", f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ValueError as exc:
        # What Python refuses to read in valid JSON: a whole number of more than 4,300
        # digits (its message names the limit, not the number).
        raise InvalidSignal("payload", f"is not JSON Reverie reads: {exc}") from None
    except RecursionError:
        raise InvalidSignal("payload", "is nested too deeply") from None
    return _enqueue(
        kind,
        user_id,
        payload,
        payload_json,
        agent_id=agent_id,
        idempotency_key=idempotency_key,
        session=session,
        settings=settings,
    )


def _enqueue(
    kind: str,
    user_id: str,
    payload: Any,
    payload_text: str | None,
    *,
    agent_id: str | None,
    idempotency_key: str | None,
    session: Session | None,
    settings: Settings | None,
) -> Enqueued:
    settings = settings or get_settings()
    validate_signal(kind, user_id, payload, settings, agent_id=agent_id, idempotency_key=idempotency_key)
    if payload_text is not None and (size := len(payload_text.encode("utf-8"))) > settings.max_payload_bytes:
        # What is written is the text: its own size counts (long digits of numbers included).
        raise InvalidSignal("payload", f"is {size} bytes; at most {settings.max_payload_bytes} allowed")
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
