"""A profile follows its user's memory whatever the host's table holds and whenever a
change lands: a recall counted while a dream runs, a time PostgreSQL calls infinity, a
table whose times carry a zone (real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy import text as sql_text

from store import profiles as profile_store
from store.db import dispose_engines, session_scope
from store.memories import table_for
from store.models import Profile
from tasks import dream, profiles
from tests.dream_seed import entry, seed
from worker.policy import book
from worker.profiles_reader import get_for_prompt
from worker.settings import Settings


def _global(user_id: str, key: str, value: str, *, age_days: float = 1) -> dict[str, Any]:
    return entry(user_id, key, value, visibility="global", agent=None, age_days=age_days)


def test_a_recall_counted_while_a_dream_runs_reranks_the_profile_at_the_next_dream(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The prune records recalls first; the build reads later. A recall counted between
    # the two is in the rows the build read (their fingerprint) but not yet in the
    # recall times it ranked by: the next dream records it, and the ranking moves
    # though no row does. The profile must follow.
    settings = pg_settings.model_copy(
        update={"profile_token_budget": 60, "summarize_interactions": False, "detect_contradictions": False}
    )
    rows = [_global("u1", f"fact_{i}", f"value number {i}", age_days=2) for i in range(6)]
    rows.append(_global("u1", "recalled_fact", "TARGET", age_days=20))
    seed(settings, rows)
    assert dream.dream_users(settings, ["u1"])[0].profiles_built == 1
    assert "TARGET" not in get_for_prompt("u1", settings=settings).text  # the oldest: left out

    table = table_for(settings)
    summarize = dream._Chunk.summarize

    def recalled_meanwhile(self: Any, *args: Any, **kwargs: Any) -> None:
        with session_scope(settings) as session:  # the application recalls the entry
            session.execute(
                update(table).where(table.c.key == "recalled_fact").values(access_count=table.c.access_count + 1)
            )
        summarize(self, *args, **kwargs)

    monkeypatch.setattr(dream._Chunk, "summarize", recalled_meanwhile)
    dream.dream_users(settings, ["u1"])
    monkeypatch.setattr(dream._Chunk, "summarize", summarize)

    # The dream that records the recall fails to build the profiles: the next one must.
    compose = profiles.compose

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a build that fails once")

    monkeypatch.setattr(profiles, "compose", failing)
    assert dream.dream_users(settings, ["u1"])[0].profiles_built == 0
    monkeypatch.setattr(profiles, "compose", compose)
    third = dream.dream_users(settings, ["u1"])[0]
    assert third.profiles_built == 1
    shown = get_for_prompt("u1", settings=settings).text
    assert shown.splitlines()[1] == "- recalled fact: TARGET", shown  # recalled today: first
    assert dream.dream_users(settings, ["u1"])[0].profiles_built == 0  # and nothing after


def test_a_time_postgresql_calls_infinity_fails_no_dream(pg_settings: Settings) -> None:
    # The contradiction look reads the rows whole: an infinite time failed the user's
    # dream (and the chunk's set-based pass, done again user by user), every pass.
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [_global("u1", "home_city", "Lisbon"), _global("u1", "residence_city", "Porto")])
    seed(settings, [_global("u2", "home_city", "Faro")])
    with session_scope(settings) as session:
        session.execute(sql_text("UPDATE usermemories SET updated_at = 'infinity' WHERE value = '\"Porto\"'"))
        session.execute(sql_text("UPDATE usermemories SET created_at = '0044-03-15 BC' WHERE user_id = 'u2'"))
    outcomes = dream.dream_users(settings, ["u1", "u2"])
    assert [(o.status, o.contradictions_found) for o in outcomes] == [("succeeded", 1), ("succeeded", 0)]
    assert dream.dream_user(settings, "u1").status == "succeeded"
    with session_scope(settings) as session:  # the times are left as the host wrote them
        held = session.execute(sql_text("SELECT updated_at::text FROM usermemories WHERE user_id = 'u1'")).scalars()
        assert "infinity" in set(held)


def test_a_time_postgresql_calls_infinity_stops_no_profile(pg_settings: Settings) -> None:
    # The driver reads no infinite time: one such row stopped the whole chunk's build, on every pass.
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [_global("u1", "home_city", "Lisbon"), _global("u2", "home_city", "Porto")])
    seed(settings, [_global("u3", "home_city", "Faro"), _global("u3", "pet", "cat")])
    seed(settings, [_global("u4", "home_city", "Braga"), _global("u5", "home_city", "Evora")])
    with session_scope(settings) as session:
        session.execute(sql_text("UPDATE usermemories SET updated_at = 'infinity' WHERE user_id = 'u2'"))
        session.execute(sql_text("UPDATE usermemories SET created_at = '-infinity' WHERE user_id = 'u3'"))
        # Finite, and past what Python's times reach, either way.
        session.execute(sql_text("UPDATE usermemories SET updated_at = '10000-01-01' WHERE user_id = 'u4'"))
        session.execute(sql_text("UPDATE usermemories SET created_at = '0044-03-15 BC' WHERE user_id = 'u5'"))
    users = ["u1", "u2", "u3", "u4", "u5"]
    outcomes = dream.dream_users(settings, users)
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 1)] * 5
    assert "Porto" in get_for_prompt("u2", settings=settings).text
    assert [o.profiles_built for o in dream.dream_users(settings, users)] == [0] * 5
    with session_scope(settings) as session:  # the application moves the time back
        session.execute(sql_text("UPDATE usermemories SET updated_at = now() WHERE user_id = 'u2'"))
    assert [o.profiles_built for o in dream.dream_users(settings, users)] == [0, 1, 0, 0, 0]


@pytest.mark.parametrize("citus", [False, True], ids=["one-statement", "fingerprints-compared-here"])
def test_a_table_whose_times_carry_a_zone_rebuilds_nothing_when_nothing_changed(
    zoned_settings: Settings, monkeypatch: pytest.MonkeyPatch, citus: bool
) -> None:
    settings = zoned_settings
    seed(settings, [_global("u1", "home_city", "Lisbon")])
    if citus:  # the look Citus takes (any database can): fingerprints compared in Python
        monkeypatch.setattr(profile_store, "_on_citus", lambda session: True)

    def refresh() -> dict[str, list[int]]:
        with session_scope(settings) as session:
            return profiles.refresh(session, settings, ["u1"], book=book(settings, {}))

    assert refresh() == {"u1": [11]}
    assert refresh() == {}
    assert refresh() == {}
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(update(table).values(value="Porto"))
    assert refresh() == {"u1": [11]}
    with session_scope(settings) as session:
        stored = session.scalar(select(Profile.text).where(Profile.agent_id == ""))
    assert stored is not None and "Porto" in stored


def test_a_user_whose_profile_cannot_be_built_keeps_no_other_user_of_the_chunk_from_theirs(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker import profile_text

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [_global(u, "home_city", "POISON" if u == "u2" else f"city of {u}") for u in ("u1", "u2", "u3")])
    shown = profile_text.json_value_text

    def unforeseen(raw: str | None) -> str:
        if raw and "POISON" in raw:
            raise ValueError("a value no code foresaw")
        return shown(raw)

    monkeypatch.setattr(profile_text, "json_value_text", unforeseen)
    outcomes = dream.dream_users(settings, ["u1", "u2", "u3"])
    assert [(o.user_id, o.status, o.profiles_built) for o in outcomes] == [
        ("u1", "succeeded", 1),
        ("u2", "succeeded", 0),
        ("u3", "succeeded", 1),
    ]
    monkeypatch.setattr(profile_text, "json_value_text", shown)
    assert [o.profiles_built for o in dream.dream_users(settings, ["u1", "u2", "u3"])] == [0, 1, 0]


@pytest.fixture()
def long_agent_settings(pg_settings: Settings) -> Iterator[Settings]:
    """The memory table's owner column widened by the host (``text``)."""
    with session_scope(pg_settings) as session:
        session.execute(sql_text("ALTER TABLE usermemories ALTER source_agent_id TYPE text"))
    dispose_engines()
    yield pg_settings.model_copy(update={"summarize_interactions": False})
    with session_scope(pg_settings) as session:
        session.execute(sql_text("DELETE FROM usermemories"))
        session.execute(sql_text("ALTER TABLE usermemories ALTER source_agent_id TYPE varchar(255)"))
    dispose_engines()


