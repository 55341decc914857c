"""Summarization: groups, the defensive reply parser, and the one-transaction replace."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import select, update

import store.summaries
from store.db import session_scope
from store.memories import table_for
from store.models import ArchivedEntry
from store.types import db_now
from tasks.dream import dream_user
from tasks.summarize import UnusableReply, groups_of, parse_reply
from tests.dream_seed import entries_of, entry, seed
from worker import offline_model
from worker.policy import book
from worker.settings import Settings


def _six(user: str = "u1", **kw: Any) -> list[dict[str, Any]]:
    return [entry(user, f"note_{i}", f"fact number {i}", category="context", **kw) for i in range(6)]


def _script(monkeypatch: pytest.MonkeyPatch, reply: str) -> None:
    monkeypatch.setattr(offline_model, "answer", lambda purpose, task: reply)


def test_six_entries_consolidated_to_two_in_one_transaction(store_settings: Settings) -> None:
    originals = seed(store_settings, _six())
    outcome = dream_user(store_settings, "u1")
    assert (outcome.entries_summarized, outcome.entries_written) == (6, 2)
    rows = list(entries_of(store_settings, "u1").values())
    assert sorted(r["key"] for r in rows) == ["context_summary_1", "context_summary_2"]
    assert {r["category"] for r in rows} == {"context"} and {r["source_agent_id"] for r in rows} == {"agent-a"}
    with session_scope(store_settings) as session:
        archived = session.scalars(select(ArchivedEntry)).all()
    assert sorted(a.entry_id for a in archived) == sorted(o["id"] for o in originals)
    assert outcome.cost_usd > 0


def test_below_threshold_groups_untouched(pg_settings: Settings) -> None:
    seed(pg_settings, _six()[:4])
    assert dream_user(pg_settings, "u1").entries_summarized == 0
    assert len(entries_of(pg_settings, "u1")) == 4


@pytest.mark.parametrize(
    "reply",
    ["", "I cannot help with that", "[]", json.dumps([{"key": f"k{i}", "value": "v"} for i in range(6)])],
    ids=["empty", "garbage", "no-items", "not-smaller"],
)
def test_unusable_replies_leave_the_group_untouched(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, reply: str
) -> None:
    originals = seed(pg_settings, _six())
    _script(monkeypatch, reply)
    outcome = dream_user(pg_settings, "u1")
    assert outcome.status == "succeeded" and outcome.entries_summarized == 0
    assert set(entries_of(pg_settings, "u1")) == {o["id"] for o in originals}


def test_fenced_reply_is_parsed(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(pg_settings, _six())
    _script(monkeypatch, '```json\n[{"key": "trips", "value": "six trips"}]\n```')
    assert dream_user(pg_settings, "u1").entries_written == 1
    assert [r["value"] for r in entries_of(pg_settings, "u1").values()] == ["six trips"]


@pytest.mark.parametrize(
    "items",
    [
        [{"key": "a", "value": "v" * 1001}],
        [{"key": "k" * 101, "value": "v"}],
        [{"key": "a", "value": "v"}, {"key": "b", "value": "w"}, {"key": "c", "value": "x"}],
        [{"key": "a", "value": "v"}, {"key": "no value"}],
        [{"key": "a", "value": "v"}, {"key": "a", "value": "w"}],
    ],
    ids=["value-over-1000", "key-over-100", "over-target", "item-without-value", "repeated-key"],
)
def test_a_reply_that_would_lose_facts_replaces_nothing(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, items: list[dict[str, str]]
) -> None:
    # Cutting a value, dropping an item or an entry beyond the target would replace
    # the originals by less than the model said: the whole reply is refused.
    settings = pg_settings.model_copy(update={"llm_max_output_tokens": 4000})
    originals = seed(settings, _six())
    _script(monkeypatch, json.dumps(items))
    outcome = dream_user(settings, "u1")
    assert (outcome.status, outcome.entries_summarized, outcome.groups_deferred) == ("succeeded", 0, 1)
    assert set(entries_of(settings, "u1")) == {o["id"] for o in originals}


def test_parse_reply_rules() -> None:
    assert parse_reply('```\n[{"key": "a", "value": 1}]\n```', 2)[0].value == "1"
    assert parse_reply('Sure! [{"key": "a", "value": "x"}] hope it helps', 2)[0].key == "a"
    assert [i.key for i in parse_reply('{"entries": [{"key": "a", "value": "x"}]}', 2)] == ["a"]
    for bad in ['[{"key": "", "value": "x"}]', '[{"key": "b", "value": ""}]', "[3]", "[]", "{}", "no json"]:
        with pytest.raises(UnusableReply):
            parse_reply(bad, 2)
    with pytest.raises(UnusableReply, match="reserved"):
        parse_reply('[{"key": "_gdpr_x", "value": "x"}]', 2)
    many = json.dumps([{"key": f"k{i}", "value": "v"} for i in range(9)])
    assert len(parse_reply(many)) == 9
    with pytest.raises(UnusableReply, match="more than the target"):
        parse_reply(many, 2)


def test_summary_key_equal_to_an_original_key_survives(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(pg_settings, _six())
    _script(monkeypatch, json.dumps([{"key": "note_0", "value": "all six notes"}]))
    dream_user(pg_settings, "u1")
    assert [(r["key"], r["value"]) for r in entries_of(pg_settings, "u1").values()] == [("note_0", "all six notes")]


def test_visibility_never_widened_and_agents_self_entries_never_mixed(pg_settings: Settings) -> None:
    rows = [
        *[entry("u1", f"a{i}", "x", category="context", agent="agent-a") for i in range(3)],
        *[entry("u1", f"b{i}", "y", category="context", agent="agent-b") for i in range(3)],
        *[entry("u1", f"g{i}", "z", category="context", agent="agent-a", visibility="global") for i in range(3)],
    ]
    seed(pg_settings, rows)
    assert dream_user(pg_settings, "u1").entries_summarized == 0
    seed(pg_settings, [entry("u1", f"a{i}", "x", category="context", agent="agent-a") for i in range(3, 6)])
    assert dream_user(pg_settings, "u1").entries_summarized == 6
    after = list(entries_of(pg_settings, "u1").values())
    summaries = [r for r in after if r["key"].startswith("context_summary")]
    assert {(r["visibility"], r["source_agent_id"]) for r in summaries} == {("self", "agent-a")}
    # agent-b's self entries and agent-a's global ones are as they were.
    assert sum(1 for r in after if r["source_agent_id"] == "agent-b") == 3
    assert sum(1 for r in after if r["visibility"] == "global") == 3


def test_group_ids_kept_and_group_audiences_never_mixed(pg_settings: Settings) -> None:
    seed(
        pg_settings,
        [entry("u1", f"n{i}", "x", category="context", visibility="group", group_ids=["g1", "g2"]) for i in range(5)]
        + [entry("u1", f"m{i}", "x", category="context", visibility="group", group_ids=["g3"]) for i in range(4)],
    )
    assert dream_user(pg_settings, "u1").entries_summarized == 5
    summaries = [r for r in entries_of(pg_settings, "u1").values() if "summary" in r["key"]]
    assert summaries and {tuple(r["group_ids"]) for r in summaries} == {("g1", "g2")}
    assert {r["visibility"] for r in summaries} == {"group"}


def test_null_category_is_treated_as_fact(pg_settings: Settings) -> None:
    rows = [
        SimpleNamespace(
            key=f"k{i}",
            value="v",
            category=None if i % 2 else "fact",
            visibility="self",
            source_agent_id="a",
            group_ids=[],
            conflicted=False,
        )
        for i in range(5)
    ]
    groups = groups_of(rows, pg_settings, book(pg_settings, {}), None)
    assert len(groups) == 1 and len(groups[0]) == 5


def test_protected_and_conflicted_entries_are_not_summarized(pg_settings: Settings) -> None:
    rows = [entry("u1", f"p{i}", "x", category="property") for i in range(6)]
    rows += [entry("u1", "_gdpr_a", "x", category="context")]
    seed(pg_settings, rows)
    assert dream_user(pg_settings, "u1").entries_summarized == 0


@pytest.mark.parametrize("change", [{"value": "changed"}, {"group_ids": ["g1"]}], ids=["value", "group_ids"])
def test_changed_original_defers_the_group(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any]
) -> None:
    # A group's share narrowed meanwhile counts too: the summary would be shared with the
    # groups the originals had when read.
    originals = seed(pg_settings, _six(group_ids=["g1", "g2"]))
    from store.memories import table_for

    table = table_for(pg_settings)

    def app_writes_meanwhile(purpose: str, task: Any) -> str:
        with session_scope(pg_settings) as session:
            session.execute(table.update().where(table.c.id == originals[0]["id"]).values(**change))
        return json.dumps([{"key": "s", "value": "v"}])

    monkeypatch.setattr(offline_model, "answer", app_writes_meanwhile)
    outcome = dream_user(pg_settings, "u1")
    assert outcome.entries_summarized == 0 and outcome.groups_deferred == 1
    assert len(entries_of(pg_settings, "u1")) == 6


@pytest.mark.parametrize("resolution", ["flag", "keep_newest"])
def test_two_groups_summaries_never_share_a_key_nor_contradict_each_other(
    pg_settings: Settings, resolution: str
) -> None:
    # A self group and a global group of one agent: the model names both groups'
    # summaries alike (as the built-in model does, and a real one may).
    settings = pg_settings.model_copy(update={"contradiction_resolution": resolution})
    seed(settings, [*_six(), *_six(visibility="global")])
    first = dream_user(settings, "u1")
    assert (first.entries_summarized, first.entries_written) == (12, 4)
    rows = list(entries_of(settings, "u1").values())
    assert len({r["key"] for r in rows}) == 4
    assert {r["visibility"] for r in rows} == {"self", "global"}
    again = dream_user(settings, "u1")
    assert (again.contradictions_found, again.entries_pruned) == (0, 0)
    after = list(entries_of(settings, "u1").values())
    assert len(after) == 4 and not any(r["conflicted"] for r in after)


def _dirty(settings: Settings, user: str) -> bool:
    from store.models import UserState

    with session_scope(settings) as session:
        state = session.get(UserState, user)
        return state is not None and state.dirty_since is not None


def test_a_group_the_model_cannot_summarize_waits_for_the_next_scheduled_dream(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An unusable reply would come back the same, and be paid for again, at every pass:
    # the user is not marked for the next one.
    seed(pg_settings, _six())
    _script(monkeypatch, json.dumps([{"key": "k", "value": "x" * 1001}]))
    outcome = dream_user(pg_settings, "u1")
    assert outcome.groups_deferred == 1 and outcome.cost_usd > 0
    assert "unusable reply" in (outcome.error or "")
    assert not _dirty(pg_settings, "u1")
    # The chunked path (beat's dispatcher, ``reverie run``) decides the same way.
    from tasks.dream import dream_users

    seed(pg_settings, _six("u2"))
    [chunked] = dream_users(pg_settings, ["u2"])
    assert chunked.groups_deferred == 1 and not _dirty(pg_settings, "u2")


def _next_dream(settings: Settings, user: str) -> Any:
    from store.models import UserState

    with session_scope(settings) as session:
        state = session.get(UserState, user)
        return state.next_dream_at if state is not None else None


@pytest.mark.parametrize("chunked", [False, True], ids=["one-user", "chunk"])
def test_a_group_the_days_budget_cannot_pay_for_waits_for_the_next_day_not_the_next_pass(
    pg_settings: Settings, chunked: bool
) -> None:
    """The day's budget is spent: every dirty delay until midnight would be refused
    again (a run, a ledger row, each time). The user dreams again when the day's
    budgets are new."""
    from tasks.dream import dream_users
    from worker.budget import next_day_start

    # Dreams a month apart: the next slot is all but surely after tomorrow.
    settings = pg_settings.model_copy(update={"max_cost_per_day": 1e-9, "dream_interval_hours": 720.0})
    seed(settings, _six())
    with session_scope(settings) as session:
        tomorrow = next_day_start(db_now(session))
    outcome = dream_users(settings, ["u1"])[0] if chunked else dream_user(settings, "u1")
    assert outcome.groups_deferred == 1 and "day budget exhausted" in (outcome.error or "")
    assert not _dirty(settings, "u1")
    assert _next_dream(settings, "u1") <= tomorrow


def test_a_run_cap_too_small_for_any_call_does_not_dream_the_user_again_at_the_next_pass(
    pg_settings: Settings,
) -> None:
    settings = pg_settings.model_copy(update={"max_cost_per_run": 0.0})
    seed(settings, _six())
    outcome = dream_user(settings, "u1")
    assert outcome.groups_deferred == 1 and "run budget exhausted" in (outcome.error or "")
    assert not _dirty(settings, "u1")


def test_an_application_edit_landing_as_the_summary_is_written_is_never_removed_unsummarized(
    store_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The application edits an original just after the write has read the group back
    (the last look before the delete). The edit must either come too late (the summary
    holds: the originals it removed are the values it summarized) or in time (the group
    is left, the edit kept); never a removed row whose value the summary never saw."""
    seed(store_settings, _six())
    table = table_for(store_settings)
    looked = store.summaries.snapshot
    edits: list[threading.Thread] = []

    def edit_meanwhile(row: Any) -> tuple[Any, ...]:
        if not edits:

            def edit() -> None:
                with session_scope(store_settings) as session:
                    session.execute(
                        update(table).where(table.c.key == "note_0").values(value="edited by the application")
                    )

            edits.append(threading.Thread(target=edit))
            edits[0].start()
            edits[0].join(timeout=1.0)  # lands now, unless the write holds the rows (or the database)
        return looked(row)

    monkeypatch.setattr(store.summaries, "snapshot", edit_meanwhile)
    outcome = dream_user(store_settings, "u1")
    edits[0].join(timeout=60)
    assert not edits[0].is_alive()
    with session_scope(store_settings) as session:
        removed = session.scalars(select(ArchivedEntry.row).where(ArchivedEntry.reason == "summarize")).all()
    removed_values = sorted(str((json.loads(r) if isinstance(r, str) else r)["value"]) for r in removed)
    if outcome.entries_summarized:
        assert removed_values == sorted(f"fact number {i}" for i in range(6))
    else:
        assert removed_values == []
        assert "edited by the application" in {str(r["value"]) for r in entries_of(store_settings, "u1").values()}


def test_the_soft_time_limit_in_a_summary_call_ends_the_run_and_leaves_the_rest_to_the_next_pass(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dream.run_user's path: the limit fires in the model's call. The run stops there
    # (no other group, no profile call), says so, and the user is dreamed again soon.
    from store.models import UserState
    from worker import llm
    from worker.errors import Interrupted

    trips = [entry("u1", f"trip_{i}", f"trip {i}", category="fact") for i in range(6)]
    originals = seed(pg_settings, [*_six(), *trips])
    calls: list[str] = []

    def interrupted(*_: Any, purpose: str, **__: Any) -> Any:
        calls.append(purpose)
        raise Interrupted("interrupted in the call: SoftTimeLimitExceeded")

    monkeypatch.setattr(llm, "complete", interrupted)
    outcome = dream_user(pg_settings, "u1")
    assert outcome.status == "failed" and outcome.error is not None and "Interrupted" in outcome.error
    assert calls == ["summarize"]  # one call: the second group was not tried
    assert set(entries_of(pg_settings, "u1")) == {o["id"] for o in originals}
    with session_scope(pg_settings) as session:
        assert session.scalar(select(UserState.dirty_since).where(UserState.user_id == "u1")) is not None
