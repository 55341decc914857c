"""Contradictions: normalised keys, JSON values, counted once, closed when values agree."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, func, select, update
from structlog.testing import capture_logs

from store.db import session_scope
from store.memories import contradiction_candidates, table_for
from store.models import ArchivedEntry, Contradiction, KeyVector, Policy
from tasks.contradictions import canonical_value, normalise_key
from tasks.dream import dream_user, dream_users
from tests.dream_seed import entries_of, entry, keys_of, seed
from tests.key_pairs import DREAM_DIFFERENT, DREAM_SAME
from worker.keymatch import forget_matchers, get_matcher
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


@pytest.mark.parametrize(
    "change", [{"category": "property"}, {"visibility": "global"}, {"source_agent_id": "c"}], ids=str
)
def test_keep_newest_leaves_a_row_the_application_changed_after_the_read(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, change: dict[str, str]
) -> None:
    """Between the read and the delete the application protects the older row (or
    shares it, or gives it to another agent): it is no longer what was judged, and stays."""
    import tasks.contradictions

    settings = _settings(pg_settings, contradiction_resolution="keep_newest")
    old, _ = seed(
        settings,
        [entry("u1", "city", "Berlin", agent="a", age_days=10), entry("u1", "City", "Paris", agent="b", age_days=1)],
    )
    judged = tasks.contradictions._losers
    table = table_for(settings)

    def app_writes_meanwhile(*args: object) -> list[object]:
        losers = judged(*args)  # type: ignore[arg-type]
        with session_scope(settings) as session:
            session.execute(update(table).where(table.c.id == old["id"]).values(**change))
        return losers

    monkeypatch.setattr(tasks.contradictions, "_losers", app_writes_meanwhile)
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded"
    assert old["id"] in entries_of(settings, "u1")
    with session_scope(settings) as session:
        assert session.scalars(select(ArchivedEntry)).all() == []


def test_a_flagged_contradiction_resolved_later_by_keep_newest_reads_keep_newest(pg_settings: Settings) -> None:
    seed(
        pg_settings,
        [entry("u1", "city", "Berlin", agent="a", age_days=10), entry("u1", "City", "Paris", agent="b", age_days=1)],
    )
    assert dream_user(_settings(pg_settings), "u1").contradictions_found == 1  # flagged
    outcome = dream_user(_settings(pg_settings, contradiction_resolution="keep_newest"), "u1")
    assert outcome.contradictions_resolved == 1
    with session_scope(pg_settings) as session:
        found = session.execute(select(Contradiction.status, Contradiction.resolution)).all()
    assert [tuple(row) for row in found] == [("closed", "keep_newest")]


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


def _flagged_pairs(settings: Settings, prefix: str, pairs: tuple[tuple[str, str], ...]) -> int:
    """Seeds each pair as one user's two entries with different values, dreams them all
    in one chunk, and counts the users whose two entries were flagged as a contradiction."""
    users = [f"{prefix}{i}" for i in range(len(pairs))]
    seed(
        settings,
        [
            row
            for user, (a, b) in zip(users, pairs, strict=True)
            for row in (entry(user, a, "one value", agent="a"), entry(user, b, "another value", agent="b"))
        ],
    )
    with capture_logs() as logs:
        outcomes = {o.user_id: o for o in dream_users(settings, users)}
    # The chunk's set-based path did the work, not the one-user-at-a-time fallback.
    assert not [e for e in logs if e["event"] == "dream.chunk_fallback"]
    flagged = 0
    for user in users:
        conflicted = {r["conflicted"] for r in entries_of(settings, user).values()}
        assert conflicted in ({True}, {False})
        assert outcomes[user].contradictions_found == (1 if conflicted == {True} else 0)
        flagged += conflicted == {True}
    return flagged


def test_keys_that_mean_the_same_contradict_at_dream_time(store_settings: Settings) -> None:
    settings = _settings(store_settings, key_matching="embedding")
    found = _flagged_pairs(settings, "same", DREAM_SAME)
    wrong = _flagged_pairs(settings, "diff", DREAM_DIFFERENT)
    assert wrong == 0, "keys that are different facts were flagged as a contradiction"
    assert found / len(DREAM_SAME) >= 0.90, f"recall {found}/{len(DREAM_SAME)}"


def test_rules_alone_still_join_spellings_and_abbreviations(pg_settings: Settings) -> None:
    settings = _settings(pg_settings, key_matching="rules")
    pairs = (("favorite_color", "Favourite-Colours"), ("dob", "date_of_birth"), ("first_name", "last_name"))
    seed(settings, [entry("r1", "favorite_color", "blue"), entry("r1", "Favourite-Colours", "green", agent="b")])
    seed(settings, [entry("r2", "dob", "1990-01-01"), entry("r2", "date_of_birth", "1991-02-02", agent="b")])
    seed(settings, [entry("r3", "first_name", "Ada"), entry("r3", "last_name", "Lovelace", agent="b")])
    found = {o.user_id: o.contradictions_found for o in dream_users(settings, ["r1", "r2", "r3"])}
    assert found == {"r1": 1, "r2": 1, "r3": 0}, pairs


def test_a_second_sweep_over_known_keys_runs_no_inference(pg_settings: Settings) -> None:
    settings = _settings(pg_settings, key_matching="embedding")
    users = [f"sweep{i}" for i in range(6)]
    keys = ["birthday", "date_of_birth", "home_city", "city_of_residence", "favorite_color", "shoe_size"]
    seed(settings, [entry(u, k, f"{u}-{k}", agent=f"agent-{j}") for u in users for j, k in enumerate(keys)])
    forget_matchers()
    first = get_matcher(settings)
    assert first.embedder is not None
    # One vector per rules form: the lexicon makes birthday and date_of_birth one form.
    forms = {first.normalise(k) for k in keys}
    assert len(forms) == 4
    dream_users(settings, users)
    assert first.embedder.inferences == len(forms)
    # A new process: nothing in memory, every vector in dream_key_vectors.
    forget_matchers()
    second = get_matcher(settings)
    assert second is not first and second.embedder is not None
    outcomes = dream_users(settings, users)
    assert second.embedder.inferences == 0
    assert all(o.status == "succeeded" for o in outcomes)
    with session_scope(settings) as session:
        stored = session.scalar(select(func.count()).select_from(KeyVector))
    assert stored == len(forms)
    forget_matchers()


def test_prefilter_keeps_synonym_pairs_when_told_which_keys_mean_the_same(pg_settings: Settings) -> None:
    settings = _settings(pg_settings)
    seed(
        settings,
        [
            entry("p1", "birthday", "1990-01-01"),
            entry("p1", "date_of_birth", "1991-02-02", agent="b"),
            entry("p1", "shoe_size", "42"),
            entry("p2", "Favourite-Colour", "blue"),
            entry("p2", "favorite_color", "green", agent="b"),
        ],
    )
    table = table_for(settings)
    with session_scope(settings) as session:
        loose_only = contradiction_candidates(session, table, ["p1", "p2"])
        same_keys = {("p1", "birthday"): "birthday", ("p1", "date_of_birth"): "birthday"}
        told = contradiction_candidates(session, table, ["p1", "p2"], same_keys)
    assert {(r.user_id, r.key) for r in loose_only} == set()
    assert {(r.user_id, r.key) for r in told} == {("p1", "birthday"), ("p1", "date_of_birth")}


@pytest.mark.parametrize("chunked", [False, True])
def test_turning_detection_off_leaves_open_contradictions_open_and_flagged(
    pg_settings: Settings, chunked: bool
) -> None:
    # Off means "stop looking", not "the values agree": nothing is closed or unflagged.
    def dream(settings: Settings) -> None:
        if chunked:
            dream_users(settings, ["u1"])
        else:
            dream_user(settings, "u1")

    settings = _settings(pg_settings)
    en, de = seed(
        settings, [entry("u1", "language", "English", agent="a"), entry("u1", "language", "German", agent="b")]
    )
    dream(settings)
    assert [c.status for c in _contradictions(settings)] == ["open"]
    dream(_settings(pg_settings, detect_contradictions=False))
    with session_scope(settings) as session:
        session.add(Policy(agent_id="b", config={"detectContradictions": False}))
    dream(settings)
    assert [c.status for c in _contradictions(settings)] == ["open"]
    assert {r["conflicted"] for r in entries_of(settings, "u1").values()} == {True}
    # Looked at again, and made to agree: closed.
    with session_scope(settings) as session:
        session.execute(delete(Policy))
        table = table_for(settings)
        session.execute(update(table).where(table.c.id == de["id"]).values(value="English"))
    dream(settings)
    assert [c.status for c in _contradictions(settings)] == ["closed"]
    assert {r["conflicted"] for r in entries_of(settings, "u1").values()} == {False}
    assert en["id"] in entries_of(settings, "u1")


@pytest.mark.parametrize("chunked", [False, True])
def test_with_detection_off_a_user_with_new_keys_costs_no_key_matching(pg_settings: Settings, chunked: bool) -> None:
    # Detection off everywhere: the key-matching model is never run for the user's keys
    # (a user with thousands of keys would pay for it at every dream, for nothing).
    settings = _settings(pg_settings, key_matching="embedding", detect_contradictions=False)
    seed(settings, [entry("u1", "birthday", "1990-01-01"), entry("u1", "date_of_birth", "1991-02-02", agent="b")])
    forget_matchers()
    matcher = get_matcher(settings)
    assert matcher.embedder is not None
    outcomes = dream_users(settings, ["u1"]) if chunked else [dream_user(settings, "u1")]
    assert [(o.status, o.contradictions_found) for o in outcomes] == [("succeeded", 0)]
    assert matcher.embedder.inferences == 0
    assert _contradictions(settings) == []
    # Turned on, the same dream finds the contradiction.
    on = _settings(pg_settings, key_matching="embedding")
    outcomes = dream_users(on, ["u1"]) if chunked else [dream_user(on, "u1")]
    assert [o.contradictions_found for o in outcomes] == [1]
    forget_matchers()


@pytest.mark.parametrize("chunked", [False, True])
def test_with_detection_off_a_contradiction_whose_rows_are_gone_is_still_closed(
    pg_settings: Settings, chunked: bool
) -> None:
    settings = _settings(pg_settings)
    seed(settings, [entry("u1", "language", "English", agent="a"), entry("u1", "language", "German", agent="b")])
    dream_user(settings, "u1")
    assert [c.status for c in _contradictions(settings)] == ["open"]
    with session_scope(settings) as session:
        table = table_for(settings)
        session.execute(delete(table).where(table.c.user_id == "u1"))
    off = _settings(pg_settings, detect_contradictions=False)
    if chunked:
        dream_users(off, ["u1"])
    else:
        dream_user(off, "u1")
    assert [c.status for c in _contradictions(settings)] == ["closed"]


@pytest.mark.parametrize("missing", ["null", "-infinity"])
def test_a_zoned_table_with_a_row_without_times_still_dreams_its_contradiction(
    zoned_settings: Settings, missing: str
) -> None:
    """A host table whose times carry a zone, one row of a contradiction with no time
    (NULL, or one past Python's range): the two are ordered, not a TypeError each pass."""
    from sqlalchemy import text

    settings = zoned_settings.model_copy(update={"summarize_interactions": False})
    seed(
        settings,
        [entry("u1", "birthday", "1990-01-01", agent="a1"), entry("u1", "birthday", "1991-02-02", agent="a2")],
    )
    with session_scope(settings) as session:
        session.execute(
            text(
                "UPDATE zoned SET created_at = CAST(:t AS timestamptz), updated_at = CAST(:t AS timestamptz), "
                "access_count = 3 WHERE value = '\"1990-01-01\"'"
            ),
            {"t": None if missing == "null" else missing},
        )
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded", outcome
    assert outcome.contradictions_found == 1
