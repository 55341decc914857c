"""activity: events accumulate; the daily job turns routines into context entries."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from store.db import session_scope
from store.memories import table_for
from store.models import ActivityEvent
from tasks.activity import detect_routines, routines_for
from tasks.signals import process_pending
from worker.producer import enqueue_signal
from worker.settings import Settings

MONDAY = datetime(2024, 5, 6, 9, 5)  # a Monday


def entries(settings: Settings) -> list[tuple[str, str, str, str | None]]:
    table = table_for(settings)
    with session_scope(settings) as session:
        rows = session.execute(select(table).order_by(table.c.key)).all()
    return [(r.key, r.value, r.category, r.source_agent_id) for r in rows]


def send(settings: Settings, user: str, times: list[datetime], action: str = "weekly digest") -> None:
    events = [{"action": action, "at": t.isoformat() + "Z"} for t in times]
    enqueue_signal("activity", user, {"agent_id": "planner", "events": events}, settings=settings)


def test_events_accumulate_without_model_or_writes(store_settings: Settings) -> None:
    send(store_settings, "u1", [MONDAY, MONDAY + timedelta(days=1)])
    report = process_pending(store_settings)
    assert report.processed == 1 and report.results[0].decisions == []
    with session_scope(store_settings) as session:
        rows = session.scalars(select(ActivityEvent)).all()
        assert [(r.user_id, r.agent_id, r.action) for r in rows] == [("u1", "planner", "weekly digest")] * 2
    assert entries(store_settings) == []


def test_weekly_routine_after_three_weeks_not_after_two(store_settings: Settings) -> None:
    weeks = [MONDAY + timedelta(weeks=w, minutes=m) for w, m in ((0, 0), (1, 20), (2, -10))]
    send(store_settings, "u1", weeks[:2])
    process_pending(store_settings)
    assert detect_routines(store_settings, at=weeks[1] + timedelta(days=1)) == 0
    assert entries(store_settings) == []
    send(store_settings, "u1", weeks[2:])
    process_pending(store_settings)
    assert detect_routines(store_settings, at=weeks[2] + timedelta(days=1)) == 1
    assert entries(store_settings) == [
        ("routine_weekly_digest_monday", "does 'weekly digest' on Mondays around 09:05 UTC", "context", "planner")
    ]
    # The daily job is idempotent.
    assert detect_routines(store_settings, at=weeks[2] + timedelta(days=2)) == 0


def test_outside_the_window_is_no_routine(pg_settings: Settings) -> None:
    times = [MONDAY, MONDAY + timedelta(weeks=1, hours=2), MONDAY + timedelta(weeks=2, hours=4)]
    send(pg_settings, "u1", times)
    process_pending(pg_settings)
    assert detect_routines(pg_settings, at=MONDAY + timedelta(weeks=3)) == 0


def test_daily_habit(pg_settings: Settings) -> None:
    days = [datetime(2024, 5, 6, 7, 50) + timedelta(days=d, minutes=5 * d) for d in range(6)]
    send(pg_settings, "u1", days, action="check calendar")
    process_pending(pg_settings)
    assert detect_routines(pg_settings, at=days[-1] + timedelta(hours=1)) == 1
    assert entries(pg_settings) == [
        ("habit_check_calendar", "does 'check calendar' daily around 08:05 UTC", "context", "planner")
    ]


def test_thresholds_are_settings(make_settings: Any) -> None:
    settings = make_settings(routine_min_weeks=2, routine_window_minutes=30)
    assert [r.key for r in routines_for("run", [MONDAY, MONDAY + timedelta(weeks=1, minutes=25)], settings)] == [
        "routine_run_monday"
    ]
    assert routines_for("run", [MONDAY, MONDAY + timedelta(weeks=1, minutes=45)], settings) == []


def test_old_events_are_forgotten(pg_settings: Settings) -> None:
    send(pg_settings, "u1", [MONDAY])
    process_pending(pg_settings)
    detect_routines(pg_settings, at=MONDAY + timedelta(weeks=20))
    with session_scope(pg_settings) as session:
        assert session.scalars(select(ActivityEvent)).all() == []