def test_an_owner_longer_than_a_profiles_agent_id_gets_none_and_stops_no_other(long_agent_settings: Settings) -> None:
    settings = long_agent_settings
    long_agent = "agent-" + "x" * 300
    seed(
        settings,
        [
            entry("u1", "diagnosis", "private", visibility="self", agent=long_agent),
            _global("u1", "home_city", "Lisbon"),
            entry("u2", "editor", "vim", visibility="self", agent="agent-a"),
        ],
    )
    outcomes = dream.dream_users(settings, ["u1", "u2"])
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 1), ("succeeded", 2)]
    with session_scope(settings) as session:
        stored = {(u, a): t for u, a, t in session.execute(select(Profile.user_id, Profile.agent_id, Profile.text))}
    assert set(stored) == {("u1", ""), ("u2", ""), ("u2", "agent-a")}
    assert "Lisbon" in stored[("u1", "")] and "private" not in "".join(stored.values())


def test_a_user_whose_profiles_cannot_be_written_keeps_no_other_user_of_the_chunk_from_theirs(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import REGISTRY

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    seed(settings, [_global(u, "home_city", f"city of {u}") for u in ("u1", "u2", "u3")])
    replace = profile_store.replace_profiles

    def refused(session: Any, users: Any, rows: Any) -> int:
        if "u2" in users:
            raise ValueError("a row the table refuses")
        return replace(session, users, rows)

    monkeypatch.setattr(profile_store, "replace_profiles", refused)
    failed = REGISTRY.get_sample_value("dream_profile_build_failures_total") or 0.0
    outcomes = dream.dream_users(settings, ["u1", "u2", "u3"])
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 1), ("succeeded", 0), ("succeeded", 1)]
    assert REGISTRY.get_sample_value("dream_profile_build_failures_total") == failed + 1
    monkeypatch.setattr(profile_store, "replace_profiles", replace)
    assert [o.profiles_built for o in dream.dream_users(settings, ["u1", "u2", "u3"])] == [0, 1, 0]


