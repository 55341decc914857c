"""``reverie restore --run``: every archived row comes back unchanged."""

from __future__ import annotations

import pytest

from store.archive import Restored, restore_run
from store.db import session_scope
from store.memories import table_for
from tasks.dream import dream_user
from tests.dream_seed import entries_of, entry, seed
from worker.errors import NotFound
from worker.settings import Settings


def test_restore_returns_every_archived_row_unchanged(store_settings: Settings) -> None:
    settings = store_settings.model_copy(update={"contradiction_resolution": "keep_newest"})
    rows = [
        entry("u1", "stale", {"nested": [1, 2]}, age_days=300, access_count=0, group_ids=["g1"]),
        entry("u1", "city", "Berlin", agent="a", age_days=10),
        entry("u1", "City", "Paris", agent="b", age_days=1),
        *[
            entry("u1", f"n{i}", f"note {i}", category="context", visibility="group", group_ids=["g2"])
            for i in range(5)
        ],
    ]
    seed(settings, rows)
    before = entries_of(settings, "u1")
    outcome = dream_user(settings, "u1")
    assert (outcome.entries_pruned, outcome.contradictions_resolved, outcome.entries_summarized) == (1, 1, 5)
    assert outcome.run_id is not None

    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), outcome.run_id)
    assert (result.restored, result.conflicts, result.removed_inserts) == (7, 0, 2)
    after = entries_of(settings, "u1")
    # conflicted is the only column the run changed on a row it kept.
    assert {k: {**v, "conflicted": None} for k, v in after.items()} == {
        k: {**v, "conflicted": None} for k, v in before.items()
    }
    with session_scope(settings) as session:
        again = restore_run(session, table_for(settings), outcome.run_id)
    assert again.restored == 0


def test_restore_of_an_unknown_run(pg_settings: Settings) -> None:
    with session_scope(pg_settings) as session, pytest.raises(NotFound):
        restore_run(session, table_for(pg_settings), 424242)


def test_restore_leaves_a_row_whose_key_was_taken_again(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [entry("u1", "hotel", "Ibis", age_days=300)])
    run_id = dream_user(settings, "u1").run_id
    assert run_id is not None
    seed(settings, [entry("u1", "hotel", "Hilton")])
    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), run_id)
    assert (result.restored, result.conflicts) == (0, 1)
    assert [r["value"] for r in entries_of(settings, "u1").values()] == ["Hilton"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_restore_under_keep_newest_sticks_while_the_row_holds_what_was_put_back(
    store_settings: Settings, chunked: bool
) -> None:
    # The restored older value is flagged as contradicted from then on, not archived
    # again, while it holds what the restore put back.
    from sqlalchemy import select, update

    from store.models import Profile
    from store.types import now
    from tasks.dream import dream_users

    settings = store_settings.model_copy(
        update={"contradiction_resolution": "keep_newest", "summarize_interactions": False}
    )

    def dream() -> None:
        if chunked and settings.database_url.startswith("postgresql"):
            dream_users(settings, ["u1"])
        else:
            dream_user(settings, "u1")

    older, newer = seed(
        settings,
        [entry("u1", "city", "Berlin", agent="a", age_days=10), entry("u1", "City", "Paris", agent="b", age_days=1)],
    )
    outcome = dream_user(settings, "u1")
    assert outcome.contradictions_resolved == 1 and set(entries_of(settings, "u1")) == {newer["id"]}
    assert outcome.run_id is not None
    with session_scope(settings) as session:
        restored = restore_run(session, table_for(settings), outcome.run_id)
    assert restored.restored == 1 and restored.users == ("u1",)
    dream()
    dream()
    rows = entries_of(settings, "u1")
    assert set(rows) == {older["id"], newer["id"]}
    assert {r["conflicted"] for r in rows.values()} == {True}
    with session_scope(settings) as session:
        texts = {p.agent_id: p.text for p in session.scalars(select(Profile).where(Profile.user_id == "u1"))}
    assert "Berlin (contradicted)" in texts["a"] and "Paris (contradicted)" in texts["b"]
    # Written since (by the host, or its id used again), it is a row like any other.
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(update(table).where(table.c.id == older["id"]).values(value="Rome", updated_at=now()))
        session.execute(update(table).where(table.c.id == newer["id"]).values(value="Madrid", updated_at=now()))
    dream()
    assert set(entries_of(settings, "u1")) == {newer["id"]}


@pytest.mark.parametrize("chunked", [False, True])
def test_a_restored_summary_is_not_summarized_again_while_its_entries_hold_what_was_put_back(
    store_settings: Settings, chunked: bool
) -> None:
    # Undoing a summary puts its originals back; the next dream must not summarize
    # them again (that would undo the restore), until they are written again.
    from sqlalchemy import update

    from store.types import now
    from tasks.dream import dream_users

    settings = store_settings.model_copy(update={"prune_stale_after_days": 3650})

    def dream() -> int:
        if chunked and settings.database_url.startswith("postgresql"):
            return dream_users(settings, ["u1"])[0].entries_summarized
        return dream_user(settings, "u1").entries_summarized

    seed(settings, [entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)])
    originals = entries_of(settings, "u1")
    outcome = dream_user(settings, "u1")
    assert outcome.entries_summarized == 5 and outcome.run_id is not None
    assert not set(entries_of(settings, "u1")) & set(originals)
    with session_scope(settings) as session:
        result = restore_run(session, table_for(settings), outcome.run_id)
    assert result.restored == 5
    assert dream() == 0
    assert dream() == 0
    assert entries_of(settings, "u1") == originals
    # Written since (by the host), they are entries like any other.
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(update(table).where(table.c.user_id == "u1").values(updated_at=now()))
    assert dream() == 5


