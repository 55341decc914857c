"""Rows written in bulk read back the same on both backends, JSON values included."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from sqlalchemy import select, text

from store.bulk import JsonText, insert_rows
from store.db import session_scope
from store.models import ActivityEvent
from worker.settings import Settings

AT = datetime(2026, 1, 5, 9, 0)


def test_events_read_back_as_written(store_settings: Settings) -> None:
    rows = [
        {"user_id": "u1", "agent_id": "a", "action": "open", "at": AT, "attributes": None, "signal_id": 1},
        {"user_id": "u1", "agent_id": "", "action": "é\t\\n", "at": AT, "attributes": {"k": [1, "x"]}, "signal_id": 2},
        {"user_id": "u2", "agent_id": "a", "action": "close", "at": AT, "attributes": "plain", "signal_id": None},
    ]
    with session_scope(store_settings) as session:
        assert insert_rows(session, ActivityEvent, rows) == 3
    with session_scope(store_settings) as session:
        got = session.execute(
            select(
                ActivityEvent.user_id,
                ActivityEvent.agent_id,
                ActivityEvent.action,
                ActivityEvent.at,
                ActivityEvent.attributes,
                ActivityEvent.signal_id,
            ).order_by(ActivityEvent.id)
        ).all()
        assert [tuple(r) for r in got] == [tuple(r.values()) for r in rows]
        # A Python None is the JSON null, as the ORM stores it, not SQL NULL.
        assert session.execute(text("SELECT count(*) FROM dream_activity WHERE attributes IS NULL")).scalar() == 0


def test_rows_naming_other_columns_are_refused(pg_settings: Settings) -> None:
    with session_scope(pg_settings) as session, pytest.raises(ValueError, match="not columns"):
        insert_rows(session, ActivityEvent, [{"user_id": "u1", "nope": 1}])


def test_json_text_is_written_as_the_json_it_holds(store_settings: Settings) -> None:
    held = {"lines": [[0, 3, 'é \\ "q"\n']], "n": None}
    rows = [
        {"user_id": "u1", "agent_id": "a", "action": "x", "at": AT, "attributes": JsonText(json.dumps(held))},
        {"user_id": "u1", "agent_id": "a", "action": "y", "at": AT, "attributes": JsonText('"plain"')},
    ]
    with session_scope(store_settings) as session:
        insert_rows(session, ActivityEvent, rows)
    with session_scope(store_settings) as session:
        got = session.execute(select(ActivityEvent.attributes).order_by(ActivityEvent.id)).scalars().all()
    assert got == [held, "plain"]
