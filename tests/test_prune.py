"""Pruning: stale means neither updated nor recalled for pruneStaleAfterDays."""

from __future__ import annotations

from types import SimpleNamespace

from sqlalchemy import select

from store import entry_state
from store.db import session_scope
from store.memories import table_for
from store.models import ArchivedEntry, Policy
from store.types import now
from tasks.dream import dream_user
from tests.dream_seed import entry, keys_of, seed
from worker.settings import Settings


def _no_llm(settings: Settings) -> Settings:
    return settings.model_copy(update={"summarize_interactions": False})


def test_stale_pruned_fresh_kept_and_archived(store_settings: Settings) -> None:
    settings = _no_llm(store_settings)
    stale, fresh = seed(settings, [entry("u1", "old_hotel", "Ibis", age_days=120), entry("u1", "airline", "LH")])
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded"
    assert outcome.entries_pruned == 1
    assert keys_of(settings, "u1") == {"airline"}
    with session_scope(settings) as session:
        archived = session.execute(select(ArchivedEntry)).scalars().all()
        assert [(a.entry_id, a.reason, a.run_id) for a in archived] == [(stale["id"], "prune", outcome.run_id)]
        assert archived[0].row["value"] == "Ibis"
    assert fresh["id"]


def test_pruning_off_at_zero_days(pg_settings: Settings) -> None:
    settings = _no_llm(pg_settings).model_copy(update={"prune_stale_after_days": 0})
    seed(settings, [entry("u1", "ancient", "x", age_days=5000)])
    assert dream_user(settings, "u1").entries_pruned == 0
    assert keys_of(settings, "u1") == {"ancient"}


def test_protected_keys_and_categories_never_pruned(pg_settings: Settings) -> None:
    settings = _no_llm(pg_settings)
    seed(
        settings,
        [
            entry("u1", "_gdpr_consent", "granted", age_days=900, agent=None, visibility="global"),
            entry("u1", "passport", "DE", category="property", age_days=900),
            entry("u1", "old_story", "legacy", category="legacy", age_days=900),
            entry("u1", "old_fact", "gone", age_days=900),
        ],
    )
    assert dream_user(settings, "u1").entries_pruned == 1
    assert keys_of(settings, "u1") == {"_gdpr_consent", "passport", "old_story"}


def test_a_reserved_key_in_another_case_is_protected_on_postgresql_as_on_sqlite(
    pg_settings: Settings, sqlite_settings: Settings
) -> None:
    # SQLite's LIKE ignores ASCII case and PostgreSQL's does not: a host's _GDPR_ key was
    # kept on one and pruned on the other.
    for settings in (_no_llm(pg_settings), _no_llm(sqlite_settings)):
        seed(
            settings,
            [
                entry("u1", "_GDPR_Consent", "granted", age_days=900, agent=None, visibility="global"),
                entry("u1", "_Gdpr_marketing", "refused", age_days=900),
                entry("u1", "old_fact", "gone", age_days=900),
            ],
        )
        assert dream_user(settings, "u1").entries_pruned == 1
        assert keys_of(settings, "u1") == {"_GDPR_Consent", "_Gdpr_marketing"}


def test_a_protected_category_in_another_case_is_protected_from_pruning_summaries_and_keep_newest(
    store_settings: Settings,
) -> None:
    # A host that writes "Property" or "LEGACY" (ranking already read categories in any case).
    settings = store_settings.model_copy(update={"contradiction_resolution": "keep_newest", "summarize_min_entries": 2})
    seed(
        settings,
        [
            entry("u1", "passport", "DE", category="Property", age_days=900),
            entry("u1", "old_story", "a tale", category="LEGACY", age_days=900),
            entry("u1", "story_2", "another tale", category="LEGACY", age_days=1),
            entry("u1", "story_3", "a third tale", category="LEGACY", age_days=1),
            entry("u1", "home", "Oslo", category="Property", agent="a", age_days=10),
            entry("u1", "Home", "Rome", category="fact", agent="b", age_days=1),
            entry("u1", "old_fact", "gone", age_days=900),
        ],
    )
    outcome = dream_user(settings, "u1")
    assert outcome.entries_pruned == 1
    assert keys_of(settings, "u1") == {"passport", "old_story", "story_2", "story_3", "home", "Home"}
    # Nor summarized: no group holds them.
    from tasks.summarize import groups_of
    from worker.policy import book

    many = [SimpleNamespace(**entry("u1", f"p{i}", "x", category="PROPERTY")) for i in range(6)]
    assert groups_of(many, settings, book(settings, {}), None) == []


