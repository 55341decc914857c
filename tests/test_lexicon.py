"""The concept lexicon: synonyms are one key by the rules, contrasts veto even the model,
and the matcher's precision and recall hold on pairs it was not tuned on."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from bench.key_matching import labelled_sets, score
from worker.errors import LexiconInvalid
from worker.keymatch import KeyMatcher, forget_matchers, get_matcher, lexicon, rules
from worker.settings import Settings

# The look-alike synonyms hosted models use for one concept.
SYNONYMS = [
    ("role", "job_title"),
    ("occupation", "job"),
    ("given_name", "first_name"),
    ("family_name", "surname"),
    ("favorite_dish", "favorite_food"),
    ("office_city", "work_city"),
    ("residence_city", "home_city"),
    ("current_city", "city_of_residence"),
    ("preferred_color", "favourite_colour"),
    ("company", "employer_name"),
    ("date_of_birth", "birthday"),
    ("mom_name", "mother_name"),
    ("grandma_name", "grandmother_name"),
    ("office_phone", "work_mobile"),
]
# Home side against work side, first against last, and other contrasts the model scores high.
CONTRASTS = [
    ("residence_city", "work_city"),
    ("current_city", "office_city"),
    ("residence_city", "office_city"),
    ("home_address", "office_address"),
    ("given_name", "family_name"),
    ("first_name", "surname"),
    ("wife_name", "husband_name"),
    ("mother_name", "father_name"),
    ("dog_name", "cat_name"),
    ("start_date", "end_date"),
    ("min_budget", "max_budget"),
    ("older_brother", "younger_brother"),
    ("ex_wife", "wife"),
    ("mother_in_law_name", "mother_name"),
    ("previous_city", "current_city"),
    ("birthplace", "home_city"),
    ("check_in_date", "check_out_date"),
]


@pytest.mark.parametrize(("a", "b"), SYNONYMS)
def test_lexicon_synonyms_are_one_key_by_the_rules_alone(a: str, b: str) -> None:
    matcher = KeyMatcher(mode="rules")
    assert matcher.normalise(a) == matcher.normalise(b)
    assert matcher.same(a, b)
    assert matcher.find(a, ["unrelated", b]) == b


@pytest.mark.parametrize(("a", "b"), CONTRASTS)
def test_lexicon_contrasts_are_never_one_key(a: str, b: str) -> None:
    matcher = KeyMatcher(mode="rules")
    assert matcher.contrasting(matcher.normalise(a), matcher.normalise(b))
    assert not matcher.same(a, b)


def test_words_alone_are_a_job_only_when_they_are_the_whole_key() -> None:
    matcher = KeyMatcher(mode="rules")
    assert matcher.normalise("role") == matcher.normalise("position") == "job_title"
    assert matcher.normalise("role_model") == "role_model"
    assert matcher.normalise("sleeping_position") == "sleeping_position"
    # A word in `terms` is rewritten anywhere; "mail" is not e-mail.
    assert matcher.normalise("previous_occupation") == "previous_job_title"
    assert matcher.normalise("mailing_address") == "mailing_address"


def test_rules_form_with_the_lexicon_is_stable_when_applied_again() -> None:
    matcher = KeyMatcher(mode="rules")
    built_in = lexicon.load()
    phrases = [*built_in.terms, *built_in.alone, *lexicon.concepts(built_in)]
    assert len(phrases) > 100
    for words in phrases:
        key = "_".join(words)
        once = matcher.normalise(key)
        assert matcher.normalise(once) == once, key


def test_synonyms_can_be_turned_off_and_the_contrasts_stay() -> None:
    forget_matchers()
    matcher = get_matcher(Settings(key_matching="rules", key_lexicon=False))
    assert not matcher.same("role", "job_title")
    assert not matcher.same("given_name", "first_name")
    assert matcher.contrasting("residence_city", "work_city")
    assert matcher.same("favourite_colour", "favorite_color")
    forget_matchers()


def test_another_lexicon_file_replaces_the_built_in_one(tmp_path: Path) -> None:
    path = tmp_path / "lexicon.toml"
    path.write_text(
        '[[same]]\nas = "shoe size"\nterms = ["foot size"]\n\n[[contrast]]\nsides = [["home"], ["work"]]\n',
        encoding="utf-8",
    )
    forget_matchers()
    matcher = get_matcher(Settings(key_matching="rules", key_lexicon_path=str(path)))
    assert matcher.same("foot_size", "shoe_size")
    assert not matcher.same("role", "job_title")
    assert not matcher.same("home_city", "work_city")
    forget_matchers()
    broken = tmp_path / "broken.toml"
    broken.write_text('[[same]]\nas = "x"\nterms = "not a list"\n', encoding="utf-8")
    # Refused with the settings, so a worker or a command stops at start with one line.
    with pytest.raises(ValidationError, match="terms must be a list"):
        Settings(key_matching="rules", key_lexicon_path=str(broken))
    with pytest.raises(ValidationError, match="cannot be read"):
        Settings(key_lexicon_path=str(tmp_path / "missing.toml"))
    forget_matchers()


def test_a_phrase_under_two_concepts_is_refused(tmp_path: Path) -> None:
    document = {"same": [{"as": "first name", "terms": ["given name"]}, {"as": "nickname", "terms": ["given name"]}]}
    with pytest.raises(LexiconInvalid, match="two concepts"):
        lexicon.parse(document, tmp_path / "lexicon.toml")


def test_contrasts_are_checked_without_a_lexicon_argument_too() -> None:
    assert rules.contrasting("home_city", "work_city")
    assert rules.contrasting("gross_salary", "net_salary")
    assert not rules.contrasting("favorite_color", "favourite_colour")


# -- with the local model ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_matcher() -> KeyMatcher:
    forget_matchers()
    matcher = get_matcher(Settings(key_matching="embedding"))
    assert matcher.embedder is not None, "the key-matching model did not load"
    return matcher


@pytest.mark.parametrize(("a", "b"), CONTRASTS)
def test_the_model_never_joins_what_the_lexicon_keeps_apart(model_matcher: KeyMatcher, a: str, b: str) -> None:
    assert not model_matcher.same(a, b)
    assert model_matcher.find(a, [b, "favorite_book"]) is None


def test_work_city_is_never_found_for_a_home_side_key(model_matcher: KeyMatcher) -> None:
    existing = ["residence_city", "current_city", "home_address"]
    for proposed in ("work_city", "office_city", "city_of_work", "workplace_city"):
        assert model_matcher.find(proposed, existing) is None, proposed
    assert model_matcher.find("office_city", [*existing, "work_city"]) == "work_city"


# Floors set from the measurement (calibration 25/25, held-out 26/40, blind 19/22, no
# look-alike pair joined): a little room for a model update, far above the rules alone
# (23/25, 9/40, 1/22), and no room at all for a wrong match.
FLOORS = {"calibration": 0.92, "held-out": 0.60, "blind": 0.80}


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_labelled_sets_keep_total_precision_and_their_recall_floor(model_matcher: KeyMatcher, name: str) -> None:
    same, different = labelled_sets()[name]
    got = score(model_matcher, same, different)
    wrong = [pair for pair in different if model_matcher.same(*pair)]
    assert wrong == [], f"{name}: look-alike keys joined: {wrong}"
    assert got.recall >= FLOORS[name], f"{name}: recall {got.found}/{got.same}"
    rules_only = score(KeyMatcher(mode="rules"), same, different)
    assert rules_only.wrong == 0
    assert got.found > rules_only.found
