"""Retention: rows past their retention are purged in batches, newer ones kept; a
purged signal still deduplicates (real PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from schedules.beat import beat_schedule
from schedules.cron import run_once
from store.db import session_scope
from store.models import ArchivedEntry, Event, Run, Signal, Spend, UserState
from store.types import now
from tasks.retention import purge_expired
from worker.budget import day_key
from worker.producer import enqueue_signal
from worker.settings import Settings

TRANSCRIPT = {"conversation_id": "c-1", "messages": [{"role": "user", "content": "My favorite color is teal"}]}


def _days_ago(days: float) -> Any:
    return now() - timedelta(days=days)


def seed(settings: Settings) -> dict[str, Any]:
    """One row per kind on each side of its default retention."""
    with session_scope(settings) as session:
        old_run = Run(user_id="u", status="succeeded", started_at=_days_ago(100), finished_at=_days_ago(100))
        kept_run = Run(user_id="u", status="succeeded", started_at=_days_ago(100), finished_at=_days_ago(100))
        new_run = Run(user_id="u", status="succeeded", started_at=_days_ago(5), finished_at=_days_ago(5))
        # A run still under way (another user's: a dream of "u" would close a row of
        # its own left running, see test_dream_run), however old, is never purged. It
        # holds its user's lease, as a live run does (one whose lease lapsed is closed).
        stuck_run = Run(user_id="u-busy", status="running", started_at=_days_ago(100))
        lease = UserState(user_id="u-busy", locked_until=now() + timedelta(hours=1), lock_token="b" * 36)
        session.add_all([old_run, kept_run, new_run, stuck_run, lease])
        session.flush()
        row = {"id": "e1", "key": "k", "value": "v"}
        session.add_all(
            [
                ArchivedEntry(
                    run_id=old_run.id, user_id="u", entry_id="e0", reason="prune", row=row, archived_at=_days_ago(31)
                ),
                # Still inside the restore window: it keeps its (old) run too.
                ArchivedEntry(
                    run_id=kept_run.id, user_id="u", entry_id="e1", reason="prune", row=row, archived_at=_days_ago(29)
                ),
                Event(user_id="u", entry_id="e0", key="k", action="delete", source="prune", at=_days_ago(91)),
                Event(user_id="u", entry_id="e1", key="k", action="delete", source="prune", at=_days_ago(89)),
                Spend(scope="day", scope_key=day_key(_days_ago(91)), limit_nano=10, updated_at=_days_ago(91)),
                Spend(scope="day", scope_key=day_key(_days_ago(89)), limit_nano=10, updated_at=_days_ago(89)),
                Spend(scope="run", scope_key="run-old", limit_nano=10, updated_at=_days_ago(91)),
                # Today's line, however it was last touched, is never reset.
                Spend(scope="day", scope_key=day_key(), limit_nano=10, updated_at=_days_ago(91)),
            ]
        )
        signals = {}
        for name, status, age in (
            ("done_old", "done", 8),
            ("rejected_old", "rejected", 8),
            ("done_new", "done", 6),
            ("dead_old", "dead", 30),
            ("pending_old", "pending", 30),
        ):
            signal = Signal(
                kind="session_end",
                user_id="u",
                payload=TRANSCRIPT,
                idempotency_key=name,
                status=status,
                enqueued_at=_days_ago(age),
                processed_at=_days_ago(age) if status in ("done", "rejected") else None,
            )
            session.add(signal)
            session.flush()
            signals[name] = signal.id
    return {"runs": (old_run.id, kept_run.id, new_run.id, stuck_run.id), "signals": signals}


def state(settings: Settings) -> dict[str, Any]:
    with session_scope(settings) as session:
        return {
            "archive": sorted(session.scalars(select(ArchivedEntry.entry_id))),
            "events": sorted(session.scalars(select(Event.entry_id))),
            "runs": sorted(session.scalars(select(Run.id))),
            "spend": sorted((s.scope, s.scope_key) for s in session.scalars(select(Spend))),
            "payloads": {
                s.idempotency_key: (s.payload, s.payload_purged_at is not None) for s in session.scalars(select(Signal))
            },
        }


def test_rows_past_their_retention_are_purged_and_newer_ones_kept(pg_settings: Settings) -> None:
    seeded = seed(pg_settings)
    report = purge_expired(pg_settings)
    after = state(pg_settings)
    _old_run, kept_run, new_run, stuck_run = seeded["runs"]
    assert after["archive"] == ["e1"]
    assert after["events"] == ["e1"]
    assert after["runs"] == sorted([kept_run, new_run, stuck_run])
    assert after["spend"] == sorted([("day", day_key(_days_ago(89))), ("day", day_key())])
    assert after["payloads"] == {
        "done_old": ({}, True),
        "rejected_old": ({}, True),
        "done_new": (TRANSCRIPT, False),
        "dead_old": (TRANSCRIPT, False),
        "pending_old": (TRANSCRIPT, False),
    }
    assert (report.archive, report.events, report.runs, report.spend, report.signal_payloads) == (1, 1, 1, 2, 2)
    # Nothing left to do: a second purge touches nothing.
    assert purge_expired(pg_settings).total == 0


def test_a_host_clock_ahead_of_the_databases_purges_nothing_early(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows were stamped on the database's clock; a host 40 days ahead (a cron
    host's clock gone wrong) must not empty the restore window."""
    import store.types
    import tasks.retention

    seeded = seed(pg_settings)
    ahead = now() + timedelta(days=40)
    monkeypatch.setattr(store.types, "now", lambda: ahead)
    monkeypatch.setattr(tasks.retention, "now", lambda: ahead, raising=False)
    purge_expired(pg_settings)
    after = state(pg_settings)
    assert after["archive"] == ["e1"] and after["events"] == ["e1"]
    assert seeded["runs"][1] in after["runs"]


