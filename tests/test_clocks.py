"""One clock: a worker whose own clock is off from the database's (real PostgreSQL).

The worker's Python clock is moved behind or ahead of the database's; every time
that other hosts or column defaults wrote is still compared with the database's own
``now()``: a fresh signal is claimed by its wake-up, a lease is neither taken early
nor held too long, a change after a dispatch is dispatched again, and the day's
budget is the database's day.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from types import ModuleType

import pytest
from sqlalchemy import insert, select, text

import schedules.cron
import schedules.dispatcher
import schedules.sweeper
import store.archive
import store.locks
import store.memories
import store.runs
import store.schedule
import store.signals
import store.types
import tasks.dream
import tasks.signals
import worker.budget
from store import dispatch as dispatch_store
from store import locks, schedule
from store import signals as signal_store
from store.db import session_scope
from store.models import Signal, UserState
from tasks.signals import process_signal
from worker.producer import enqueue_signal
from worker.settings import Settings

#: Every module whose code read the worker's clock for a time compared across hosts.
CLOCK_USERS: tuple[ModuleType, ...] = (
    store.types,
    store.archive,
    store.memories,
    store.locks,
    store.runs,
    store.schedule,
    store.signals,
    tasks.dream,
    tasks.signals,
    schedules.cron,
    schedules.dispatcher,
    schedules.sweeper,
    worker.budget,
)

Skew = Callable[[timedelta], None]


@pytest.fixture()
def skew(monkeypatch: pytest.MonkeyPatch) -> Skew:
    """Move this worker's clock by an offset from the real time."""
    real = store.types.now

    def move(offset: timedelta) -> None:
        def skewed() -> datetime:
            return real() + offset

        for module in CLOCK_USERS:
            monkeypatch.setattr(module, "now", skewed, raising=False)

    return move


def database_now(settings: Settings) -> datetime:
    with session_scope(settings) as session:
        value: datetime = session.execute(text("SELECT timezone('utc', statement_timestamp())")).scalar_one()
    return value


def status_of(settings: Settings, signal_id: int) -> str:
    with session_scope(settings) as session:
        return str(session.scalar(select(Signal.status).where(Signal.id == signal_id)))


@pytest.mark.parametrize("behind", [0.2, 5.0])
def test_a_fresh_signal_is_claimed_by_its_wake_up_on_a_worker_behind(
    pg_settings: Settings, skew: Skew, behind: float
) -> None:
    skew(-timedelta(seconds=behind))
    events = {"events": [{"action": "digest", "at": "2024-05-06T09:00:00Z"}]}
    signal = enqueue_signal("activity", "ann", events, settings=pg_settings)
    assert process_signal(pg_settings, signal.signal_id) == "done"
    assert status_of(pg_settings, signal.signal_id) == "done"


def test_a_failed_signal_waits_its_backoff_on_the_databases_clock(pg_settings: Settings, skew: Skew) -> None:
    events = {"events": [{"action": "digest", "at": "2024-05-06T09:00:00Z"}]}
    signal = enqueue_signal("activity", "ann", events, settings=pg_settings)
    with session_scope(pg_settings) as session:
        (claim,) = signal_store.claim_signals(session, lease_seconds=60, limit=1, signal_id=signal.signal_id)
    skew(-timedelta(minutes=10))  # a worker far behind records the failure
    with session_scope(pg_settings) as session:
        signal_store.finish_signal(
            session, claim.signal_id, claim.claim_token, status="failed", retry_after=timedelta(seconds=30)
        )
        available_at = session.scalar(select(Signal.available_at).where(Signal.id == signal.signal_id))
    assert available_at is not None
    assert timedelta(seconds=29) < available_at - database_now(pg_settings) <= timedelta(seconds=30)


def test_a_lease_is_not_taken_early_by_a_worker_ahead(pg_settings: Settings, skew: Skew) -> None:
    minute = timedelta(minutes=1)
    with session_scope(pg_settings) as session:
        assert locks.acquire(session, "ann", "first", minute)
    events = {"events": [{"action": "digest", "at": "2024-05-06T09:00:00Z"}]}
    signal = enqueue_signal("activity", "ann", events, settings=pg_settings)
    with session_scope(pg_settings) as session:
        assert signal_store.claim_signals(session, lease_seconds=60, limit=1, signal_id=signal.signal_id)
    skew(2 * minute)  # both leases look expired to this worker's clock, not to the database's
    with session_scope(pg_settings) as session:
        assert not locks.acquire(session, "ann", "second", minute)
        assert signal_store.claim_signals(session, lease_seconds=60, limit=1) == []
        assert signal_store.bury_exhausted(session, max_attempts=1) == []


def test_a_lease_renewed_by_a_worker_behind_lasts_its_length(pg_settings: Settings, skew: Skew) -> None:
    minute = timedelta(minutes=1)
    skew(-10 * minute)
    with session_scope(pg_settings) as session:
        assert locks.acquire(session, "ann", "mine", minute)
        assert locks.renew(session, "ann", "mine", minute)
        until = session.scalar(select(UserState.locked_until).where(UserState.user_id == "ann"))
    assert until is not None and until > database_now(pg_settings)


def test_a_change_after_a_dispatch_is_dispatched_again(pg_settings: Settings, skew: Skew) -> None:
    dispatched = database_now(pg_settings)
    with session_scope(pg_settings) as session:
        session.execute(
            insert(UserState).values(
                user_id="ann", next_dream_at=dispatched + timedelta(days=1), dispatched_at=dispatched
            )
        )
    skew(-timedelta(seconds=5))  # a signal's worker, behind, notes the change
    with session_scope(pg_settings) as session:
        schedule.mark_dirty(session, pg_settings, "ann")
    with session_scope(pg_settings) as session:
        due = dispatch_store.claim_due_users(
            session,
            at=database_now(pg_settings),
            limit=10,
            interval_seconds=86400,
            dirty_delay_seconds=0,
            lease_seconds=3600,
        )
    assert due == ["ann"]


@pytest.mark.parametrize("days", [-1, 1])
def test_the_days_budget_is_the_databases_day(pg_settings: Settings, skew: Skew, days: int) -> None:
    skew(timedelta(days=days))
    lines = worker.budget.lines_for(pg_settings, None, None)
    assert [(line.scope, line.key) for line in lines] == [("day", database_now(pg_settings).date().isoformat())]


def test_a_host_write_after_a_restore_by_a_worker_ahead_makes_the_row_one_like_any_other(
    pg_settings: Settings, skew: Skew
) -> None:
    # A restored summary's originals are left alone while they hold what was put back;
    # the restore's time is the database's, so a host's write just after it (its
    # ``updated_at`` from the database's clock) frees them, however far ahead the
    # restoring worker's clock runs.
    from store.archive import restore_run
    from store.memories import table_for
    from tasks.dream import dream_user
    from tests.dream_seed import entry, seed

    settings = pg_settings.model_copy(update={"prune_stale_after_days": 3650})
    seed(settings, [entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)])
    outcome = dream_user(settings, "u1")
    assert outcome.entries_summarized == 5 and outcome.run_id is not None
    skew(timedelta(hours=1))
    with session_scope(settings) as session:
        assert restore_run(session, table_for(settings), outcome.run_id).restored == 5
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(table.update().where(table.c.user_id == "u1").values(updated_at=text("timezone('utc', now())")))
    assert dream_user(settings, "u1").entries_summarized == 5