def test_a_protected_category_is_matched_in_any_case_of_any_letter(store_settings: Settings) -> None:
    # SQLite's own lower() folds ASCII letters only.
    settings = _no_llm(store_settings).model_copy(update={"protected_categories": "ärzte,property"})
    seed(
        settings,
        [
            entry("u1", "doctor", "Dr. A", category="ÄRZTE", age_days=900),
            entry("u1", "dentist", "Dr. B", category="ärzte", age_days=900),
            entry("u1", "old_fact", "gone", age_days=900),
        ],
    )
    assert dream_user(settings, "u1").entries_pruned == 1
    assert keys_of(settings, "u1") == {"doctor", "dentist"}


def test_recalled_but_not_updated_entry_survives(pg_settings: Settings) -> None:
    settings = _no_llm(pg_settings)
    recalled, forgotten = seed(
        settings,
        [entry("u1", "seat", "aisle", age_days=200, access_count=3), entry("u1", "meal", "veg", age_days=200)],
    )
    table = table_for(settings)
    # Reverie looked at the counts long ago; since then the app recalled "seat" once.
    with session_scope(settings) as session:
        entry_state.observe_recalls(session, table, "u1", now().replace(year=now().year - 1))
        session.execute(table.update().where(table.c.id == recalled["id"]).values(access_count=4))
    assert dream_user(settings, "u1").entries_pruned == 1
    assert keys_of(settings, "u1") == {"seat"}
    assert forgotten["id"]


def test_unchanged_access_count_is_not_a_recall(pg_settings: Settings) -> None:
    settings = _no_llm(pg_settings)
    seed(settings, [entry("u1", "seat", "aisle", age_days=200, access_count=3)])
    table = table_for(settings)
    with session_scope(settings) as session:
        # Reverie's earlier look saw the same count: no recall since, so it is stale.
        entry_state.observe_recalls(session, table, "u1", now().replace(year=now().year - 1))
        session.execute(
            entry_state.EntryState.__table__.update().values(last_recalled_at=now().replace(year=now().year - 1))
        )
    assert dream_user(settings, "u1").entries_pruned == 1


def test_other_agents_untouched_unless_cross_agent_maintenance(pg_settings: Settings) -> None:
    settings = _no_llm(pg_settings)
    seed(
        settings,
        [
            entry("u1", "mine", "a", agent="agent-a", age_days=200),
            entry("u1", "theirs", "b", agent="agent-b", age_days=200),
        ],
    )
    assert dream_user(settings, "u1", agent_id="agent-a").entries_pruned == 1
    assert keys_of(settings, "u1") == {"theirs"}

    seed(settings, [entry("u1", "mine2", "a", agent="agent-a", age_days=200)])
    with session_scope(settings) as session:
        session.add(Policy(agent_id="agent-a", config={"crossAgentMaintenance": True}))
    assert dream_user(settings, "u1", agent_id="agent-a").entries_pruned == 2
    assert keys_of(settings, "u1") == set()


def test_per_agent_policy_applies_to_its_entries_only(pg_settings: Settings) -> None:
    settings = _no_llm(pg_settings)
    seed(
        settings,
        [
            entry("u1", "a_old", "1", agent="agent-a", age_days=40),
            entry("u1", "b_old", "2", agent="agent-b", age_days=40),
            entry("u1", "unowned_old", "3", agent=None, age_days=40),
            entry("u1", "c_ancient", "4", agent="agent-c", age_days=400),
        ],
    )
    with session_scope(settings) as session:
        session.add(Policy(agent_id="agent-a", config={"pruneStaleAfterDays": 30}))
        session.add(Policy(agent_id="agent-c", config={"enabled": False}))
    assert dream_user(settings, "u1").entries_pruned == 1
    assert keys_of(settings, "u1") == {"b_old", "unowned_old", "c_ancient"}
