"""Beat's dispatcher: who is claimed, when they are next due, and that a claim is
committed before its runs are sent, taken once however many ticks or beats race."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import pytest
from sqlalchemy import insert, select

from schedules import dispatcher
from store import dispatch as dispatch_store
from store import schedule
from store.db import session_scope
from store.memories import table_for
from store.models import UserState
from store.seed import insert_entries
from store.types import now
from worker.errors import BrokerUnavailable
from worker.settings import Settings

HOUR = 3600.0
DAY = 24 * HOUR


def _rows(settings: Settings, rows: list[dict[str, object]]) -> None:
    with session_scope(settings) as session:
        session.execute(insert(UserState), rows)


def _state(settings: Settings) -> dict[str, UserState]:
    with session_scope(settings) as session:
        return {row.user_id: row for row in session.scalars(select(UserState))}


def _claim(settings: Settings, at: datetime, *, limit: int = 1000, delay: float = 300.0) -> list[str]:
    with session_scope(settings) as session:
        return dispatch_store.claim_due_users(
            session, at=at, limit=limit, interval_seconds=DAY, dirty_delay_seconds=delay, lease_seconds=HOUR
        )


def test_claims_exactly_the_due_users_and_holds_them_for_the_dispatch_lease(store_settings: Settings) -> None:
    at = now()
    _rows(
        store_settings,
        [
            {"user_id": "time-due", "next_dream_at": at - timedelta(minutes=1)},
            {"user_id": "not-due", "next_dream_at": at + timedelta(hours=3)},
            {
                "user_id": "dirty-settled",
                "next_dream_at": at + timedelta(hours=3),
                "dirty_since": at - timedelta(minutes=6),
            },
            {
                "user_id": "dirty-fresh",
                "next_dream_at": at + timedelta(hours=3),
                "dirty_since": at - timedelta(minutes=1),
            },
            # Sent a run after the change: that run will clear them; not again.
            {
                "user_id": "dirty-in-flight",
                "next_dream_at": at + timedelta(hours=3),
                "dirty_since": at - timedelta(minutes=30),
                "dispatched_at": at - timedelta(minutes=10),
            },
            # The run sent after the change never cleared them, and the lease ran out.
            {
                "user_id": "dirty-lost-run",
                "next_dream_at": at + timedelta(hours=3),
                "dirty_since": at - timedelta(hours=3),
                "dispatched_at": at - timedelta(hours=2),
            },
            # Changed again after the last run was sent.
            {
                "user_id": "dirty-again",
                "next_dream_at": at + timedelta(hours=3),
                "dirty_since": at - timedelta(minutes=20),
                "dispatched_at": at - timedelta(minutes=40),
            },
        ],
    )

    claimed = _claim(store_settings, at)

    assert sorted(claimed) == ["dirty-again", "dirty-lost-run", "dirty-settled", "time-due"]
    state = _state(store_settings)
    for user_id in claimed:
        assert state[user_id].dispatched_at == at
        # Due again when the lease ends, unless the run that was sent moves them on.
        assert state[user_id].next_dream_at == at + timedelta(seconds=HOUR)
    assert state["not-due"].dispatched_at is None
    assert state["dirty-fresh"].dispatched_at is None
    # A claim never clears dirty_since: only the finished dream does.
    assert state["dirty-settled"].dirty_since is not None


def test_a_second_tick_claims_nobody_again(store_settings: Settings) -> None:
    at = now()
    _rows(store_settings, [{"user_id": f"u{i}", "next_dream_at": at - timedelta(seconds=i)} for i in range(50)])

    first = _claim(store_settings, at)
    second = _claim(store_settings, at + timedelta(seconds=5))

    assert len(first) == 50
    assert second == []


def test_limit_takes_the_most_overdue_first(store_settings: Settings) -> None:
    at = now()
    _rows(store_settings, [{"user_id": f"u{i:02d}", "next_dream_at": at - timedelta(minutes=i)} for i in range(30)])

    claimed = _claim(store_settings, at, limit=10)

    assert sorted(claimed) == [f"u{i:02d}" for i in range(20, 30)]


def test_a_dream_finished_after_the_claim_is_not_claimed_again(store_settings: Settings) -> None:
    at = now()
    _rows(store_settings, [{"user_id": "u", "next_dream_at": at, "dirty_since": at - timedelta(hours=1)}])
    assert _claim(store_settings, at) == ["u"]
    with session_scope(store_settings) as session:
        schedule.mark_dreamed(session, "u", at + timedelta(seconds=1), at + timedelta(hours=24))

    assert _claim(store_settings, at + timedelta(hours=2)) == []


def test_a_run_that_never_ran_is_dispatched_again_when_the_lease_ends(store_settings: Settings) -> None:
    """A dispatched run whose message was lost (the broker restarted, or the worker
    died after taking it) leaves the user due again once the dispatch lease ends,
    whether they were due by time or because something changed."""
    at = now()
    _rows(
        store_settings,
        [
            {"user_id": "timed", "next_dream_at": at - timedelta(minutes=1)},
            {"user_id": "dirty", "next_dream_at": at + timedelta(hours=3), "dirty_since": at - timedelta(hours=1)},
            {"user_id": "ran", "next_dream_at": at - timedelta(minutes=1)},
        ],
    )
    assert sorted(_claim(store_settings, at)) == ["dirty", "ran", "timed"]
    with session_scope(store_settings) as session:
        # Only one of the runs sent was received and finished.
        schedule.mark_dreamed(session, "ran", at + timedelta(seconds=5), at + timedelta(hours=24))

    assert _claim(store_settings, at + timedelta(seconds=HOUR - 1)) == []
    assert sorted(_claim(store_settings, at + timedelta(seconds=HOUR + 1))) == ["dirty", "timed"]


def test_the_slot_comes_first_when_it_is_sooner_than_the_lease(store_settings: Settings) -> None:
    at = now()
    _rows(store_settings, [{"user_id": "u", "next_dream_at": at - timedelta(minutes=1)}])
    with session_scope(store_settings) as session:
        dispatch_store.claim_due_users(
            session, at=at, limit=10, interval_seconds=600.0, dirty_delay_seconds=0, lease_seconds=3600
        )
    expected = dispatch_store.next_slot("u", at, 600.0)
    # SQL and Python compute the slot the same way (to float rounding).
    assert abs((_state(store_settings)["u"].next_dream_at - expected).total_seconds()) < 0.01


def test_claimed_set_agrees_with_the_cron_pass(store_settings: Settings) -> None:
    at = now()
    _rows(
        store_settings,
        [
            {"user_id": "a", "next_dream_at": at - timedelta(hours=1)},
            {"user_id": "b", "next_dream_at": at + timedelta(hours=1)},
            {"user_id": "c", "next_dream_at": at + timedelta(hours=1), "dirty_since": at - timedelta(seconds=1)},
            {"user_id": "d", "next_dream_at": at},
        ],
    )
    with session_scope(store_settings) as session:
        cron_due = schedule.due_user_ids(session, at, 100)

    # With no settling delay and nothing in flight, "due" means the same to both.
    assert sorted(_claim(store_settings, at, delay=0)) == sorted(cron_due) == ["a", "c", "d"]


def test_concurrent_claims_on_postgresql_never_share_a_user(pg_settings: Settings) -> None:
    at = now()
    _rows(pg_settings, [{"user_id": f"u{i:03d}", "next_dream_at": at - timedelta(seconds=i)} for i in range(100)])

    # The first claim holds its row locks (uncommitted) while the second runs.
    with session_scope(pg_settings) as first:
        held = dispatch_store.claim_due_users(
            first, at=at, limit=60, interval_seconds=DAY, dirty_delay_seconds=0, lease_seconds=HOUR
        )
        other = _claim(pg_settings, at)
        assert len(held) == 60
        assert len(other) == 40
        assert not set(held) & set(other)
    assert _claim(pg_settings, at) == []


def test_dispatch_sends_chunks_only_after_the_claim_is_committed(make_settings: object) -> None:
    settings: Settings = make_settings(dispatch_chunk_size=40)  # type: ignore[operator]
    at = now()
    _rows(settings, [{"user_id": f"u{i:03d}", "next_dream_at": at - timedelta(seconds=1)} for i in range(100)])
    chunks: list[list[str]] = []

    def send(chunk: list[str]) -> None:
        # Another connection already sees the claim: the transaction has committed.
        visible = _state(settings)
        assert all(visible[user_id].dispatched_at == at for user_id in chunk)
        chunks.append(chunk)

    result = dispatcher.dispatch(settings, send, at=at)

    assert [len(chunk) for chunk in chunks] == [40, 40, 20]
    assert sorted(user for chunk in chunks for user in chunk) == [f"u{i:03d}" for i in range(100)]
    assert result == dispatcher.DispatchResult(claimed=100, sent=100, released=0, chunks=3)


def test_runs_that_cannot_be_sent_are_released_for_the_next_tick(make_settings: object) -> None:
    settings: Settings = make_settings(dispatch_chunk_size=10)  # type: ignore[operator]
    at = now()
    _rows(settings, [{"user_id": f"u{i:02d}", "next_dream_at": at - timedelta(seconds=1)} for i in range(30)])
    sent: list[list[str]] = []

    def send(chunk: list[str]) -> None:
        if sent:
            raise BrokerUnavailable("connection refused")
        sent.append(chunk)

    result = dispatcher.dispatch(settings, send, at=at)

    assert result.sent == 10
    assert result.released == 20
    again = dispatcher.claim(settings, at=at + timedelta(seconds=5))
    assert sorted(again) == [f"u{i:02d}" for i in range(10, 30)]


def test_slots_spread_users_over_the_interval() -> None:
    at = datetime(2025, 3, 1, 12, 0, 0)
    slots = [dispatch_store.next_slot(f"user-{i}", at, DAY) for i in range(2400)]
    per_hour = Counter(slot.hour for slot in slots)

    assert len(per_hour) == 24
    assert max(per_hour.values()) < 2 * min(per_hour.values())
    # Stable: a user's slot keeps its phase from one day to the next.
    later = dispatch_store.next_slot("user-7", slots[7], DAY)
    assert later - slots[7] == timedelta(days=1)


def test_adopt_schedules_memory_users_without_a_schedule_row(store_settings: Settings) -> None:
    at = now()
    _rows(store_settings, [{"user_id": "known", "next_dream_at": at + timedelta(hours=5)}])
    with session_scope(store_settings) as session:
        insert_entries(
            session,
            table_for(store_settings),
            [
                {"user_id": "known", "key": "k", "value": "v"},
                {"user_id": "fresh", "key": "k1", "value": "v"},
                {"user_id": "fresh", "key": "k2", "value": "v"},
            ],
        )

    assert dispatcher.adopt(store_settings, at=at) == 1
    assert dispatcher.adopt(store_settings, at=at) == 0
    state = _state(store_settings)
    if store_settings.is_sqlite:
        assert state["fresh"].next_dream_at == at
    else:
        # Due at the user's own phase within the next interval.
        interval = timedelta(hours=store_settings.dream_interval_hours)
        assert at <= state["fresh"].next_dream_at < at + interval
    assert state["known"].next_dream_at == at + timedelta(hours=5)


def test_adopting_many_existing_users_spreads_their_first_runs(pg_settings: Settings) -> None:
    """A database full of users is scheduled at once, but not made due in one minute:
    each user's first run is at their own phase within the next dream interval."""
    at = now()
    users = [f"user-{n:05d}" for n in range(3000)]
    with session_scope(pg_settings) as session:
        insert_entries(session, table_for(pg_settings), [{"user_id": u, "key": "k", "value": "v"} for u in users])
    assert dispatcher.adopt(pg_settings, at=at) == len(users)
    state = _state(pg_settings)
    assert sorted(state) == users
    interval = timedelta(hours=pg_settings.dream_interval_hours)
    due = [state[u].next_dream_at for u in users]
    assert all(at <= t < at + interval for t in due)
    per_hour = Counter(int((t - at).total_seconds() // 3600) for t in due)
    # 3,000 users over 24 hours: about 125 an hour; none of the hours holds a crowd.
    assert len(per_hour) == 24
    assert max(per_hour.values()) < 3 * len(users) / 24
    # Nobody is due right away in bulk: the first minute holds a handful at most.
    assert sum(1 for t in due if t < at + timedelta(minutes=1)) < 20
    # The slots agree with the dispatcher's own phase, so later claims keep the spread.
    for u in users[:50]:
        phase = dispatch_store.phase_seconds(u, interval.total_seconds())
        offset = (state[u].next_dream_at - dispatch_store.EPOCH).total_seconds() % interval.total_seconds()
        assert abs(offset - phase) < 1e-3 or abs(abs(offset - phase) - interval.total_seconds()) < 1e-3


def test_migrate_schedules_the_users_already_there(pg_settings: Settings) -> None:
    """``reverie migrate`` run as a process on a database that already holds users:
    they are scheduled at once, not an adoption interval after beat starts."""
    import os
    import subprocess
    import sys

    with session_scope(pg_settings) as session:
        insert_entries(
            session, table_for(pg_settings), [{"user_id": f"old-{n}", "key": "k", "value": "v"} for n in range(7)]
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env["REVERIE_DATABASE_URL"] = pg_settings.database_url
    result = subprocess.run(
        [sys.executable, "-c", "from worker.cli import main; main()", "migrate"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "scheduled 7 existing user(s)" in result.stdout
    assert sorted(_state(pg_settings)) == [f"old-{n}" for n in range(7)]


@pytest.mark.parametrize("interval_hours", [1.0, 24.0, 168.0])
def test_next_slot_is_between_half_and_one_and_a_half_intervals_ahead(interval_hours: float) -> None:
    interval = interval_hours * HOUR
    at = datetime(2025, 6, 1, 8, 30, 15)
    for i in range(200):
        slot = dispatch_store.next_slot(f"user-{i}", at, interval)
        ahead = (slot - at).total_seconds()
        assert interval / 2 <= ahead < 1.5 * interval + 1e-3


def test_the_dispatcher_benchmark_runs_in_its_quick_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import dispatcher_tick

    assert dispatcher_tick.main(["--quick"]) == 0

    out = capsys.readouterr().out
    assert "Update on dream_user_state" in out
    assert "| P3 " in out


def test_a_claim_whose_reply_was_lost_is_undone_and_the_next_tick_claims_the_users(pg_settings: Settings) -> None:
    # Before: the users waited out the dispatch lease (an hour by default), claimed by
    # a tick that sent nobody.
    from tests.lost_replies import lose_the_reply_of
    from worker.errors import DatabaseUnavailable

    at = now()
    _rows(pg_settings, [{"user_id": f"lost-{i}", "next_dream_at": at - timedelta(minutes=i + 1)} for i in range(3)])
    _rows(pg_settings, [{"user_id": "claimed-before", "next_dream_at": at + timedelta(hours=1), "dispatched_at": at}])
    sent: list[list[str]] = []
    with pytest.MonkeyPatch.context() as patch:
        lost = lose_the_reply_of(patch, dispatcher.dispatch_store, "claim_due_users")
        with pytest.raises(DatabaseUnavailable):
            dispatcher.dispatch(pg_settings, sent.append)
    assert [len(claimed) for claimed in lost] == [3] and sent == []
    # The next tick claims and sends them at once; the other claim is left alone.
    result = dispatcher.dispatch(pg_settings, sent.append)
    assert result.claimed == 3
    assert sorted(u for chunk in sent for u in chunk) == ["lost-0", "lost-1", "lost-2"]
    assert _state(pg_settings)["claimed-before"].dispatched_at == at
