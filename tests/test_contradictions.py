"""Contradictions: normalised keys, JSON values, counted once, closed when values agree."""

from __future__ import annotations

from sqlalchemy import select

from store.db import session_scope
from store.memories import table_for
from store.models import ArchivedEntry, Contradiction, Policy
from tasks.contradictions import canonical_value, normalise_key
from tasks.dream import dream_user
from tests.dream_seed import entries_of, entry, keys_of, seed
from worker.settings import Settings


def _settings(settings: Settings, **extra: object) -> Settings:
    return settings.model_copy(update={"summarize_interactions": False, **extra})


def _contradictions(settings: Settings) -> list[Contradiction]:
    with session_scope(settings) as session:
        return list(session.scalars(select(Contradiction).order_by(Contradiction.id)))


def test_normalisation() -> None:
    assert normalise_key("Favorite-Color") == normalise_key("favorite color") == normalise_key("favorite.color")
    assert canonical_value('{"b": 1, "a": 2}') == canonical_value({"a": 2, "b": 1})


def test_english_vs_german_is_one_contradiction_flagged_and_counted_once(store_settings: Settings) -> None:
    settings = _settings(store_settings)
    en, de = seed(
        settings,
        [
            entry("u1", "language", "English", category="preference", agent="travel"),
            entry("u1", "Language", "German", category="preference", visibility="global", agent="coach"),
        ],
    )
    first = dream_user(settings, "u1")
    assert first.contradictions_found == 1
    rows = entries_of(settings, "u1")
    assert rows[en["id"]]["conflicted"] is True and rows[de["id"]]["conflicted"] is True
    assert dream_user(settings, "u1").contradictions_found == 0
    assert [c.status for c in _contradictions(settings)] == ["open"]


def test_equal_values_are_not_a_contradiction(pg_settings: Settings) -> None:
    settings = _settings(pg_settings)
    seed(settings, [entry("u1", "language", "English", agent="a"), entry("u1", "LANGUAGE", "English", agent="b")])
    assert dream_user(settings, "u1").contradictions_found == 0


def test_detection_off_when_disabled(pg_settings: Settings) -> None:
    settings = _settings(pg_settings, detect_contradictions=False)
    seed(settings, [entry("u1", "language", "English", agent="a"), entry("u1", "language", "German", agent="b")])
    assert dream_user(settings, "u1").contradictions_found == 0
    assert _contradictions(settings) == []


def test_closed_when_values_agree_again(pg_settings: Settings) -> None:
    settings = _settings(pg_settings)
    en, de = seed(
        settings, [entry("u1", "language", "English", agent="a"), entry("u1", "language", "German", agent="b")]
    )
    dream_user(settings, "u1")
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(table.update().where(table.c.id == de["id"]).values(value="English"))
    assert dream_user(settings, "u1").contradictions_found == 0
    assert [c.status for c in _contradictions(settings)] == ["closed"]
    assert {r["conflicted"] for r in entries_of(settings, "u1").values()} == {False}
    assert en["id"]


def test_keep_newest_archives_and_removes_older_rows(pg_settings: Settings) -> None:
    settings = _settings(pg_settings, contradiction_resolution="keep_newest")
    old, new = seed(
        settings,
        [entry("u1", "city", "Berlin", agent="a", age_days=10), entry("u1", "City", "Paris", agent="b", age_days=1)],
    )
    outcome = dream_user(settings, "u1")
    assert (outcome.contradictions_found, outcome.contradictions_resolved) == (1, 1)
    rows = entries_of(settings, "u1")
    assert list(rows) == [new["id"]] and rows[new["id"]]["conflicted"] is False
    with session_scope(settings) as session:
        archived = session.scalars(select(ArchivedEntry)).all()
    assert [(a.entry_id, a.reason) for a in archived] == [(old["id"], "contradiction")]
    assert dream_user(settings, "u1").contradictions_found == 0


def test_keep_newest_never_removes_protected_rows(pg_settings: Settings) -> None:
    settings = _settings(pg_settings, contradiction_resolution="keep_newest")
    seed(
        settings,
        [
            entry("u1", "passport", "DE", category="property", agent="a", age_days=10),
            entry("u1", "passport", "FR", agent="b", age_days=1),
        ],
    )
    outcome = dream_user(settings, "u1")
    assert outcome.contradictions_found == 1 and outcome.contradictions_resolved == 0
    assert keys_of(settings, "u1") == {"passport"} and len(entries_of(settings, "u1")) == 2


def test_gdpr_keys_are_left_alone(pg_settings: Settings) -> None:
    settings = _settings(pg_settings)
    seed(settings, [entry("u1", "_gdpr_consent", "yes", agent="a"), entry("u1", "_GDPR_consent", "no", agent="b")])
    assert dream_user(settings, "u1").contradictions_found == 0


def test_agent_policy_turns_detection_off_for_its_entries(pg_settings: Settings) -> None:
    settings = _settings(pg_settings)
    seed(settings, [entry("u1", "language", "English", agent="a"), entry("u1", "language", "German", agent="b")])
    with session_scope(settings) as session:
        session.add(Policy(agent_id="b", config={"detectContradictions": False}))
    assert dream_user(settings, "u1").contradictions_found == 0
