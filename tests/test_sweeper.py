"""Beat's sweeper: which signals get a new wake-up, and that a lost wake-up costs only
latency: the row left behind is found and sent again."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from sqlalchemy import select, update

from schedules import sweeper
from store import dispatch as dispatch_store
from store.db import session_scope
from store.models import Signal
from store.seed import insert_raw_signal
from store.types import now
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


def test_sweep_sends_one_wake_up_per_stranded_signal(make_settings: object) -> None:
    settings: Settings = make_settings(sweep_grace_seconds=0)  # type: ignore[operator]
    at = now()
    first = _signal(settings, "a", available_at=at - timedelta(seconds=5))
    second = _signal(settings, "b", available_at=at - timedelta(seconds=1))
    sent: list[list[int]] = []

    def send(signal_ids: list[int]) -> int:
        sent.append(signal_ids)
        return len(signal_ids)

    assert sweeper.sweep(settings, send, lambda: 0, at=at) == 2
    assert sent == [[first, second]]


def test_a_backlog_already_in_the_queue_is_not_flooded_with_copies(make_settings: object) -> None:
    settings: Settings = make_settings(sweep_grace_seconds=0, signal_lease_seconds=300)  # type: ignore[operator]
    at = now()
    ids = [_signal(settings, f"u{i}", available_at=at - timedelta(seconds=60 - i)) for i in range(10)]
    sent: list[int] = []

    def send(signal_ids: list[int]) -> int:
        sent.extend(signal_ids)
        return len(signal_ids)

    # Ten stranded rows, ten messages waiting: they may all be covered.
    assert sweeper.sweep(settings, send, lambda: 10, at=at) == 0
    # Seven waiting: the three oldest get a wake-up now, the rest once the queue drains.
    assert sweeper.sweep(settings, send, lambda: 7, at=at) == 3
    assert sent == ids[:3]


def test_a_row_stranded_longer_than_a_lease_is_sent_even_behind_a_queue(make_settings: object) -> None:
    settings: Settings = make_settings(sweep_grace_seconds=0, signal_lease_seconds=300)  # type: ignore[operator]
    at = now()
    lost = _signal(settings, "lost", available_at=at - timedelta(minutes=20))
    _signal(settings, "recent", available_at=at - timedelta(seconds=30))
    sent: list[int] = []

    def send(signal_ids: list[int]) -> int:
        sent.extend(signal_ids)
        return len(signal_ids)

    assert sweeper.sweep(settings, send, lambda: 50, at=at) == 1
    assert sent == [lost]


def test_sweep_with_nothing_stranded_sends_nothing(pg_settings: Settings) -> None:
    _signal(pg_settings, "done", status="done")

    def send(_ids: list[int]) -> int:
        raise AssertionError("nothing to send")

    def queued() -> int:
        raise AssertionError("the broker is not asked when nothing is stranded")

    assert sweeper.sweep(pg_settings, send, queued) == 0


def test_a_signal_inserted_by_plain_sql_is_found_after_the_grace(pg_settings: Settings) -> None:
    signal_id = _signal(pg_settings, "outbox-only")
    inserted = now()

    assert _stranded(pg_settings, inserted, grace=60) == []
    assert _stranded(pg_settings, inserted + timedelta(seconds=61), grace=60) == [signal_id]
