"""Beat's sweeper: which signals get a new wake-up, and that a lost wake-up costs only
latency: the row left behind is found and sent again."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import redis as redis_lib
from sqlalchemy import select, update

from schedules import sweeper
from store import dispatch as dispatch_store
from store.db import session_scope
from store.models import Signal
from store.seed import insert_raw_signal
from store.types import now
from worker import wakeup
from worker.settings import Settings

PAYLOAD = json.dumps({"agent_id": "a", "events": [{"action": "digest", "at": "2025-01-06T09:00:00"}]})


def _signal(settings: Settings, user: str, **values: object) -> int:
    with session_scope(settings) as session:
        insert_raw_signal(session, "activity", user, PAYLOAD.replace('"a"', json.dumps(user)))
        signal_id = session.scalars(select(Signal.id).where(Signal.user_id == user)).one()
        if values:
            session.execute(update(Signal).where(Signal.id == signal_id).values(**values))
    return signal_id


def _stranded(settings: Settings, at: datetime, *, grace: float = 60, limit: int = 100) -> list[int]:
    with session_scope(settings) as session:
        return [
            signal_id
            for signal_id, _since in dispatch_store.stranded_signals(session, at=at, grace_seconds=grace, limit=limit)
        ]


def test_finds_the_signals_that_are_not_moving_oldest_first(store_settings: Settings) -> None:
    at = now()
    ago = lambda minutes: at - timedelta(minutes=minutes)  # noqa: E731
    old_pending = _signal(store_settings, "old-pending", available_at=ago(10), enqueued_at=ago(10))
    _signal(store_settings, "fresh-pending", available_at=ago(0.2))
    retry_due = _signal(store_settings, "retry-due", status="failed", available_at=ago(5), attempts=1)
    _signal(store_settings, "backing-off", status="failed", available_at=at + timedelta(minutes=5), attempts=1)
    died = _signal(
        store_settings, "worker-died", status="processing", claimed_until=ago(1), available_at=ago(30), attempts=1
    )
    _signal(store_settings, "in-lease", status="processing", claimed_until=at + timedelta(minutes=4), attempts=1)
    for status in ("done", "rejected", "dead"):
        _signal(store_settings, status, status=status, available_at=ago(60))

    assert _stranded(store_settings, at) == [old_pending, retry_due, died]


def test_a_sweep_is_bounded_and_takes_the_oldest(store_settings: Settings) -> None:
    at = now()
    ids = [_signal(store_settings, f"u{i}", available_at=at - timedelta(minutes=30 - i)) for i in range(12)]

    assert _stranded(store_settings, at, limit=5) == ids[:5]


def _all(ids: list[int], _window: int) -> list[int]:
    return ids


def test_sweep_sends_one_wake_up_per_stranded_signal(make_settings: object) -> None:
    settings: Settings = make_settings(sweep_grace_seconds=0)  # type: ignore[operator]
    at = now()
    first = _signal(settings, "a", available_at=at - timedelta(seconds=5))
    second = _signal(settings, "b", available_at=at - timedelta(seconds=1))
    sent: list[list[int]] = []

    def send(signal_ids: list[int]) -> int:
        sent.append(signal_ids)
        return len(signal_ids)

    assert sweeper.sweep(settings, send, _all, at=at) == 2
    assert sent == [[first, second]]


def test_each_stranded_signal_gets_one_wake_up_per_lease(make_settings: object, redis_url: str) -> None:
    settings: Settings = make_settings(  # type: ignore[operator]
        sweep_grace_seconds=0, signal_lease_seconds=300, broker_url=redis_url
    )
    at = now()
    ids = [_signal(settings, f"u{i}", available_at=at - timedelta(seconds=60 - i)) for i in range(3)]
    sent: list[int] = []

    def send(signal_ids: list[int]) -> int:
        sent.extend(signal_ids)
        return len(signal_ids)

    def not_resent(signal_ids: list[int], window: int) -> list[int]:
        return wakeup.not_resent_within(settings, signal_ids, window)

    assert sweeper.sweep(settings, send, not_resent, at=at) == 3
    # The queue may still hold those wake-ups: a second sweep in the window adds no copies.
    assert sweeper.sweep(settings, send, not_resent, at=at) == 0
    late = _signal(settings, "late", available_at=at - timedelta(seconds=1))
    assert sweeper.sweep(settings, send, not_resent, at=at) == 1
    assert sent == [*ids, late]
    client = redis_lib.Redis.from_url(redis_url)
    assert 0 < client.ttl(f"{wakeup.RESENT_KEY_PREFIX}{late}") <= 300
    client.close()


def test_sweep_with_nothing_stranded_sends_nothing(pg_settings: Settings) -> None:
    _signal(pg_settings, "done", status="done")

    def send(_ids: list[int]) -> int:
        raise AssertionError("nothing to send")

    def not_resent(_ids: list[int], _window: int) -> list[int]:
        raise AssertionError("the broker is not asked when nothing is stranded")

    assert sweeper.sweep(pg_settings, send, not_resent) == 0


def test_a_signal_inserted_by_plain_sql_is_found_after_the_grace(pg_settings: Settings) -> None:
    signal_id = _signal(pg_settings, "outbox-only")
    inserted = now()

    assert _stranded(pg_settings, inserted, grace=60) == []
    assert _stranded(pg_settings, inserted + timedelta(seconds=61), grace=60) == [signal_id]
