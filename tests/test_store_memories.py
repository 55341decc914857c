"""The one removal path: archive whole, delete, record an event; on both backends."""

from __future__ import annotations

from sqlalchemy import func, select

from store import seed
from store.db import session_scope
from store.memories import remove_entries, table_for
from store.models import ArchivedEntry, Event
from store.types import now
from worker.settings import Settings


def _seed(settings: Settings) -> None:
    table = table_for(settings)
    with session_scope(settings) as session:
        seed.insert_entries(
            session,
            table,
            [
                {
                    "id": f"e{i}",
                    "user_id": "u1" if i < 4 else "u2",
                    "key": f"k{i}",
                    "value": {"n": i},
                    "source_agent_id": "a1",
                    "created_at": now(),
                    "updated_at": now(),
                    "group_ids": ["g1"],
                }
                for i in range(6)
            ],
        )


def test_remove_archives_whole_rows_and_records_events(store_settings: Settings) -> None:
    _seed(store_settings)
    table = table_for(store_settings)
    with session_scope(store_settings) as session:
        removed = remove_entries(
            session, table, (table.c.user_id == "u1") & table.c.key.in_(["k1", "k2"]), reason="prune", source="prune"
        )
    assert sorted(r.entry_id for r in removed) == ["e1", "e2"]
    with session_scope(store_settings) as session:
        left = set(session.scalars(select(table.c.id)))
        archived = {a.entry_id: a for a in session.scalars(select(ArchivedEntry))}
        events = session.execute(select(Event.entry_id, Event.action, Event.source)).all()
    assert left == {"e0", "e3", "e4", "e5"}
    assert set(archived) == {"e1", "e2"}
    row = archived["e1"].row
    assert row["value"] == {"n": 1} and row["group_ids"] == ["g1"] and row["source_agent_id"] == "a1"
    assert set(row) >= {"id", "user_id", "key", "value", "category", "visibility", "created_at", "updated_at"}
    assert sorted(events) == [("e1", "delete", "prune"), ("e2", "delete", "prune")]


def test_remove_nothing_writes_nothing(store_settings: Settings) -> None:
    _seed(store_settings)
    table = table_for(store_settings)
    with session_scope(store_settings) as session:
        assert remove_entries(session, table, table.c.user_id == "nobody", reason="prune", source="prune") == []
        assert session.scalar(select(func.count()).select_from(ArchivedEntry)) == 0


def test_remove_rolls_back_with_its_transaction(store_settings: Settings) -> None:
    _seed(store_settings)
    table = table_for(store_settings)
    try:
        with session_scope(store_settings) as session:
            remove_entries(session, table, table.c.user_id == "u2", reason="prune", source="prune")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    with session_scope(store_settings) as session:
        assert session.scalar(select(func.count()).select_from(table)) == 6
        assert session.scalar(select(func.count()).select_from(ArchivedEntry)) == 0
