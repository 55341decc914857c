"""A host whose memory table is keyed ``PRIMARY KEY (user_id, id)`` (the one change a
host makes to distribute it with Citus) runs Reverie unchanged: signals, the dream
cycle, restore and erasure reach exactly the user's rows, even where another user holds
a row with the same id."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import select

from store.archive import restore_run
from store.db import dispose_engines, session_scope
from store.entry_state import observe_recalls
from store.erase import rows_about
from store.memories import table_for
from store.migrate import upgrade
from store.models import ArchivedEntry
from store.types import now
from tasks.dream import dream_user
from tasks.erase import erase_user
from tasks.signals import process_pending
from tests.conftest import PG_ADMIN_URL, _base_settings, pg_url_for
from tests.dream_seed import entries_of, entry, seed
from tests.test_migrations import EDDI_DDL
from tests.test_session_end import transcript
from worker.producer import enqueue_signal
from worker.settings import Settings

_OWN_KEY = "id VARCHAR(64) PRIMARY KEY DEFAULT gen_random_uuid()::text,"
_PER_USER_KEY = "id VARCHAR(64) NOT NULL DEFAULT gen_random_uuid()::text,"


def _per_user_ddl() -> list[str]:
    table, *indexes = EDDI_DDL
    assert _OWN_KEY in table
    table = table.replace(_OWN_KEY, _PER_USER_KEY).rstrip().removesuffix(")") + ", PRIMARY KEY (user_id, id))"
    return [table, *indexes]


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.fixture()
def keyed_settings() -> Iterator[Settings]:
    """A fresh database whose memory table the host keyed by (user_id, id), then migrated."""
    name = f"reverie_keyed_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    settings = _base_settings(database_url=pg_url_for(name))
    try:
        with psycopg.connect(_plain(settings.database_url), autocommit=True) as conn:
            for statement in _per_user_ddl():
                conn.execute(statement)  # type: ignore[arg-type]
        upgrade(settings)
        yield settings
    finally:
        dispose_engines()
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _with_id(row: dict[str, Any], entry_id: str) -> dict[str, Any]:
    return {**row, "id": entry_id}


def _twins(ids: list[str]) -> list[dict[str, Any]]:
    """Another user's rows that reuse ``ids``: they must come through untouched."""
    return [
        _with_id(entry("u2", f"twin_{i}", f"twin value {i}", agent="agent-z", category=f"c{i}", access_count=3), eid)
        for i, eid in enumerate(ids)
    ]


def _snapshot(settings: Settings, user_id: str) -> dict[str, tuple[Any, ...]]:
    return {
        eid: (r["key"], r["value"], r["conflicted"], r["updated_at"], r["access_count"])
        for eid, r in entries_of(settings, user_id).items()
    }


def test_migrate_leaves_the_per_user_key_alone(keyed_settings: Settings) -> None:
    with psycopg.connect(_plain(keyed_settings.database_url)) as conn:
        row = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'usermemories'::regclass AND contype = 'p'"
        ).fetchone()
    assert row == ("PRIMARY KEY (user_id, id)",)


def test_full_cycle_touches_only_the_users_rows(keyed_settings: Settings) -> None:
    settings = keyed_settings.model_copy(update={"contradiction_resolution": "keep_newest"})
    ids = ["stale", "city-a", "city-b", *(f"note-{i}" for i in range(5)), "colour"]
    seed(
        settings,
        [
            _with_id(entry("u1", "stale", "old", age_days=300), ids[0]),
            _with_id(entry("u1", "city", "Berlin", agent="a", age_days=10), ids[1]),
            _with_id(entry("u1", "City", "Paris", agent="b", age_days=1), ids[2]),
            *[_with_id(entry("u1", f"n{i}", f"note {i}", category="context"), ids[3 + i]) for i in range(5)],
            _with_id(entry("u1", "favorite_color", "blue", category="preference"), ids[8]),
            *_twins(ids),
        ],
    )
    # Reverie has seen the other user's recalls (its twin of the stale entry has some).
    with session_scope(settings) as session:
        observe_recalls(session, table_for(settings), "u2", now())
    bystander = _snapshot(settings, "u2")

    # A signal overwrites the user's entry; the old value is archived.
    enqueue_signal("session_end", "u1", transcript(("user", "My favorite color is green.")), settings=settings)
    assert process_pending(settings).processed == 1
    assert entries_of(settings, "u1")["colour"]["value"] == "green"
    with session_scope(settings) as session:
        replaced = session.execute(
            select(ArchivedEntry.user_id, ArchivedEntry.entry_id, ArchivedEntry.row).where(
                ArchivedEntry.reason == "replace"
            )
        ).all()
    assert [(r.user_id, r.entry_id, r.row["value"]) for r in replaced] == [("u1", "colour", "blue")]
    assert _snapshot(settings, "u2") == bystander

    # The dream: prune, contradiction (the newest stays), summarize.
    before = entries_of(settings, "u1")
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded", outcome
    assert (outcome.entries_pruned, outcome.contradictions_resolved, outcome.entries_summarized) == (1, 1, 5)
    left = entries_of(settings, "u1")
    assert "stale" not in left and "city-a" not in left and "city-b" in left
    assert _snapshot(settings, "u2") == bystander

    # Restore puts back every row the run removed, under the ids another user also holds.
    assert outcome.run_id is not None
    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), outcome.run_id)
    assert (result.restored, result.conflicts, result.removed_inserts) == (7, 0, 2)
    assert set(entries_of(settings, "u1")) == set(before)
    assert _snapshot(settings, "u2") == bystander

    # Erasure takes the user's rows only.
    erase_user(settings, "u1")
    with session_scope(settings) as session:
        assert set(rows_about(session, settings, "u1").values()) == {0}
    assert _snapshot(settings, "u2") == bystander


def test_flagged_contradiction_flags_only_the_users_rows(keyed_settings: Settings) -> None:
    seed(
        keyed_settings,
        [
            _with_id(entry("u1", "birthday", "1 May", agent="a", age_days=3), "b-1"),
            _with_id(entry("u1", "date_of_birth", "2 May", agent="b", age_days=2), "b-2"),
            *_twins(["b-1", "b-2"]),
        ],
    )
    bystander = _snapshot(keyed_settings, "u2")
    outcome = dream_user(keyed_settings, "u1")
    assert outcome.contradictions_found == 1, outcome
    assert {eid: r["conflicted"] for eid, r in entries_of(keyed_settings, "u1").items()} == {"b-1": True, "b-2": True}
    assert _snapshot(keyed_settings, "u2") == bystander
