"""A profile build that fails for one user, or because the database fails it midway:
what is built is kept, nothing is asked of the model twice, and the users left over are
built again soon (real PostgreSQL)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

from store import schedule
from store.db import session_scope
from store.models import Profile, Run, UserState
from store.types import db_now
from tasks import profiles
from tasks.dream import dream_user, dream_users, rebuild_profiles
from tests.dream_seed import entry, seed
from tests.scripted_model import AFTER_CALL, CALLS, SCRIPTED_REPLY, scripted_settings
from worker.settings import Settings


def _scripted(settings: Settings) -> Settings:
    """The model writes every profile; it answers "unchanged" (kept as the deterministic text)."""
    SCRIPTED_REPLY["text"] = json.dumps({"unchanged": True})
    return scripted_settings(settings).model_copy(update={"summarize_interactions": False})


def _raw(settings: Settings) -> psycopg.Connection[Any]:
    return psycopg.connect(settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True)


def _about(user: str, city: str) -> list[dict[str, Any]]:
    return [
        entry(user, "home_city", city, visibility="global", agent=None, age_days=1),
        entry(user, "first_name", "Ana", visibility="global", agent=None, age_days=2),
    ]


def _due_soon(settings: Settings) -> list[str]:
    with session_scope(settings) as session:
        later = db_now(session) + timedelta(seconds=settings.dispatch_dirty_delay_seconds + 1)
        return schedule.due_user_ids(session, later, 10, settings)


def test_a_database_timeout_midway_keeps_what_was_built_and_asks_the_model_nothing_twice(
    pg_settings: Settings,
) -> None:
    # After u1's profile was written by the model, another transaction holds u2's run
    # budget line, and the deployment's lock_timeout fails u2's reservation. That is the
    # database's doing, not u2's rows: u1's paid-for profile is kept, u2 and u3 are built
    # at the next pass, and nobody is sent to the model twice (the chunk used to be
    # built again user by user).
    url = pg_settings.database_url + "?options=-c%20lock_timeout%3D300"
    settings = _scripted(pg_settings).model_copy(update={"database_url": url})
    seed(settings, [*_about("u1", "Lisbon"), *_about("u2", "Porto"), *_about("u3", "Faro")])
    holder = psycopg.connect(pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1))

    def lock_u2s_budget_line() -> None:
        with session_scope(pg_settings) as session:
            run_id = session.scalar(select(Run.id).where(Run.user_id == "u2", Run.status == "running"))
        holder.execute("SELECT 1 FROM dream_spend WHERE scope = 'run' AND scope_key = %s FOR UPDATE", (str(run_id),))

    CALLS.clear()
    AFTER_CALL[:] = [lock_u2s_budget_line]
    try:
        outcomes = dream_users(settings, ["u1", "u2", "u3"])
    finally:
        holder.rollback()
        holder.close()
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 1), ("succeeded", 0), ("succeeded", 0)]
    assert [sum(city in call for call in CALLS) for city in ("Lisbon", "Porto", "Faro")] == [1, 0, 0]
    with session_scope(settings) as session:
        assert set(session.scalars(select(Profile.user_id))) == {"u1"}
    assert _due_soon(settings) == ["u2", "u3"]
    # The next pass builds them, once each.
    CALLS.clear()
    assert [o.profiles_built for o in dream_users(settings, ["u2", "u3"])] == [1, 1]
    assert [sum(city in call for call in CALLS) for city in ("Lisbon", "Porto", "Faro")] == [0, 1, 1]


def test_a_restores_rebuild_leaves_a_user_whose_build_failed_to_the_next_dream(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restore changed u1's and u2's rows; u2's profile cannot be built (a value no code
    # foresaw). u2 is reported left to the next dream and marked for it, and its old
    # profile stays until then; u1's is rebuilt.
    seed(pg_settings, [*_about("u1", "Lisbon"), *_about("u2", "Porto")])
    assert [o.profiles_built for o in dream_users(pg_settings, ["u1", "u2"])] == [1, 1]
    with psycopg.connect(pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
        conn.execute("UPDATE usermemories SET value = '\"Braga\"' WHERE user_id = 'u2' AND key = 'home_city'")
        conn.execute("UPDATE usermemories SET value = '\"Faro\"' WHERE user_id = 'u1' AND key = 'home_city'")
    read_entry = profiles._read_entry

    def failing_for_braga(row: Any) -> Any:
        if "Braga" in str(row):
            raise ArithmeticError("a value no code foresaw")
        return read_entry(row)

    monkeypatch.setattr(profiles, "_read_entry", failing_for_braga)
    built, left = rebuild_profiles(pg_settings, ["u1", "u2"])
    assert (built, left) == (1, ["u2"])
    assert _due_soon(pg_settings) == ["u2"]
    with session_scope(pg_settings) as session:
        texts = dict(session.execute(select(Profile.user_id, Profile.text)).tuples().all())
    assert "Faro" in texts["u1"] and "Porto" in texts["u2"]


# -- a profile write or read the database fails -------------------------------------------


def _lock_profiles_of(settings: Settings, user: str) -> psycopg.Connection[Any]:
    holder = _raw(settings)
    holder.autocommit = False
    holder.execute("SELECT 1 FROM dream_profiles WHERE user_id = %s FOR UPDATE", (user,))
    return holder


def _changed_after_first_build(settings: Settings, users: list[str]) -> None:
    seed(settings, [entry(u, "home_city", "Lisbon", visibility="global", agent=None) for u in users])
    assert all(o.profiles_built == 1 for o in dream_users(settings, users))
    with _raw(settings) as conn:
        conn.execute("UPDATE usermemories SET value = '\"Porto\"' WHERE key = 'home_city'")


def test_one_users_dream_whose_profile_write_times_out_is_dreamed_again_soon(pg_settings: Settings) -> None:
    # One user's dream: the write of the built profiles meets a lock timeout (the
    # database's doing). The run succeeds with no profile written, and the user is marked
    # for the next pass, not left with the old profile until the next scheduled dream.
    settings = pg_settings.model_copy(
        update={"database_url": pg_settings.database_url + "?options=-c%20lock_timeout%3D300"}
    )
    _changed_after_first_build(settings, ["u1"])
    holder = _lock_profiles_of(pg_settings, "u1")
    try:
        outcome = dream_user(settings, "u1")
    finally:
        holder.rollback()
        holder.close()
    assert (outcome.status, outcome.profiles_built) == ("succeeded", 0)
    assert _due_soon(settings) == ["u1"], "the user is left with the old profile until the next scheduled dream"


def test_a_chunk_whose_profile_write_times_out_still_closes_its_runs(pg_settings: Settings) -> None:
    # A chunk writes its profiles in the transaction that closes its runs: a lock timeout
    # on one user's profiles leaves them to the next pass, and the runs are closed and the
    # leases given back all the same (they stayed "running", held until they ran out).
    settings = pg_settings.model_copy(
        update={"database_url": pg_settings.database_url + "?options=-c%20lock_timeout%3D300"}
    )
    _changed_after_first_build(settings, ["u1", "u2"])
    holder = _lock_profiles_of(pg_settings, "u1")
    raised = None
    try:
        dream_users(settings, ["u1", "u2"])
    except Exception as exc:
        raised = type(exc).__name__
    finally:
        holder.rollback()
        holder.close()
    with session_scope(settings) as session:
        statuses = sorted(session.scalars(select(Run.status)))
        leased = sorted(session.scalars(select(UserState.user_id).where(UserState.lock_token.is_not(None))))
    assert (raised, statuses.count("running"), leased) == (None, 0, []), (raised, statuses, leased)


def test_a_chunk_whose_profile_read_always_times_out_still_builds_its_small_users(pg_settings: Settings) -> None:
    # The deployment's statement_timeout: one user's 60,000 rows make the chunk's one
    # profile read run past it, every time. The chunk is then read user by user: the
    # others' profiles are built, and nobody is dreamed again and again for it.
    rows = [entry("big", f"note_{i}", "some value " * 5) for i in range(60_000)]
    for start in range(0, len(rows), 10_000):
        seed(pg_settings, rows[start : start + 10_000])
    seed(pg_settings, [entry(u, "home_city", "Lisbon") for u in ("u1", "u2")])
    settings = pg_settings.model_copy(
        update={
            "database_url": pg_settings.database_url + "?options=-c%20statement_timeout%3D400",
            "summarize_interactions": False,
            "key_matching": "rules",
        }
    )
    for _ in range(3):  # three passes, each after the dirty delay
        dream_users(settings, _due_soon(settings) or ["big", "u1", "u2"])
    with session_scope(settings) as session:
        built = sorted(set(session.scalars(select(Profile.user_id))))
    assert {"u1", "u2"} <= set(built) and _due_soon(settings) == []


def test_a_restores_rebuild_whose_commit_fails_leaves_the_users_to_the_next_dream(pg_settings: Settings) -> None:
    # A restore's rebuild whose COMMIT fails (here a deferred check, as a lost connection
    # at COMMIT would) wrote nothing: its users are reported left to the next dream and
    # marked for it.
    _changed_after_first_build(pg_settings, ["u1"])
    with _raw(pg_settings) as conn:
        conn.execute(
            "CREATE FUNCTION review2_refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$"
        )
        conn.execute(
            "CREATE CONSTRAINT TRIGGER review2_refuse AFTER INSERT ON dream_profiles"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION review2_refuse()"
        )
    try:
        built, left = rebuild_profiles(pg_settings, ["u1"])
        due = _due_soon(pg_settings)
    finally:
        with _raw(pg_settings) as conn:
            conn.execute("DROP TRIGGER review2_refuse ON dream_profiles")
            conn.execute("DROP FUNCTION review2_refuse()")
    with session_scope(pg_settings) as session:
        assert "Lisbon" in session.scalar(select(Profile.text).where(Profile.user_id == "u1"))  # the old one
    assert (built, left, due) == (0, ["u1"], ["u1"])


@pytest.mark.parametrize("chunk", [False, True])
def test_a_profile_read_that_meets_a_lock_timeout_is_dreamed_again_soon(pg_settings: Settings, chunk: bool) -> None:
    # A migration's ACCESS EXCLUSIVE lock on dream_profiles, held a moment: the read gives
    # up waiting (lock_timeout), the old profiles stay, and the users are built at the
    # next pass (not at their next scheduled dream, a day away).
    settings = pg_settings.model_copy(
        update={"database_url": pg_settings.database_url + "?options=-c%20lock_timeout%3D300"}
    )
    users = ["u1", "u2"] if chunk else ["u1"]
    _changed_after_first_build(settings, users)
    holder = _raw(pg_settings)
    holder.autocommit = False
    holder.execute("LOCK TABLE dream_profiles IN ACCESS EXCLUSIVE MODE")
    try:
        outcomes = dream_users(settings, users) if chunk else [dream_user(settings, "u1")]
    finally:
        holder.rollback()
        holder.close()
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 0)] * len(users)
    assert _due_soon(settings) == users
