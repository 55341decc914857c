"""The model is shown what the user already has, behind handles; guardrails hold (real PostgreSQL)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select

from store.db import session_scope
from store.models import ArchivedEntry
from tasks.signals import process_pending
from tests.dream_seed import entries_of, entry, seed
from worker import offline_model
from worker.producer import enqueue_signal
from worker.settings import Settings


def transcript(*user_lines: str, agent: str = "agent-a") -> dict[str, Any]:
    return {
        "conversation_id": "c-1",
        "agent_id": agent,
        "messages": [{"role": "user", "content": line} for line in user_lines],
    }


class Scripted:
    """The offline model, answering with ``items`` and keeping each task it was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, items: list[Any] | None = None) -> None:
        self.items = items
        self.tasks: list[tuple[str, Any]] = []
        real = offline_model.answer

        def answer(purpose: str, task: Any) -> str:
            self.tasks.append((purpose, task))
            return json.dumps(self.items) if self.items is not None else real(purpose, task)

        monkeypatch.setattr(offline_model, "answer", answer)

    def known(self) -> list[dict[str, Any]]:
        return list(self.tasks[-1][1].get("known", []))


def by_key(settings: Settings, user: str) -> dict[str, dict[str, Any]]:
    return {row["key"]: row for row in entries_of(settings, user).values()}


def archived(settings: Settings) -> list[tuple[str, str, Any]]:
    with session_scope(settings) as session:
        rows = session.scalars(select(ArchivedEntry).order_by(ArchivedEntry.id)).all()
        return [(r.reason, r.row["key"], r.row["value"]) for r in rows]


def run(settings: Settings, payload: dict[str, Any], user: str = "ann") -> Any:
    enqueue_signal("session_end", user, payload, agent_id=payload["agent_id"], settings=settings)
    report = process_pending(settings)
    assert report.processed == 1, report
    return report.results[0]


