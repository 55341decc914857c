"""Two beats at once are harmless: the dispatcher sends each due user once per due
window, and every other periodic task runs once per period, whichever beat sent it."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert

import worker.jobs as jobs
from schedules import dispatcher, sweeper
from schedules.beat import periods
from store.db import dispose_engines, session_scope
from store.models import UserState
from store.types import now
from worker import periodic
from worker.app import app
from worker.settings import Settings

USERS = 1200


def _beat_process(database_url: str, at: datetime, start: Any, sent: Any) -> None:
    """One beat's dispatcher in a process of its own: ticks until nobody is due."""
    settings = Settings(_env_file=None, database_url=database_url, broker_url="", dispatch_max_users=50)
    start.wait(timeout=60)
    while True:
        chunks: list[list[str]] = []
        result = dispatcher.dispatch(settings, chunks.append, at=at)
        for chunk in chunks:
            sent.put(chunk)
        if result.claimed == 0:
            break
    dispose_engines()
    sent.put(None)


def test_two_beats_ticking_at_once_send_each_due_user_once(make_settings: Any) -> None:
    settings: Settings = make_settings()
    at = now()
    with session_scope(settings) as session:
        rows = [{"user_id": f"u{i:05d}", "next_dream_at": at - timedelta(seconds=i % 600)} for i in range(USERS)]
        session.execute(insert(UserState), rows)
    dispose_engines()

    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    sent = context.Queue()
    beats = [context.Process(target=_beat_process, args=(settings.database_url, at, start, sent)) for _ in range(2)]
    for beat in beats:
        beat.start()
    finished = 0
    received: list[str] = []
    while finished < 2:
        chunk = sent.get(timeout=120)
        if chunk is None:
            finished += 1
        else:
            received.extend(chunk)
    for beat in beats:
        beat.join(timeout=60)
        assert beat.exitcode == 0

    counts = Counter(received)
    assert len(counts) == USERS
    assert max(counts.values()) == 1
    # Still inside the same due window, nobody is claimable again.
    assert dispatcher.claim(settings, at=at + timedelta(seconds=1)) == []


class _Request:
    def __init__(self, task_id: str, expires: str | None) -> None:
        self.id = task_id
        self.expires = expires


def _sent_at(period: float, seconds: float, *, base: datetime) -> str:
    """The expiry beat puts on a message sent ``seconds`` into a period (expiry = send + period)."""
    return (base + timedelta(seconds=seconds + period)).isoformat()


def _call(task: Any, task_id: str, expires: str | None) -> Any:
    task.push_request(id=task_id, expires=expires)
    try:
        return task()
    finally:
        task.pop_request()


@pytest.fixture()
def live(make_settings: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings with a real broker Redis and PostgreSQL, as the worker's tasks read them."""
    settings: Settings = make_settings(broker_url=redis_url)
    monkeypatch.setattr(jobs, "get_settings", lambda: settings)
    return settings


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> Counter[str]:
    calls: Counter[str] = Counter()
    real: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize(
    ("task_name", "owner", "function"),
    [
        ("schedules.adopt", dispatcher, "adopt"),
        ("schedules.sweep", sweeper, "sweep"),
        ("retention.purge", jobs, "purge_expired"),
        ("activity.routines", jobs, "detect_routines"),
    ],
)
def test_a_second_beats_tick_in_the_same_period_does_no_work(
    live: Settings, monkeypatch: pytest.MonkeyPatch, task_name: str, owner: Any, function: str
) -> None:
    task = app.tasks[task_name]
    period = periods(live)[task_name]
    calls = _counting(monkeypatch, owner, function)
    base = datetime.fromtimestamp((now().timestamp() // period) * period, UTC)

    first = _call(task, "beat-a-1", _sent_at(period, period * 0.1, base=base))
    second = _call(task, "beat-b-1", _sent_at(period, period * 0.6, base=base))
    assert second is None
    assert calls[function] == 1
    assert first is not None

    # The same message delivered again (its worker died) runs again; so does the next
    # period's first message, however late the last one ran.
    _call(task, "beat-a-1", _sent_at(period, period * 0.1, base=base))
    _call(task, "beat-a-2", _sent_at(period, period * 1.1, base=base))
    assert calls[function] == 3
    # A message sent by hand (no expiry) always runs.
    _call(task, "by-hand", None)
    assert calls[function] == 4


def test_adoption_at_start_always_runs_and_does_not_take_the_hourly_claim(
    live: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A beat restarted within the hour (pointed at a database full of users) adopts at
    once, whatever an earlier beat's start or hourly adoption claimed."""
    calls = _counting(monkeypatch, dispatcher, "adopt")
    expires = (now() + timedelta(hours=1)).replace(tzinfo=UTC).isoformat()
    task: Any = app.tasks["schedules.adopt"]
    for task_id, kwargs in [
        ("start-a", {"at_start": True}),
        ("start-b", {"at_start": True}),
        ("hourly-a", {}),
        ("hourly-b", {}),
        ("start-c", {"at_start": True}),
    ]:
        task.push_request(id=task_id, expires=expires)
        try:
            task(**kwargs)
        finally:
            task.pop_request()
    assert calls["adopt"] == 4  # three starts and one of the two hourly messages


def test_racing_claims_of_one_period_let_exactly_one_through(redis_url: str) -> None:
    settings = Settings(_env_file=None, broker_url=redis_url)
    expires = datetime(2030, 1, 1, 10, 30, tzinfo=UTC).isoformat()
    start = threading.Barrier(8)
    won: list[str] = []

    def race(token: str) -> None:
        start.wait()
        if periodic.claim(settings, "schedules.sweep", expires, token, 30.0):
            won.append(token)

    threads = [threading.Thread(target=race, args=(f"t{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1


def test_period_index_reads_every_form_of_expiry() -> None:
    moment = datetime(2030, 1, 1, 10, 30, tzinfo=UTC)
    index = periodic.period_index(moment, 3600)
    assert index is not None
    assert index == periodic.period_index(moment.isoformat(), 3600) == periodic.period_index(moment.timestamp(), 3600)
    assert periodic.period_index(moment + timedelta(minutes=29), 3600) == index
    assert periodic.period_index(moment + timedelta(minutes=30), 3600) == index + 1
    assert periodic.period_index(None, 3600) is None
