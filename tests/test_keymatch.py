"""Key matching: the rules form, the contrast-word veto, and the matcher's answers."""

from __future__ import annotations

import pytest

from worker.keymatch import KeyMatcher, rules


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("favorite_color", "Favourite-Colours"),
        ("favorite_color", "favoriteColor"),
        ("favorite_color", "fav colour"),
        ("date_of_birth", "DOB"),
        ("timezone", "time_zone"),
        ("timezone", "TZ"),
        ("hobby", "Hobbies"),
        ("phone_number", "mobile no"),
        ("neighborhood", "neighbourhoods"),
        ("last_name", "surname"),
    ],
)
def test_rules_make_one_key_of_case_separators_spelling_plurals_and_abbreviations(a: str, b: str) -> None:
    assert rules.normalise(a) == rules.normalise(b)
    matcher = KeyMatcher(mode="rules")
    assert matcher.same(a, b)
    assert matcher.find(b, ["unrelated", a]) == a


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("first_name", "last_name"),
        ("home_city", "work_city"),
        ("dog_name", "cat_name"),
        ("start_date", "end_date"),
        ("min_temperature", "max_temperature"),
        ("previous_employer", "current_employer"),
        ("favorite_food", "least_favorite_food"),
        ("phone_1", "phone_2"),
        ("mother_name", "father_name"),
    ],
)
def test_keys_that_differ_in_a_contrasting_word_never_match(a: str, b: str) -> None:
    assert rules.contrasting(a, b)
    assert not KeyMatcher(mode="rules").same(a, b)


def test_keys_that_only_share_words_are_not_vetoed() -> None:
    assert not rules.contrasting("home_city", "city")
    assert not rules.contrasting("birthday", "date_of_birth")
    assert not rules.contrasting("favorite_color", "favourite_colour")


def test_find_prefers_the_identical_key_and_answers_none_without_a_match() -> None:
    matcher = KeyMatcher(mode="rules")
    assert matcher.find("Favorite_Color", ["favorite_color", "Favorite_Color"]) == "Favorite_Color"
    assert matcher.find("shoe_size", ["favorite_color", "home_city"]) is None
    assert matcher.find("anything", []) is None


def test_groups_pick_one_representative_whatever_the_order() -> None:
    matcher = KeyMatcher(mode="rules")
    keys = ["Favourite-Colour", "favorite_color", "first_name", "last_name", "FavoriteColors"]
    forward = matcher.groups(keys)
    backward = matcher.groups(list(reversed(keys)))
    assert forward == backward
    assert len({forward[k] for k in ("Favourite-Colour", "favorite_color", "FavoriteColors")}) == 1
    assert forward["first_name"] == "first_name"
    assert forward["last_name"] == "last_name"


def test_off_compares_case_and_separators_only() -> None:
    matcher = KeyMatcher(mode="off")
    assert matcher.same("Favorite-Color", "favorite_color")
    assert not matcher.same("favorite_color", "favourite_colour")
    assert not matcher.same("dob", "date_of_birth")
