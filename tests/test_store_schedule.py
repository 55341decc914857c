"""The schedule's set-based writes, on PostgreSQL and SQLite alike."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import insert, select

from store import dispatch, runs, schedule
from store.db import session_scope
from store.dispatch import next_slot
from store.models import Run, UserState
from store.types import now
from worker.settings import Settings


def test_a_dream_clears_only_the_changes_it_saw_and_schedules_the_next(store_settings: Settings) -> None:
    at = now().replace(microsecond=0)
    with session_scope(store_settings) as session:
        session.execute(
            insert(UserState),
            [
                {"user_id": "seen", "next_dream_at": at, "dirty_since": at - timedelta(minutes=5)},
                {"user_id": "changed-meanwhile", "next_dream_at": at, "dirty_since": at + timedelta(seconds=3)},
            ],
        )
    next_at = schedule.next_dreams(["seen", "changed-meanwhile", "new"], at, timedelta(hours=24))
    with session_scope(store_settings) as session:
        schedule.mark_dreamed_many(session, next_at, at)
    with session_scope(store_settings) as session:
        states = {s.user_id: s for s in session.scalars(select(UserState))}
        got = {u: (s.last_dream_at, s.next_dream_at, s.dirty_since) for u, s in states.items()}
    assert got == {
        "seen": (at, next_at["seen"], None),
        "changed-meanwhile": (at, next_at["changed-meanwhile"], at + timedelta(seconds=3)),
        "new": (at, next_at["new"], None),
    }


def test_users_dreamed_together_are_due_again_each_at_their_own_phase(store_settings: Settings) -> None:
    # A pass over every user (``reverie run --all``, a chunk) must not make them all due
    # again at one instant a day later: each keeps the phase the dispatcher gives them.
    from tasks.dream import dream_users
    from tests.dream_seed import entry, seed

    users = [f"user-{i:02d}" for i in range(40)]
    seed(store_settings, [entry(user, "home_city", "Lisbon") for user in users])
    started = now()
    assert {o.status for o in dream_users(store_settings, users)} == {"succeeded"}
    with session_scope(store_settings) as session:
        due = {s.user_id: s.next_dream_at for s in session.scalars(select(UserState))}
    interval = timedelta(hours=store_settings.dream_interval_hours)
    seconds = interval.total_seconds()
    for user in users:
        # Between half and one and a half intervals away, on the user's own phase.
        assert started + interval / 2 - timedelta(seconds=5) <= due[user] <= now() + interval * 1.5, user
        offset = (due[user] - dispatch.EPOCH).total_seconds() % seconds
        assert abs(offset - dispatch.phase_seconds(user, seconds)) < 0.01, user
    # Spread over the interval, not bunched: 40 users fall in more than 12 of its 24 hours.
    assert len({int((d - dispatch.EPOCH).total_seconds() % seconds // 3600) for d in due.values()}) > 12


def test_runs_started_together_get_one_running_row_each(store_settings: Settings) -> None:
    users = [f"r{i}" for i in range(5)]
    with session_scope(store_settings) as session:
        ids = runs.start_runs(session, users, trigger="cron")
    with session_scope(store_settings) as session:
        found = {r.id: r for r in session.scalars(select(Run))}
    assert sorted(ids) == users and set(ids.values()) == set(found)
    for user, run_id in ids.items():
        run = found[run_id]
        assert (run.user_id, run.status, run.trigger, run.scope) == (user, "running", "cron", "user")


def test_marking_many_users_dirty_keeps_each_ones_earliest_change(store_settings: Settings) -> None:
    at = now().replace(microsecond=0)
    earlier = at - timedelta(hours=2)
    with session_scope(store_settings) as session:
        session.execute(
            insert(UserState),
            [
                {"user_id": "dirty", "next_dream_at": at + timedelta(hours=5), "dirty_since": earlier},
                {"user_id": "clean", "next_dream_at": at + timedelta(hours=5), "dirty_since": None},
            ],
        )
    with session_scope(store_settings) as session:
        schedule.mark_dirty_many(session, store_settings, ["new", "clean", "dirty", "new"], at)
        schedule.mark_dirty_many(session, store_settings, [], at)
    with session_scope(store_settings) as session:
        states = {s.user_id: (s.dirty_since, s.next_dream_at) for s in session.scalars(select(UserState))}
    assert states == {
        "dirty": (earlier, at + timedelta(hours=5)),
        "clean": (at, at + timedelta(hours=5)),
        # A user seen for the first time: due on their own slot, or once the change settles.
        "new": (at, next_slot("new", at, store_settings.dream_interval_hours * 3600)),
    }


def test_a_user_is_known_by_entries_or_a_schedule_row(store_settings: Settings) -> None:
    from tests.dream_seed import entry, seed

    seed(store_settings, [entry("with-rows", "city", "Lisbon"), entry("with-rows", "pet", "cat")])
    with session_scope(store_settings) as session:
        session.execute(insert(UserState), [{"user_id": "pruned-empty", "next_dream_at": now()}])
    with session_scope(store_settings) as session:
        known = schedule.known_user_ids(
            session, store_settings, ["with-rows", "pruned-empty", "nobody", "with-rows", "Nobody"]
        )
    assert known == {"with-rows", "pruned-empty"}


def test_a_change_while_a_run_holds_the_user_outlives_that_runs_end(store_settings: Settings) -> None:
    # Changed at T0 (not dreamed yet), a run starts at T1 and reads the rows; a signal
    # changes the user at T2, before the run ends. The run's end must leave the user
    # changed, or the T2 change waits for the next scheduled dream, a day away.
    from store import locks

    t0 = now().replace(microsecond=0) - timedelta(minutes=10)
    t1, t2 = t0 + timedelta(minutes=5), t0 + timedelta(minutes=6)
    with session_scope(store_settings) as session:
        schedule.mark_dirty_many(session, store_settings, ["held", "free"], at=t0)
    with session_scope(store_settings) as session:
        assert locks.acquire(session, "held", "a-run", timedelta(minutes=30))
    with session_scope(store_settings) as session:
        schedule.mark_dirty_many(session, store_settings, ["held", "free"], at=t2)
    with session_scope(store_settings) as session:
        states = {s.user_id: s.dirty_since for s in session.scalars(select(UserState))}
    # No run holds "free": the delay still counts from its first change.
    assert states == {"held": t2, "free": t0}
    with session_scope(store_settings) as session:
        schedule.mark_dreamed_many(session, schedule.next_dreams(["held"], t2, timedelta(hours=24)), t1)
        locks.release(session, "held", "a-run")
    with session_scope(store_settings) as session:
        assert session.scalar(select(UserState.dirty_since).where(UserState.user_id == "held")) == t2
