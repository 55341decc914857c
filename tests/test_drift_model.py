"""The built-in model's drifting mode, and a reply parser that copes with how models wrap JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tasks.decisions import parse_reply_list
from tasks.signals import process_pending
from tests import dream_seed
from tests.dream_seed import entries_of, entry
from worker import offline_drift
from worker.llm import complete
from worker.producer import enqueue_signal
from worker.settings import Settings

ITEMS = [{"key": "home_city", "value": "Porto", "category": "fact", "evidence": "I live in Porto"}]


@pytest.mark.parametrize(
    "reply",
    [
        json.dumps(ITEMS),
        "```json\n" + json.dumps(ITEMS, indent=2) + "\n```",
        "Here are the facts [from the chat]:\n" + json.dumps(ITEMS) + "\nHope this helps!",
        "Sure.\n\n```\n" + json.dumps({"facts": ITEMS}) + "\n```\nAnything else?",
        json.dumps({"facts": ITEMS}),
    ],
)
def test_reply_parser_finds_the_items_in_prose_fences_and_wrappers(reply: str) -> None:
    assert parse_reply_list(reply) == ITEMS


@pytest.mark.parametrize(
    "reply",
    [
        "no JSON at all",
        # Cut off inside the array: its first whole item must not be taken alone.
        '[{"key": "a", "value": "1", "category": "fact", "evidence": "x"}, {"key": "b", "val',
        '{"key": "a", "value": "1"}',
    ],
)
def test_reply_parser_takes_no_partial_or_loose_items(reply: str) -> None:
    assert parse_reply_list(reply) is None


def task(*sentences: str, known: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": s} for s in sentences], "known": known or []}


def items_of(given: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    reply = offline_drift.answer("extract_facts", given, seed)
    items = parse_reply_list(reply)
    assert items is not None, reply
    return items


def test_drift_is_seeded_and_deterministic() -> None:
    one = task("My favorite color is blue.", "My home city is Lisbon.")
    assert offline_drift.answer("extract_facts", one, 3) == offline_drift.answer("extract_facts", one, 3)
    replies = {offline_drift.answer("extract_facts", one, seed) for seed in range(20)}
    assert len(replies) > 5


def test_drift_varies_keys_among_synonyms_and_values_in_case_and_punctuation() -> None:
    colours: set[str] = set()
    values: set[str] = set()
    wrapped = 0
    for seed in range(40):
        reply = offline_drift.answer("extract_facts", task("My favorite color is blue."), seed)
        items = parse_reply_list(reply)
        assert items is not None and len(items) == 1, reply
        colours.add(items[0]["key"])
        values.add(items[0]["value"])
        wrapped += not reply.lstrip().startswith(("[", "{"))
    assert colours == set(offline_drift.family_of("favorite_color"))
    assert {"blue", "Blue"} <= {v.strip('".!') for v in values} and len(values) >= 4
    assert 10 <= wrapped < 40


def test_drift_answers_a_shown_concept_by_its_handle_mostly_not_always() -> None:
    known = [{"handle": 4, "key": "home_city", "value": "Lisbon", "category": "fact"}]
    moved, restated = [], []
    for seed in range(50):
        moved += items_of(task("My city of residence is Porto.", known=known), seed)
        restated += items_of(task("My home city is Lisbon.", known=known), seed)
    by_handle = sum(item.get("handle") == 4 for item in moved)
    assert 30 <= by_handle < 50 and len(moved) == 50
    assert any("handle" not in item and item["key"] in offline_drift.family_of("home_city") for item in moved)
    # A known fact said again unchanged is mostly left out, sometimes proposed anew.
    assert 0 < len(restated) <= 20 and all("handle" not in item for item in restated)


def test_drift_model_runs_through_the_gateway_and_the_signal_path(make_settings: Any) -> None:
    settings: Settings = make_settings(llm_model="offline/drift", llm_drift_seed=11)
    reply = complete(
        settings,
        purpose="extract_facts",
        messages=[
            {"role": "system", "content": "[reverie:extract_facts]\n..."},
            {"role": "user", "content": "INPUT:\n" + json.dumps(task("My favorite color is blue."))},
        ],
        max_tokens=512,
    )
    assert reply.cost_usd > 0 and parse_reply_list(reply.text)
    dream_seed.seed(settings, [entry("ann", "home_city", "Lisbon", agent="agent-a")])
    for n, city in enumerate(("Porto", "Braga", "Faro")):
        payload = {
            "conversation_id": f"c{n}",
            "agent_id": "agent-a",
            "messages": [{"role": "user", "content": f"My city of residence is {city}."}],
        }
        enqueue_signal("session_end", "ann", payload, agent_id="agent-a", settings=settings)
        assert process_pending(settings).processed == 1
    values = sorted(str(r["value"]) for r in entries_of(settings, "ann").values())
    assert "Faro" in [v.strip('".!').title() for v in values]
