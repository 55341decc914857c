"""A memory table whose name has capitals (``REVERIE_MEMORY_TABLE=UserMemories``) works on
every path: migrate creates that table (not its lowercase spelling), and prune,
contradiction resolution, summarization, restore and signal writes all reach it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import select

from store.archive import restore_run
from store.db import dispose_engines, session_scope
from store.memories import table_for
from store.migrate import upgrade
from store.models import ArchivedEntry
from tasks.dream import dream_user, dream_users
from tasks.signals import process_pending
from tests.conftest import PG_ADMIN_URL, _base_settings, pg_url_for
from tests.dream_seed import entries_of, entry, seed
from tests.test_session_end import transcript
from worker.producer import enqueue_signal
from worker.settings import Settings


@pytest.fixture()
def mixed_case_settings() -> Iterator[Settings]:
    """A fresh database migrated with the mixed-case table name."""
    name = f"reverie_test_mixed_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    settings = _base_settings(database_url=pg_url_for(name), memory_table="UserMemories")
    try:
        upgrade(settings)
        yield settings
    finally:
        dispose_engines()
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _tables(settings: Settings) -> set[str]:
    url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url) as conn:
        return {row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}


def test_migrate_creates_the_table_under_its_own_name_with_eddi_indexes(mixed_case_settings: Settings) -> None:
    tables = _tables(mixed_case_settings)
    assert "UserMemories" in tables
    assert "usermemories" not in tables
    url = mixed_case_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url) as conn:
        unique = {
            row[0]
            for row in conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE tablename = 'UserMemories' AND indexdef LIKE 'CREATE UNIQUE%%'"
            )
        }
    assert len(unique) == 3  # the primary key and EDDI's two upsert keys
    # A second migrate finds everything in place.
    upgrade(mixed_case_settings)


def test_prune_resolution_summary_restore_and_signal_writes_reach_the_table(mixed_case_settings: Settings) -> None:
    settings = mixed_case_settings.model_copy(update={"contradiction_resolution": "keep_newest"})
    seed(
        settings,
        [
            entry("u1", "stale", "old", age_days=300),
            entry("u1", "city", "Berlin", agent="a", age_days=10),
            entry("u1", "City", "Paris", agent="b", age_days=1),
            *[entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)],
        ],
    )
    seed(settings, [entry("u2", "stale", "old", age_days=300)])
    before = entries_of(settings, "u1")
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded", outcome
    assert (outcome.entries_pruned, outcome.contradictions_resolved, outcome.entries_summarized) == (1, 1, 5)
    assert dream_users(settings, ["u2"])[0].entries_pruned == 1
    with session_scope(settings) as session:
        archived = session.scalars(select(ArchivedEntry.row).where(ArchivedEntry.user_id == "u1")).all()
    assert {row["key"] for row in archived} == {"stale", "city", *(f"n{i}" for i in range(5))}

    assert outcome.run_id is not None
    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), outcome.run_id)
    assert (result.restored, result.conflicts, result.removed_inserts) == (7, 0, 2)
    assert set(entries_of(settings, "u1")) == set(before)

    for sentence in ("My favorite color is blue.", "My favorite color is green."):
        enqueue_signal("session_end", "u3", transcript(("user", sentence), conversation=sentence), settings=settings)
        assert process_pending(settings).processed == 1
    rows = list(entries_of(settings, "u3").values())
    assert [(r["key"], r["value"]) for r in rows] == [("favorite_color", "green")]
    with session_scope(settings) as session:
        replaced = session.scalars(select(ArchivedEntry.row).where(ArchivedEntry.reason == "replace")).all()
    assert [row["value"] for row in replaced] == ["blue"]
