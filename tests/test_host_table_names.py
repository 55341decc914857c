"""A host memory table may be called anything ``REVERIE_MEMORY_TABLE`` accepts, the
names Reverie gives its own subqueries and aliases included: a dream over such a table
works, and each user's profile holds that user's rows only (real PostgreSQL)."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy import text as sql_text

from store.db import session_scope
from store.models import Profile
from tasks.dream import dream_users
from tests.dream_seed import entry, seed
from worker.settings import Settings

#: Names Reverie's statements give their parts, spelled as a host table could be.
NAMES = ["changed", "entries", "current", "built", "known", "same_keys", "gone", "owners", "archived"]


@pytest.mark.parametrize("name", NAMES)
def test_a_dream_over_a_host_table_named_like_a_part_of_a_statement(pg_settings: Settings, name: str) -> None:
    settings = pg_settings.model_copy(update={"memory_table": name})
    with session_scope(pg_settings) as session:
        session.execute(sql_text(f"CREATE TABLE {name} (LIKE usermemories INCLUDING ALL)"))
    try:
        rows = [
            # A stale entry (pruned and archived), two spellings of one key (a
            # contradiction, and keys the lexicon joins), and a recalled one.
            entry("alice", "old_note", "forgotten", visibility="global", agent=None, age_days=200),
            entry("alice", "home_city", "Lisbon", visibility="global", agent=None),
            entry("alice", "residence_city", "Porto", visibility="global", agent=None),
            entry("bob", "diagnosis", "bob-private-diagnosis", visibility="self", agent="agent-b"),
        ]
        rows[3]["access_count"] = 3
        seed(settings, rows)
        outcomes = dream_users(settings, ["alice", "bob"])
        assert [(o.status, o.error) for o in outcomes] == [("succeeded", None), ("succeeded", None)]
        assert outcomes[0].entries_pruned == 1 and outcomes[0].contradictions_found == 1
        with session_scope(settings) as session:
            texts = {(p.user_id, p.agent_id): p.text for p in session.scalars(select(Profile))}
        assert {key for key in texts if key[0] == "alice"} == {("alice", "")}
        assert "bob" not in texts["alice", ""] and "Lisbon" in texts["alice", ""]
        assert "bob-private-diagnosis" in texts["bob", "agent-b"]
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text(f"DROP TABLE {name}"))
