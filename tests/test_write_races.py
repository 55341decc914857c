"""Races between Reverie's writes and the application's, on the real PostgreSQL.

- ``keep_newest`` deletes an older row only while it still holds what the decision was
  based on: a row the application updates while the resolution's DELETE waits for its
  row lock survives, with the application's value.
- Two writers of one (user, key) with no owning agent end as one row: EDDI's unique
  index cannot see NULL agents as equal, so Reverie serializes those writes itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

from store.db import session_scope
from store.memories import table_for, upsert_entry
from store.models import ArchivedEntry, Event
from tasks.dream import dream_user, dream_users
from tests.dream_seed import entries_of, entry, seed
from worker.settings import Settings

UPDATES = {
    "value-and-time": "UPDATE usermemories SET value = '\"Lisbon\"', updated_at = timezone('utc', now()) WHERE id = %s",
    # A host that does not maintain updated_at: the value alone must still count.
    "value-only": "UPDATE usermemories SET value = '\"Lisbon\"' WHERE id = %s",
}


def _plain_url(settings: Settings) -> str:
    return settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextmanager
def _app_updates(settings: Settings, entry_id: str, statement: str) -> Iterator[None]:
    """The application's transaction: it has updated the row (so holds its lock) and
    commits when the block ends."""
    with psycopg.connect(_plain_url(settings)) as conn:
        conn.execute(statement, (entry_id,))
        yield
        conn.commit()


def _wait_for(settings: Settings, condition: str, timeout: float = 30) -> bool:
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        f"AND wait_event_type = 'Lock' AND {condition}"
    )
    deadline = time.monotonic() + timeout
    with psycopg.connect(_plain_url(settings), autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(query).fetchone()
            if row and row[0]:
                return True
            time.sleep(0.01)
    return False


@pytest.mark.parametrize("chunk", [False, True], ids=["per-user", "chunk"])
@pytest.mark.parametrize("change", list(UPDATES))
def test_keep_newest_leaves_an_older_row_the_application_updated_meanwhile(
    pg_settings: Settings, change: str, chunk: bool
) -> None:
    settings = pg_settings.model_copy(
        update={"summarize_interactions": False, "contradiction_resolution": "keep_newest"}
    )
    older, newer = seed(settings, [entry("u1", "city", "Berlin", age_days=10), entry("u1", "City", "Paris")])
    with ThreadPoolExecutor(max_workers=1) as pool, _app_updates(settings, older["id"], UPDATES[change]):
        running = pool.submit(lambda: dream_users(settings, ["u1"]) if chunk else [dream_user(settings, "u1")])
        # The resolution read the older row as it was and now waits for its lock.
        assert _wait_for(settings, "query LIKE '%%DELETE FROM usermemories%%'"), "the DELETE never waited"
        assert not running.done()
    outcome = running.result(timeout=60)[0]
    assert outcome.status == "succeeded"
    after = entries_of(settings, "u1")
    assert after[older["id"]]["value"] == "Lisbon"
    assert after[newer["id"]]["value"] == "Paris"
    with session_scope(settings) as session:
        assert session.scalars(select(ArchivedEntry.entry_id)).all() == []
        assert session.scalars(select(Event.entry_id).where(Event.action == "delete")).all() == []


def test_keep_newest_still_removes_an_older_row_nobody_touched(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(
        update={"summarize_interactions": False, "contradiction_resolution": "keep_newest"}
    )
    older, newer = seed(settings, [entry("u1", "city", "Berlin", age_days=10), entry("u1", "City", "Paris")])
    assert dream_user(settings, "u1").contradictions_resolved == 1
    assert set(entries_of(settings, "u1")) == {newer["id"]}
    with session_scope(settings) as session:
        assert session.scalars(select(ArchivedEntry.entry_id)).all() == [older["id"]]


def _write(settings: Settings, value: str, *, visibility: str = "self") -> Any:
    with session_scope(settings) as session:
        return upsert_entry(
            session,
            table_for(settings),
            user_id="u1",
            key="favorite_color",
            value=value,
            category="preference",
            source="session_end",
            visibility=visibility,
            source_agent_id=None,
        )


@pytest.mark.parametrize("visibility", ["self", "group"])
def test_two_writers_with_no_agent_end_as_one_row(pg_settings: Settings, visibility: str) -> None:
    """The first writer's transaction is held open after its insert; the second writer
    must wait for it, then replace its value (archived as ``replace``)."""
    b_done = threading.Event()
    a_inserted = threading.Event()

    def first() -> Any:
        with session_scope(pg_settings) as session:
            result = upsert_entry(
                session, table_for(pg_settings), user_id="u1", key="favorite_color", value="blue",
                category="preference", source="session_end", visibility=visibility, source_agent_id=None,
            )  # fmt: skip
            a_inserted.set()
            # Hold the transaction until the second writer has either finished (a twin)
            # or is waiting for this one.
            blocked = _wait_for(pg_settings, "wait_event = 'advisory'", timeout=10)
            assert blocked or b_done.is_set()
            return result

    def second() -> Any:
        assert a_inserted.wait(30)
        try:
            return _write(pg_settings, "green", visibility=visibility)
        finally:
            b_done.set()

    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(first)
        b = pool.submit(second)
        outcomes = [a.result(timeout=60), b.result(timeout=60)]
    assert [o.action for o in outcomes] == ["insert", "update"]
    rows = list(entries_of(pg_settings, "u1").values())
    assert [(r["key"], r["value"]) for r in rows] == [("favorite_color", "green")]
    with session_scope(pg_settings) as session:
        archived = session.execute(select(ArchivedEntry.reason, ArchivedEntry.row)).all()
    assert [(reason, row["value"]) for reason, row in archived] == [("replace", "blue")]


def test_concurrent_writers_with_no_agent_never_leave_twins(pg_settings: Settings) -> None:
    """Many rounds of two threads released together by a barrier."""
    barrier = threading.Barrier(2)

    def go(value: str, key: str) -> None:
        barrier.wait()
        with session_scope(pg_settings) as session:
            upsert_entry(
                session, table_for(pg_settings), user_id="u1", key=key, value=value, category="fact",
                source="session_end", source_agent_id=None,
            )  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        for n in range(30):
            key = f"k{n}"
            for future in [pool.submit(go, "blue", key), pool.submit(go, "green", key)]:
                future.result(timeout=60)
    rows = entries_of(pg_settings, "u1").values()
    assert sorted(r["key"] for r in rows) == sorted(f"k{n}" for n in range(30))
