"""A host's times that Python cannot hold (PostgreSQL's ``infinity`` and ``-infinity``,
the year 10000, dates BC) stop no work on the user who has them: signals, summaries,
contradictions and the host's last-access column alike; and a time Python does hold,
however early (``0001-01-01``, Go's zero time), is read as it is (real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text as sql_text

from store.db import dispose_engines, session_scope
from tasks import dream
from tasks.signals import process_pending
from tests.dream_seed import entry, seed
from worker.producer import enqueue_signal
from worker.settings import Settings


def test_a_signal_for_a_user_with_an_infinite_time_is_processed(pg_settings: Settings) -> None:
    seed(pg_settings, [entry("alice", "home_city", "Lisbon", agent="agent-a")])
    with session_scope(pg_settings) as session:
        session.execute(sql_text("UPDATE usermemories SET updated_at = 'infinity'"))
    said = {
        "conversation_id": "c1",
        "agent_id": "agent-a",
        "messages": [{"role": "user", "content": "I live in Porto."}],
    }
    enqueue_signal("session_end", "alice", said, settings=pg_settings)
    report = process_pending(pg_settings)
    assert (report.processed, report.failed) == (1, 0)


def _notes(user_id: str) -> list[dict[str, Any]]:
    return [entry(user_id, f"note_{i}", f"fact number {i}", category="context") for i in range(6)]


@pytest.mark.parametrize("stamp", ["-infinity", "0044-03-15 BC"])
def test_a_group_with_a_time_before_the_year_one_is_summarized(pg_settings: Settings, stamp: str) -> None:
    seed(pg_settings, _notes("u1") + _notes("u2"))
    with session_scope(pg_settings) as session:
        session.execute(
            sql_text("UPDATE usermemories SET created_at = CAST(:t AS timestamp) WHERE key = 'note_0'"), {"t": stamp}
        )
    outcomes = dream.dream_users(pg_settings, ["u1", "u2"])
    assert [(o.status, o.entries_summarized) for o in outcomes] == [("succeeded", 6), ("succeeded", 6)]
    assert dream.dream_user(pg_settings, "u1").status == "succeeded"


@pytest.mark.parametrize("stamp", ["0001-01-01 00:00:00", "-infinity", "infinity"])
@pytest.mark.parametrize("many", [False, True], ids=["one-user", "chunk"])
def test_keep_newest_removes_a_loser_with_an_edge_time(pg_settings: Settings, stamp: str, many: bool) -> None:
    # The removal checks the row is as it was read: a time read as NULL (or moved into
    # Python's range) never compared equal, and the loser stayed, flagged every pass.
    settings = pg_settings.model_copy(
        update={"summarize_interactions": False, "contradiction_resolution": "keep_newest"}
    )
    older, newer = seed(
        settings,
        [
            entry("u1", "city", "Berlin", agent="a", age_days=10, access_count=1),
            entry("u1", "City", "Paris", agent="b", age_days=1),
        ],
    )
    seed(settings, [entry("u2", "x", "y")])
    loser, winner = (newer, older) if stamp == "infinity" else (older, newer)
    with session_scope(settings) as session:
        session.execute(
            sql_text("UPDATE usermemories SET updated_at = CAST(:t AS timestamp) WHERE id = :i"),
            {"t": stamp, "i": older["id"] if stamp == "infinity" else loser["id"]},
        )
    outcome = dream.dream_users(settings, ["u1", "u2"])[0] if many else dream.dream_user(settings, "u1")
    assert (outcome.status, outcome.contradictions_found, outcome.contradictions_resolved) == ("succeeded", 1, 1)
    with session_scope(settings) as session:
        left = session.execute(sql_text("SELECT id FROM usermemories WHERE user_id = 'u1'")).scalars().all()
    assert left == [winner["id"]]


@pytest.fixture()
def last_access_settings(pg_settings: Settings) -> Iterator[Settings]:
    with session_scope(pg_settings) as session:
        session.execute(sql_text("ALTER TABLE usermemories ADD COLUMN last_accessed_at TIMESTAMP"))
    dispose_engines()
    yield pg_settings.model_copy(
        update={"summarize_interactions": False, "memory_last_access_column": "last_accessed_at"}
    )
    with session_scope(pg_settings) as session:
        session.execute(sql_text("DELETE FROM usermemories"))
        session.execute(sql_text("ALTER TABLE usermemories DROP COLUMN last_accessed_at"))
    dispose_engines()


def test_a_last_access_column_saying_never_fails_no_dream(last_access_settings: Settings) -> None:
    settings = last_access_settings
    rows = [
        entry("u1", "home_city", "Lisbon", visibility="global", agent=None),
        entry("u1", "residence_city", "Porto", visibility="global", agent=None),
        entry("u2", "pet", "cat", visibility="global", agent=None),
    ]
    seed(settings, rows)
    with session_scope(settings) as session:
        session.execute(sql_text("UPDATE usermemories SET last_accessed_at = '-infinity'"))
    outcomes = dream.dream_users(settings, ["u1", "u2"])
    assert [(o.status, o.contradictions_found) for o in outcomes] == [("succeeded", 1), ("succeeded", 0)]
    assert dream.dream_user(settings, "u1").status == "succeeded"