def test_purge_works_in_batches_until_nothing_is_left(make_settings: Any) -> None:
    settings = make_settings(purge_batch_size=2)
    with session_scope(settings) as session:
        session.add_all(
            Event(user_id="u", entry_id=f"e{i}", key="k", action="delete", source="prune", at=_days_ago(100 + i))
            for i in range(5)
        )
        session.add(Event(user_id="u", entry_id="new", key="k", action="delete", source="prune", at=_days_ago(1)))
    assert purge_expired(settings).events == 5
    assert state(settings)["events"] == ["new"]


def test_zero_keeps_forever(make_settings: Any) -> None:
    settings = make_settings(
        archive_retention_days=0,
        signal_payload_retention_days=0,
        event_retention_days=0,
        run_retention_days=90,
        spend_retention_days=0,
    )
    seed(settings)
    before = state(settings)
    assert purge_expired(settings).total == 0
    assert state(settings) == before


def test_a_purged_signal_still_deduplicates(store_settings: Settings) -> None:
    first = enqueue_signal("session_end", "ann", TRANSCRIPT, settings=store_settings)
    keyed = enqueue_signal(
        "session_end", "ann", {**TRANSCRIPT, "conversation_id": "c-2"}, idempotency_key="k-2", settings=store_settings
    )
    with session_scope(store_settings) as session:
        for signal in session.scalars(select(Signal)):
            signal.status, signal.processed_at = "done", _days_ago(8)
    assert purge_expired(store_settings).signal_payloads == 2
    again = enqueue_signal("session_end", "ann", TRANSCRIPT, settings=store_settings)
    keyed_again = enqueue_signal(
        "session_end", "ann", {**TRANSCRIPT, "conversation_id": "c-2"}, idempotency_key="k-2", settings=store_settings
    )
    assert (again.signal_id, again.created) == (first.signal_id, False)
    assert (keyed_again.signal_id, keyed_again.created) == (keyed.signal_id, False)
    with session_scope(store_settings) as session:
        rows = session.execute(select(Signal.status, Signal.payload)).all()
    assert sorted(tuple(r) for r in rows) == [("done", {}), ("done", {})]


def test_cron_pass_and_beat_both_purge(pg_settings: Settings) -> None:
    seed(pg_settings)
    report = run_once(pg_settings)
    assert report.rows_purged == 7
    assert state(pg_settings)["archive"] == ["e1"]
    entry = beat_schedule(pg_settings, signals_queue="signals")["purge-expired"]
    assert (entry["task"], entry["schedule"]) == ("retention.purge", pg_settings.purge_interval_seconds)


def test_every_purge_statement_finds_its_rows_through_an_index(pg_settings: Settings) -> None:
    from sqlalchemy import event

    from store.db import get_engine

    seed(pg_settings)
    engine = get_engine(pg_settings)
    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith(("DELETE", "UPDATE", "SELECT")) and "dream_" in statement:
            statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        purge_expired(pg_settings)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    assert {word for s, _ in statements for word in s.split() if word.startswith("dream_")} >= {
        "dream_archive",
        "dream_signals",
        "dream_events",
        "dream_runs",
        "dream_spend",
    }
    # With sequential scans priced out, a plan still shows one only where no index fits;
    # and the age condition itself must be an index condition, not a filter over all rows.
    ages = {
        "dream_archive": "archived_at",
        "dream_signals": "processed_at",
        "dream_events": "at",
        "dream_runs": "started_at",
        "dream_spend": "updated_at",
    }
    checked = set()
    with engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        for statement, parameters in statements:
            plan = [row[0] for row in conn.exec_driver_sql("EXPLAIN " + statement, parameters)]
            assert not any("Seq Scan" in line for line in plan), (statement, plan)
            for table, column in ages.items():
                # Every batch takes the oldest rows first: ORDER BY the age column.
                if f"ORDER BY {table}.{column}" in statement:
                    conditions = [line for line in plan if "Index Cond" in line and f"({column} < " in line]
                    assert conditions, (statement, plan)
                    checked.add(table)
        conn.rollback()
    assert checked == set(ages)
