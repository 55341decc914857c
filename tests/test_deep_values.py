"""A value nested deeper than Python's JSON reader goes (an application may store one):
the user's runs go on, the value stays as it is stored, and its stand-in is never written."""

from __future__ import annotations

import pytest
from sqlalchemy import select, text, update

from store.db import session_scope
from store.json_values import TooDeep, read_json, write_json
from store.memories import table_for
from tasks.dream import dream_users
from tests.dream_seed import entry, seed
from worker.profiles_reader import get_for_prompt
from worker.settings import Settings

DEEP = "[" * 5000 + "]" * 5000


def _store_deep(settings: Settings, key: str, agent: str) -> None:
    cast = "jsonb" if settings.database_url.startswith("postgresql") else "text"
    with session_scope(settings) as session:
        session.execute(
            text(f"UPDATE usermemories SET value = CAST(:v AS {cast}) WHERE key = :k AND source_agent_id = :a"),
            {"v": DEEP, "k": key, "a": agent},
        )


def _stored_text(settings: Settings, key: str, agent: str) -> str:
    column = "value::text" if settings.database_url.startswith("postgresql") else "value"
    with session_scope(settings) as session:
        found = session.execute(
            text(f"SELECT {column} FROM usermemories WHERE key = :k AND source_agent_id = :a"), {"k": key, "a": agent}
        ).scalar_one()
    return "".join(str(found).split())


def test_a_value_too_deep_to_read_fails_no_run_and_stays_as_stored(store_settings: Settings) -> None:
    seed(
        store_settings,
        [
            entry("u1", "city", "Lisbon", agent="agent-a"),
            entry("u1", "city", "Rome", agent="agent-b"),
            entry("u1", "pet", "cat", agent="agent-b"),
        ],
    )
    _store_deep(store_settings, "city", "agent-b")
    for _ in range(2):  # every pass, not only the first
        (outcome,) = dream_users(store_settings, ["u1"])
        assert outcome.status == "succeeded", outcome.error
    assert _stored_text(store_settings, "city", "agent-b") == DEEP
    shown = get_for_prompt("u1", "agent-b", settings=store_settings).text
    # Shown as the database gives it, cut to a line's length.
    assert "- city: [[[[" in shown and "- pet: cat" in shown


def test_the_stand_in_of_a_value_too_deep_is_never_written_back(store_settings: Settings) -> None:
    stand_in = read_json(DEEP)
    assert isinstance(stand_in, TooDeep)
    assert read_json(DEEP) == stand_in != read_json("[" + DEEP + "]")
    assert read_json('{"a": [1]}') == {"a": [1]}
    with pytest.raises(ValueError, match="too deep"):
        write_json(stand_in)
    seed(store_settings, [entry("u1", "city", "Lisbon", agent="agent-a")])
    _store_deep(store_settings, "city", "agent-a")
    table = table_for(store_settings)
    with session_scope(store_settings) as session:
        (read,) = session.execute(select(table.c.value).where(table.c.user_id == "u1")).scalars()
    assert isinstance(read, TooDeep)
    with pytest.raises(Exception, match="too deep"), session_scope(store_settings) as session:
        session.execute(update(table).where(table.c.user_id == "u1").values(value=read))
    assert _stored_text(store_settings, "city", "agent-a") == DEEP