def test_numbers_are_shown_with_every_digit_they_were_written_with(pg_settings: Settings) -> None:
    # A float holds 17 significant digits: a balance of more was shown rounded, in
    # scientific notation, to the model the prompt goes to.
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    keys = ("account_balance", "order", "rate", "savings", "dose", "constant")
    seed(settings, [_global("u1", key, "x") for key in keys])
    with session_scope(settings) as session:
        for key, value in (
            ("account_balance", "12345678901234567.89"),
            ("order", '{"total": 1234567.1234567890123, "items": [1, 2.5]}'),
            ("rate", "0.1"),
            ("savings", "25000000000000000.00"),
            ("dose", '{"mg": 0.00001, "name": "caf\\u00e9"}'),
            # PostgreSQL writes it out in 32 characters (and 1e-300 in 302): exact as a float, shown so.
            ("constant", '{"tiny": 1e-30, "g": 6.674e-11}'),
        ):
            session.execute(
                sql_text("UPDATE usermemories SET value = CAST(:v AS jsonb) WHERE key = :k"), {"v": value, "k": key}
            )
    dream.dream_users(settings, ["u1"])
    lines = set(get_for_prompt("u1", settings=settings).text.splitlines())
    assert {
        "- account balance: 12345678901234567.89",
        '- order: {"items":[1,2.5],"total":1234567.1234567890123}',
        "- rate: 0.1",
        "- savings: 25000000000000000.00",
        '- dose: {"mg":0.00001,"name":"café"}',
        '- constant: {"g":0.00000000006674,"tiny":1e-30}',
    } <= lines


def test_a_table_whose_times_carry_a_zone_is_summarized(zoned_settings: Settings) -> None:
    # The summary's creation time was the oldest original's (with a zone) against now
    # (without one): every summarizing dream failed, after paying for the model's answer.
    seed(zoned_settings, [entry("u1", f"note_{i}", f"fact number {i}", category="context") for i in range(6)])
    (outcome,) = dream.dream_users(zoned_settings, ["u1"])
    assert (outcome.status, outcome.entries_summarized) == ("succeeded", 6)
