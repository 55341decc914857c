"""Write time: a proposed key that means an existing key lands on that entry (real PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from store.db import session_scope
from store.models import ArchivedEntry
from tasks.signals import process_pending
from tests.dream_seed import entries_of, entry, seed
from worker.producer import enqueue_signal
from worker.settings import Settings


def say(settings: Settings, user: str, line: str, *, agent: str = "agent-a", n: int = 0) -> Any:
    payload = {"conversation_id": f"c{n}", "agent_id": agent, "messages": [{"role": "user", "content": line}]}
    enqueue_signal("session_end", user, payload, agent_id=agent, settings=settings)
    report = process_pending(settings)
    assert report.processed == 1
    return report.results[0]


def rows(settings: Settings, user: str) -> list[tuple[str | None, str, Any]]:
    return sorted((r["source_agent_id"], r["key"], r["value"]) for r in entries_of(settings, user).values())


def archived(settings: Settings) -> list[tuple[str, str, Any]]:
    with session_scope(settings) as session:
        found = session.scalars(select(ArchivedEntry).order_by(ArchivedEntry.id)).all()
        return [(a.reason, a.row["key"], a.row["value"]) for a in found]


def test_a_key_said_another_way_lands_on_the_existing_entry(make_settings: Any) -> None:
    # The plain offline model ignores handles: it names the fact by the user's words.
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", "favorite_color", "green", category="preference")])
    result = say(settings, "ann", "My favourite colour is blue.")
    assert rows(settings, "ann") == [("agent-a", "favorite_color", "blue")]
    assert archived(settings) == [("replace", "favorite_color", "green")]
    [decision] = result.accepted
    assert decision.key == "favorite_color"
    assert decision.outcome == "update (proposed as 'favourite_colour', same meaning)"


def test_without_key_matching_the_same_fact_becomes_a_twin(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0, key_matching="off")
    seed(settings, [entry("ann", "favorite_color", "green", category="preference")])
    say(settings, "ann", "My favourite colour is blue.")
    assert rows(settings, "ann") == [("agent-a", "favorite_color", "green"), ("agent-a", "favourite_colour", "blue")]


def test_the_same_value_up_to_case_and_punctuation_changes_nothing(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", "favorite_color", "Blue", category="preference")])
    result = say(settings, "ann", "My favourite colour is blue!")
    assert rows(settings, "ann") == [("agent-a", "favorite_color", "Blue")]
    assert archived(settings) == [] and result.accepted[0].outcome.startswith("unchanged")


def test_matching_stays_within_what_the_agent_may_see_of_its_own_user(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0)
    seed(
        settings,
        [
            entry("ann", "favorite_color", "green", category="preference", agent="agent-b"),
            entry("bob", "favorite_color", "red", category="preference", agent="agent-a"),
        ],
    )
    say(settings, "ann", "My favourite colour is blue.")
    # agent-b's self entry and bob's entry are untouched; agent-a got its own entry.
    assert rows(settings, "ann") == [("agent-a", "favourite_colour", "blue"), ("agent-b", "favorite_color", "green")]
    assert rows(settings, "bob") == [("agent-a", "favorite_color", "red")]
    assert archived(settings) == []


def test_a_global_entry_the_agent_sees_is_updated_in_place(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", "favorite_color", "green", category="preference", visibility="global", agent="b")])
    say(settings, "ann", "My favourite colour is blue.")
    assert rows(settings, "ann") == [("b", "favorite_color", "blue")]
    assert archived(settings) == [("replace", "favorite_color", "green")]


def test_a_matched_protected_entry_is_refused_not_rewritten(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", "favorite_color", "green", category="legacy")])
    result = say(settings, "ann", "My favourite colour is blue.")
    assert rows(settings, "ann") == [("agent-a", "favorite_color", "green")]
    assert [(d.key, d.outcome) for d in result.refused] == [
        ("favorite_color", "an existing protected entry has this key")
    ]


def test_the_overwrite_can_be_put_back_from_the_archive(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0)
    [seeded] = seed(settings, [entry("ann", "favorite_color", "green", category="preference")])
    say(settings, "ann", "My favourite colour is blue.")
    with session_scope(settings) as session:
        [saved] = session.scalars(select(ArchivedEntry)).all()
        assert saved.entry_id == seeded["id"] and saved.signal_id is not None
        assert {k: saved.row[k] for k in ("id", "key", "value", "category")} == {
            "id": seeded["id"],
            "key": "favorite_color",
            "value": "green",
            "category": "preference",
        }


@pytest.mark.parametrize(
    ("home_key", "said", "work_key"),
    [
        ("residence_city", "My work city is Madrid.", "work_city"),
        ("residence_city", "My office city is Madrid.", "office_city"),
        ("current_city", "My office city is Madrid.", "office_city"),
        ("current_city", "My work city is Madrid.", "work_city"),
    ],
)
def test_a_work_city_is_a_second_row_never_an_overwrite_of_the_home_city(
    make_settings: Any, home_key: str, said: str, work_key: str
) -> None:
    # Home side and work side never match, however close the model finds the keys.
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", home_key, "Lisbon")])
    result = say(settings, "ann", said)
    assert rows(settings, "ann") == sorted([("agent-a", home_key, "Lisbon"), ("agent-a", work_key, "Madrid")])
    assert archived(settings) == []
    [decision] = result.accepted
    assert decision.key == work_key and decision.outcome == "insert"


def test_a_work_city_lands_on_the_office_city_beside_the_home_city(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", "residence_city", "Lisbon"), entry("ann", "office_city", "Dublin")])
    say(settings, "ann", "My work city is Madrid.")
    assert rows(settings, "ann") == [("agent-a", "office_city", "Madrid"), ("agent-a", "residence_city", "Lisbon")]
    assert archived(settings) == [("replace", "office_city", "Dublin")]


@pytest.mark.parametrize(
    ("existing", "said"),
    [
        ("job_title", "My role is teacher."),
        ("first_name", "My given name is Ana."),
        ("surname", "My family name is Silva."),
        ("favorite_food", "My favorite dish is ramen."),
    ],
)
def test_a_synonym_lands_on_the_existing_entry(make_settings: Any, existing: str, said: str) -> None:
    settings = make_settings(known_entries_token_budget=0)
    seed(settings, [entry("ann", existing, "old value")])
    result = say(settings, "ann", said)
    value = said.rsplit(" is ", 1)[1].rstrip(".")
    assert rows(settings, "ann") == [("agent-a", existing, value)]
    assert archived(settings) == [("replace", existing, "old value")]
    [decision] = result.accepted
    assert decision.key == existing and "same meaning" in decision.outcome


def test_a_role_lands_on_the_job_title_with_the_rules_alone(make_settings: Any) -> None:
    settings = make_settings(known_entries_token_budget=0, key_matching="rules")
    seed(settings, [entry("ann", "job_title", "nurse")])
    say(settings, "ann", "My role is teacher.")
    assert rows(settings, "ann") == [("agent-a", "job_title", "teacher")]
