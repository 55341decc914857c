"""A restore can itself be undone (``reverie restore --run ID --undo``): the memory is
as the run or signal left it again, and the restore can be made again; what the
application changed after the restore is left as it is."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from store.archive import restore_run, restore_signal, undo_restore_run, undo_restore_signal
from store.db import session_scope
from store.memories import table_for, upsert_entry
from store.models import ArchivedEntry
from store.types import now
from tasks.dream import dream_user
from tests.dream_seed import entries_of, entry, seed
from worker.settings import Settings

_COMPARED = ("user_id", "key", "value", "category", "visibility", "source_agent_id", "access_count", "updated_at")


def _memory(settings: Settings, user_id: str = "u1") -> dict[str, tuple[Any, ...]]:
    return {i: tuple(r[c] for c in _COMPARED) for i, r in entries_of(settings, user_id).items()}


def test_undoing_a_runs_restore_brings_its_work_back_and_the_restore_can_be_made_again(
    store_settings: Settings,
) -> None:
    table = table_for(store_settings)
    seed(
        store_settings,
        [
            entry("u1", "stale", "old", age_days=300),
            entry("u1", "city", "Berlin"),
            *[entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)],
        ],
    )
    before = _memory(store_settings)
    outcome = dream_user(store_settings, "u1")
    assert (outcome.entries_pruned, outcome.entries_summarized) == (1, 5) and outcome.run_id is not None
    after_run = _memory(store_settings)

    with session_scope(store_settings) as session:
        restored = restore_run(session, table, outcome.run_id)
    assert (restored.restored, restored.removed_inserts) == (6, 2)
    assert _memory(store_settings) == before

    with session_scope(store_settings) as session:
        undone = undo_restore_run(session, table, outcome.run_id)
    assert (undone.taken_out, undone.put_back, undone.changed_since, undone.conflicts) == (6, 2, 0, 0)
    assert undone.users == ("u1",)
    assert _memory(store_settings) == after_run
    # Every row it took out is archived first (reason undo), under the run.
    with session_scope(store_settings) as session:
        reasons = session.scalars(select(ArchivedEntry.reason).where(ArchivedEntry.reason == "undo")).all()
    assert len(reasons) == 6

    with session_scope(store_settings) as session:
        assert undo_restore_run(session, table, outcome.run_id).taken_out == 0  # nothing left to undo
    assert _memory(store_settings) == after_run
    with session_scope(store_settings) as session:
        again = restore_run(session, table, outcome.run_id)
    assert (again.restored, again.removed_inserts) == (6, 2)
    assert _memory(store_settings) == before


def _write(settings: Settings, key: str, value: str, signal_id: int) -> None:
    with session_scope(settings) as session:
        upsert_entry(
            session, table_for(settings), user_id="u1", key=key, value=value, category="fact",
            source="session_end", source_agent_id="agent-a", signal_id=signal_id,
        )  # fmt: skip


def test_undoing_a_signals_restore_writes_its_value_and_its_new_entry_again(store_settings: Settings) -> None:
    table = table_for(store_settings)
    _write(store_settings, "seat", "aisle", 1)
    _write(store_settings, "seat", "window", 2)
    _write(store_settings, "home", "Oslo", 2)
    after_signal = _memory(store_settings)
    with session_scope(store_settings) as session:
        assert restore_signal(session, table, 2).restored == 1
    assert {v[1]: v[2] for v in _memory(store_settings).values()} == {"seat": "aisle"}

    with session_scope(store_settings) as session:
        undone = undo_restore_signal(session, table, 2)
    assert (undone.taken_out, undone.put_back, undone.changed_since) == (0, 2, 0)
    assert _memory(store_settings) == after_signal

    with session_scope(store_settings) as session:
        assert restore_signal(session, table, 2).restored == 1
    assert {v[1]: v[2] for v in _memory(store_settings).values()} == {"seat": "aisle"}


def test_an_undo_leaves_what_the_application_changed_after_the_restore(store_settings: Settings) -> None:
    table = table_for(store_settings)
    _write(store_settings, "seat", "aisle", 1)
    _write(store_settings, "seat", "window", 2)
    seed(store_settings, [entry("u1", "stale", "old", age_days=300)])
    outcome = dream_user(store_settings, "u1")
    assert outcome.entries_pruned == 1 and outcome.run_id is not None
    with session_scope(store_settings) as session:
        restore_signal(session, table, 2)
        restore_run(session, table, outcome.run_id)
    with session_scope(store_settings) as session:
        session.execute(update(table).values(value="changed by the application", updated_at=now()))

    with session_scope(store_settings) as session:
        by_signal = undo_restore_signal(session, table, 2)
        by_run = undo_restore_run(session, table, outcome.run_id)
    assert (by_signal.put_back, by_signal.changed_since) == (0, 1)
    assert (by_run.taken_out, by_run.changed_since) == (0, 1)
    assert {v[1]: v[2] for v in _memory(store_settings).values()} == {
        "seat": "changed by the application",
        "stale": "changed by the application",
    }
