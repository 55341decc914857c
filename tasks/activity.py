"""``activity``: events accumulate; a daily job finds routines in them. No model call.

A weekly routine is the same action on the same weekday within
``routine_window_minutes`` on at least ``routine_min_weeks`` distinct weeks ("runs the
weekly digest on Mondays around 09:00 UTC"). A daily habit is the same action within
that window on at least ``habit_min_days`` distinct days spread over at least
``min(habit_min_days, 5)`` weekdays (so a working-day habit counts). Both become
``context`` entries. Times are UTC; a window does not wrap around midnight.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from store import activity as activity_store
from store import schedule
from store.db import retrying_conflicts, session_scope
from store.memories import table_for, upsert_entry
from store.types import now
from tasks.decisions import Effect, SignalInput
from worker import metrics
from worker.offline_rules import snake_case
from worker.payloads import parse_timestamp
from worker.settings import Settings

SOURCE = "activity"
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
#: Events older than this many weeks (or routine_min_weeks + 1, if larger) are forgotten.
LOOKBACK_WEEKS = 8


@dataclass(frozen=True)
class Routine:
    key: str
    value: str


def prepare(settings: Settings, signal: SignalInput) -> list[dict[str, Any]]:
    """The signal's events as rows for ``dream_activity`` (timestamps as naive UTC)."""
    agent = signal.agent_id or signal.payload.get("agent_id") or ""
    return [
        {
            "user_id": signal.user_id,
            "agent_id": agent,
            "action": event["action"],
            "at": parse_timestamp(f"payload.events[{i}].at", event["at"]),
            "attributes": event.get("attributes"),
            "signal_id": signal.signal_id,
        }
        for i, event in enumerate(signal.payload["events"])
    ]


def apply(session: Session, settings: Settings, signal: SignalInput, rows: list[dict[str, Any]]) -> Effect:
    """Store the events; routines are found later by :func:`detect_routines`."""
    activity_store.add_events(session, rows)
    return Effect(SOURCE)


def apply_many(
    session: Session, settings: Settings, batch: list[tuple[SignalInput, list[dict[str, Any]]]]
) -> list[Effect]:
    """:func:`apply` for many signals: all their events in one statement."""
    activity_store.add_events(session, [row for _signal, rows in batch for row in rows])
    return [Effect(SOURCE) for _ in batch]


def lookback(settings: Settings) -> timedelta:
    return timedelta(weeks=max(LOOKBACK_WEEKS, settings.routine_min_weeks + 1))


def detect_routines(settings: Settings, *, at: datetime | None = None) -> int:
    """The daily job: write every routine and habit found as a ``context`` entry.

    Looks at events in the look-back before ``at`` (default now) and forgets older
    ones. Returns the number of entries inserted or updated (unchanged ones do not
    count).
    """
    when = at or now()
    # Forgotten in a transaction of its own: it locks old events of every user, and
    # an erasure takes a user's erasure lock before deleting theirs, the reverse of the
    # detection's order (which takes that lock before writing the user's routines).
    retrying_conflicts(partial(_forget_before, settings, when - lookback(settings)))
    with session_scope(settings) as session:
        writes = find_routines(session, settings, when)
    for action, count in writes.items():
        metrics.MEMORY_WRITES.labels(source=SOURCE, action=action).inc(count)
    return sum(writes.values())


def _forget_before(settings: Settings, cutoff: datetime) -> None:
    # Run again if the database rolls it back as a deadlock's victim: an erasure deletes
    # a user's events in another order than this statement's plan may.
    with session_scope(settings) as session:
        activity_store.delete_before(session, cutoff)


def find_routines(session: Session, settings: Settings, at: datetime) -> Counter[str]:
    """Detect and upsert routines inside the caller's transaction; writes by action."""
    since = at - lookback(settings)
    table = table_for(settings)
    writes: Counter[str] = Counter()
    dirty: set[str] = set()
    events = activity_store.events_since(session, since)
    groups = itertools.groupby(events, key=lambda e: (e[0], e[1], e[2]))
    found: list[tuple[str, str, Routine]] = []
    # One event read per user: still there when the user is written, unless erased since.
    read: dict[str, int] = {}
    for (user_id, agent_id, action), rows in groups:
        listed = list(rows)
        read.setdefault(user_id, listed[0][4])
        times = [row[3] for row in listed if row[3] <= at]
        found.extend((user_id, agent_id, routine) for routine in routines_for(action, times, settings))
    writable: dict[str, bool] = {}
    for user_id, agent_id, routine in found:
        if user_id not in writable:
            writable[user_id] = activity_store.hold_for_routines(session, user_id, read[user_id])
        if not writable[user_id]:
            continue
        result = upsert_entry(
            session,
            table,
            user_id=user_id,
            key=routine.key,
            value=routine.value,
            category="context",
            source=SOURCE,
            source_agent_id=agent_id or None,
            protected_categories=settings.protected_category_set,
        )
        if result.action in ("insert", "update"):
            writes[result.action] += 1
            dirty.add(user_id)
    for user_id in sorted(dirty):
        schedule.mark_dirty(session, settings, user_id)
    return writes


def routines_for(action: str, times: list[datetime], settings: Settings) -> list[Routine]:
    """The habit and weekly routines in one action's event times (pure)."""
    window = settings.routine_window_minutes
    slug = snake_case(action)[:60] or "action"
    out: list[Routine] = []
    needed_weekdays = min(settings.habit_min_days, 5)
    habit = _best_window(times, window, score=lambda ts: len({t.date() for t in ts}))
    habit_start: int | None = None
    if (
        habit
        and len({t.date() for t in habit}) >= settings.habit_min_days
        and len({t.weekday() for t in habit}) >= needed_weekdays
    ):
        habit_start = min(_minute(t) for t in habit)
        out.append(Routine(f"habit_{slug}", f"does {action!r} daily around {_clock(habit)} UTC"))
    for weekday in range(7):
        day = [
            t
            for t in times
            if t.weekday() == weekday and (habit_start is None or not habit_start <= _minute(t) <= habit_start + window)
        ]
        best = _best_window(day, window, score=lambda ts: len({_week(t) for t in ts}))
        if best and len({_week(t) for t in best}) >= settings.routine_min_weeks:
            name = WEEKDAYS[weekday]
            out.append(
                Routine(f"routine_{slug}_{name.lower()}", f"does {action!r} on {name}s around {_clock(best)} UTC")
            )
    return out


def _minute(t: datetime) -> int:
    return t.hour * 60 + t.minute


def _week(t: datetime) -> tuple[int, int]:
    iso = t.isocalendar()
    return iso.year, iso.week


def _best_window(times: Iterable[datetime], window: int, *, score: Callable[[list[datetime]], int]) -> list[datetime]:
    """The events inside the time-of-day window (of ``window`` minutes) that scores best."""
    ordered = sorted(times, key=_minute)
    best: list[datetime] = []
    best_score = 0
    end = 0
    for start, first in enumerate(ordered):
        end = max(end, start)
        while end < len(ordered) and _minute(ordered[end]) - _minute(first) <= window:
            end += 1
        members = ordered[start:end]
        value = score(members)
        if value > best_score:
            best, best_score = members, value
    return best


def _clock(times: list[datetime]) -> str:
    minutes = sorted(_minute(t) for t in times)
    median = minutes[len(minutes) // 2]
    rounded = min(5 * round(median / 5), 23 * 60 + 55)
    return f"{rounded // 60:02d}:{rounded % 60:02d}"