def test_a_restore_past_the_archives_retention_is_refused_and_changes_nothing(pg_settings: Settings) -> None:
    """The purge deleted a summarize run's archived originals: a restore cannot put them
    back, so it says so (exit 1) and leaves the summary it would otherwise take out."""
    from sqlalchemy import text

    from tests.test_cli import assert_one_line_error, run

    seed(
        pg_settings,
        [entry("u1", "stale", "old", age_days=300)]
        + [entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)],
    )
    outcome = dream_user(pg_settings, "u1")
    assert (outcome.entries_pruned, outcome.entries_summarized) == (1, 5) and outcome.run_id is not None
    after = entries_of(pg_settings, "u1")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": ""}
    with session_scope(pg_settings) as session:
        session.execute(text("UPDATE dream_archive SET archived_at = archived_at - interval '31 days'"))
    purged = run(["run", "--json"], env=env)
    assert purged.returncode == 0, purged.stderr
    with session_scope(pg_settings) as session:
        assert session.execute(text("SELECT count(*) FROM dream_archive")).scalar() == 0
    refused = run(["restore", "--run", str(outcome.run_id)], env=env)
    assert_one_line_error(refused, f"run {outcome.run_id}: nothing put back", "REVERIE_ARCHIVE_RETENTION_DAYS")
    assert refused.returncode == 1 and refused.stdout == ""
    assert entries_of(pg_settings, "u1") == after


def test_a_run_restored_before_its_archive_rows_went_is_not_refused(pg_settings: Settings) -> None:
    from sqlalchemy import text

    from tests.test_cli import run

    seed(pg_settings, [entry("u1", "stale", "old", age_days=300)])
    outcome = dream_user(pg_settings.model_copy(update={"summarize_interactions": False}), "u1")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": ""}
    assert run(["restore", "--run", str(outcome.run_id)], env=env).returncode == 0
    with session_scope(pg_settings) as session:
        session.execute(text("UPDATE dream_archive SET archived_at = archived_at - interval '31 days'"))
    assert run(["run", "--json"], env=env).returncode == 0
    again = run(["restore", "--run", str(outcome.run_id)], env=env)
    assert again.returncode == 0 and "restored 0 entries" in again.stdout, again.stderr


def test_a_purge_that_overlaps_a_restore_waits_for_it_and_takes_no_memory_with_it(pg_settings: Settings) -> None:
    """The archive's window has just passed when a restore starts; the restore waits on
    a summary the application holds (a recall), and the retention purge runs meanwhile.
    The purge must wait for the restore, which puts the originals back: never a restore
    that takes out the summaries and then finds their originals purged."""
    import threading
    import time

    import psycopg
    from sqlalchemy import text

    from tasks.retention import purge_expired

    seed(pg_settings, [entry("u1", f"n{i}", f"note {i}", category="context") for i in range(5)])
    outcome = dream_user(pg_settings, "u1")
    assert outcome.entries_summarized == 5 and outcome.run_id is not None
    with session_scope(pg_settings) as session:
        session.execute(text("UPDATE dream_archive SET archived_at = archived_at - interval '31 days'"))
    url = pg_settings.database_url.replace("+psycopg", "")
    app = psycopg.connect(url)
    app.execute("UPDATE usermemories SET access_count = access_count + 1 WHERE user_id = 'u1'")  # held
    results: dict[str, object] = {}

    def restore() -> None:
        with session_scope(pg_settings) as session:
            results["restore"] = restore_run(session, table_for(pg_settings), outcome.run_id or 0)

    def purge() -> None:
        results["purge"] = purge_expired(pg_settings).archive

    def waiting(query: str) -> bool:
        with psycopg.connect(url, autocommit=True) as look:
            found = look.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE %s",
                (query,),
            ).fetchone()
        return bool(found and found[0])

    restoring = threading.Thread(target=restore)
    restoring.start()
    deadline = time.monotonic() + 20
    while not waiting("%usermemories%") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert restoring.is_alive(), results
    purging = threading.Thread(target=purge)
    purging.start()
    deadline = time.monotonic() + 5
    while purging.is_alive() and not waiting("%DELETE FROM dream_archive%") and time.monotonic() < deadline:
        time.sleep(0.05)
    app.commit()
    app.close()
    restoring.join(30)
    purging.join(30)
    restored = results["restore"]
    assert isinstance(restored, Restored), results
    assert restored.restored == 5 and restored.removed_inserts > 0, results
    assert results["purge"] == 5  # the originals' archive rows, once the restore had put them back
    assert sorted(r["key"] for r in entries_of(pg_settings, "u1").values()) == [f"n{i}" for i in range(5)]