def test_prompt_shows_what_this_agent_may_see_behind_small_handles(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = seed(
        pg_settings,
        [
            entry("ann", "home_city", "Lisbon"),
            entry("ann", "team", "data", visibility="group"),
            entry("ann", "language", "Portuguese", visibility="global", agent="agent-b"),
            entry("ann", "secret_project", "Falcon", agent="agent-b"),
            entry("ann", "_gdpr_consent", "yes"),
            entry("bob", "home_city", "Oslo"),
        ],
    )
    model = Scripted(monkeypatch, [])
    run(pg_settings, transcript("Nothing new today."))
    shown = model.known()
    assert sorted(e["key"] for e in shown) == ["home_city", "language", "team"]
    assert sorted(e["handle"] for e in shown) == [1, 2, 3]
    assert all(set(e) == {"handle", "key", "value", "category"} for e in shown)
    prompt = json.dumps(model.tasks[-1][1])
    # No raw id, no other agent's self entry, no _gdpr_ entry, no other user's entry.
    assert not any(row["id"] in prompt for row in rows)
    assert "Falcon" not in prompt and "_gdpr_" not in prompt and "Oslo" not in prompt


def test_most_relevant_entries_first_within_the_token_budget(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(known_entries_token_budget=60)
    seed(settings, [entry("ann", f"note_{n}", f"something unrelated {n}", age_days=0.1) for n in range(30)])
    seed(settings, [entry("ann", "home_city", "Lisbon", age_days=30)])
    model = Scripted(monkeypatch, [])
    run(settings, transcript("I am thinking of leaving Lisbon for another city."))
    shown = model.known()
    assert 1 <= len(shown) < 31
    # The old entry that shares words with the transcript beats thirty newer ones.
    assert shown[0]["key"] == "home_city" and shown[0]["handle"] == 1

    off = make_settings(known_entries_token_budget=0)
    run(off, transcript("I am thinking of leaving Lisbon."), user="ann")
    assert model.known() == []


def test_update_by_handle_rewrites_that_entry_and_archives_the_old_value(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(pg_settings, [entry("ann", "home_city", "Lisbon")])
    model = Scripted(monkeypatch)
    model.items = [
        {
            "key": "city_of_residence",
            "value": "Porto",
            "category": "fact",
            "evidence": "I moved to Porto last month",
            "relation": "update",
            "handle": 1,
        }
    ]
    result = run(pg_settings, transcript("I moved to Porto last month."))
    rows = by_key(pg_settings, "ann")
    assert list(rows) == ["home_city"] and rows["home_city"]["value"] == "Porto"
    assert archived(pg_settings) == [("replace", "home_city", "Lisbon")]
    [decision] = result.accepted
    assert decision.key == "home_city" and decision.outcome.startswith("update")


def test_same_by_handle_writes_nothing(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(pg_settings, [entry("ann", "favorite_color", "blue", category="preference")])
    Scripted(
        monkeypatch,
        [
            {
                "key": "favourite_colour",
                "value": "Blue.",
                "category": "preference",
                "evidence": "my favourite colour is still blue",
                "relation": "same",
                "handle": 1,
            }
        ],
    )
    result = run(pg_settings, transcript("My favourite colour is still blue."))
    assert {k: r["value"] for k, r in by_key(pg_settings, "ann").items()} == {"favorite_color": "blue"}
    assert archived(pg_settings) == []
    assert result.accepted[0].outcome.startswith("unchanged")


def test_a_handle_outside_the_list_is_refused_with_its_reason(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(pg_settings, [entry("ann", "home_city", "Lisbon")])
    Scripted(
        monkeypatch,
        [
            {
                "key": "home_city",
                "value": "Porto",
                "category": "fact",
                "evidence": "I live in Porto",
                "relation": "update",
                "handle": 7,
            }
        ],
    )
    result = run(pg_settings, transcript("I live in Porto."))
    assert by_key(pg_settings, "ann")["home_city"]["value"] == "Lisbon"
    assert [(d.key, d.outcome) for d in result.refused] == [
        ("home_city", "handle: '7' is not one of the entries shown")
    ]


def test_another_agents_self_entry_is_never_reached(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(pg_settings, [entry("ann", "secret_project", "Falcon", agent="agent-b")])
    model = Scripted(monkeypatch)
    model.items = [
        # A guessed handle for the hidden entry, and its key proposed outright.
        {"key": "secret_project", "value": "Osprey", "category": "fact", "evidence": "my project is Osprey",
         "relation": "update", "handle": 1},
        {"key": "secret_project", "value": "Osprey", "category": "fact", "evidence": "my project is Osprey"},
    ]  # fmt: skip
    result = run(pg_settings, transcript("My project is Osprey."))
    assert model.known() == []
    assert [d.outcome for d in result.refused] == ["handle: '1' is not one of the entries shown"]
    rows = entries_of(pg_settings, "ann").values()
    mine = {(r["source_agent_id"], r["value"]) for r in rows}
    # agent-b's entry is untouched; agent-a got an entry of its own.
    assert mine == {("agent-b", "Falcon"), ("agent-a", "Osprey")}
    assert archived(pg_settings) == []


@pytest.mark.parametrize("reserved", ["_gdpr_consent", "_GDPR_Consent"])
def test_gdpr_keys_are_untouchable(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, reserved: str) -> None:
    seed(pg_settings, [entry("ann", reserved, "yes")])
    Scripted(
        monkeypatch,
        [
            {"key": reserved.upper(), "value": "no", "category": "fact", "evidence": "my consent is no"},
            # The entry is never shown, so no handle can name it.
            {"key": "consent", "value": "no", "category": "fact", "evidence": "my consent is no",
             "relation": "update", "handle": 1},
        ],
    )  # fmt: skip
    result = run(pg_settings, transcript("My consent is no."))
    assert {k: r["value"] for k, r in by_key(pg_settings, "ann").items()} == {reserved: "yes"}
    assert [d.outcome for d in result.refused] == [
        "key: reserved or contains control characters",
        "handle: '1' is not one of the entries shown",
    ]


def test_a_protected_entry_is_shown_but_never_rewritten(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = make_settings(protected_categories="property,legacy")
    seed(settings, [entry("ann", "home_address", "1 Main St", category="property")])
    model = Scripted(
        monkeypatch,
        [
            {"key": "home_address", "value": "9 Side St", "category": "fact", "evidence": "my address is 9 Side St",
             "relation": "update", "handle": 1},
        ],
    )  # fmt: skip
    result = run(settings, transcript("My address is 9 Side St."))
    assert [e["key"] for e in model.known()] == ["home_address"]
    assert by_key(settings, "ann")["home_address"]["value"] == "1 Main St"
    assert [(d.key, d.outcome) for d in result.refused] == [
        ("home_address", "an existing protected entry has this key")
    ]
    assert archived(settings) == []


def test_feedback_prompt_carries_known_entries_and_pending_observations(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(pg_settings, [entry("ann", "response_format", "bullet points", category="preference", agent="writer")])
    long = "Dear Ann, " + "the quarterly numbers look fine and revenue grew in most regions. " * 4
    model = Scripted(monkeypatch)
    payload = {"deliverable_id": "d1", "agent_id": "writer", "original": long, "edited": "Numbers fine."}
    enqueue_signal("feedback", "ann", payload, agent_id="writer", settings=pg_settings)
    process_pending(pg_settings)
    first = model.tasks[-1][1]
    assert [e["key"] for e in first["known"]] == ["response_format"] and first["pending"] == []
    payload = {**payload, "deliverable_id": "d2", "original": long + " More."}
    enqueue_signal("feedback", "ann", payload, agent_id="writer", settings=pg_settings)
    process_pending(pg_settings)
    second = model.tasks[-1][1]
    assert {"key": "response_length", "value": "shorter, more concise responses", "seen": 1} in second["pending"]
