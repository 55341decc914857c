"""The rules form of a memory key, and the contrast-word veto.

Rules decide what is certain at no cost: ``Favourite-Colours``, ``favoriteColor`` and
``favorite_color`` are one key; ``first_name`` and ``last_name`` never are, however
close a model finds them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.keymatch.lexicon import Lexicon

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORDS = re.compile(r"[^\W_]+", re.UNICODE)

# British spellings written the American way, so either spelling is one key.
_SPELLING = {
    "colour": "color",
    "favourite": "favorite",
    "flavour": "flavor",
    "honour": "honor",
    "humour": "humor",
    "neighbour": "neighbor",
    "neighbourhood": "neighborhood",
    "behaviour": "behavior",
    "centre": "center",
    "theatre": "theater",
    "metre": "meter",
    "litre": "liter",
    "organisation": "organization",
    "organise": "organize",
    "realise": "realize",
    "specialise": "specialize",
    "specialisation": "specialization",
    "licence": "license",
    "defence": "defense",
    "catalogue": "catalog",
    "programme": "program",
    "travelling": "traveling",
    "traveller": "traveler",
    "jewellery": "jewelry",
    "grey": "gray",
    "pyjamas": "pajamas",
    "mum": "mom",
    "cheque": "check",
    "tyre": "tire",
    "aluminium": "aluminum",
    "maths": "math",
    "postcode": "zip_code",
    "surname": "last_name",
    "forename": "first_name",
    "mobile": "phone",
    "cellphone": "phone",
    "telephone": "phone",
}

# Common abbreviations, expanded to the words they stand for (which may be several).
_ABBREVIATIONS = {
    "dob": "date_of_birth",
    "bday": "birthday",
    "tz": "timezone",
    "addr": "address",
    "tel": "phone",
    "ph": "phone",
    "fav": "favorite",
    "fave": "favorite",
    "fav's": "favorite",
    "pref": "preferred",
    "lang": "language",
    "num": "number",
    "no": "number",
    "nr": "number",
    "dept": "department",
    "org": "organization",
    "co": "company",
    "loc": "location",
    "yr": "year",
    "yrs": "year",
    "mo": "month",
    "wk": "week",
    "hr": "hour",
    "hrs": "hour",
    "mins": "minute",
    "min": "minimum",
    "max": "maximum",
    "mgr": "manager",
    "info": "information",
    "pic": "picture",
    "msg": "message",
    "ctry": "country",
    "st": "street",
    "dl": "driving_license",
    "zipcode": "zip_code",
    "ssn": "social_security_number",
    "pw": "password",
    "pwd": "password",
    "sig": "signature",
    "nick": "nickname",
    "bf": "boyfriend",
    "gf": "girlfriend",
}

# Compound spellings written as one word or two: both become one token.
_COMPOUNDS = {
    ("time", "zone"): "timezone",
    ("e", "mail"): "email",
    ("nick", "name"): "nickname",
    ("user", "name"): "username",
    ("birth", "day"): "birthday",
    ("home", "town"): "hometown",
    ("week", "end"): "weekend",
    ("cell", "phone"): "phone",
    ("mobile", "phone"): "phone",
    ("phone", "number"): "phone",
    ("check", "in"): "checkin",
    ("check", "out"): "checkout",
}

# Words whose plural is not the word plus s/es/ies, or that end in s as singular.
_IRREGULAR = {
    "children": "child",
    "people": "person",
    "men": "man",
    "women": "woman",
    "feet": "foot",
    "teeth": "tooth",
    "mice": "mouse",
    "geese": "goose",
    "wives": "wife",
    "knives": "knife",
    "lives": "life",
    "leaves": "leaf",
    "shelves": "shelf",
    "hobbies": "hobby",
    "movies": "movie",
    "cookies": "cookie",
    "series": "series",
    "species": "species",
    "news": "news",
    "glasses": "glasses",
    "clothes": "clothes",
    "pajamas": "pajamas",
    "pants": "pants",
    "jeans": "jeans",
    "sports": "sport",
    "address": "address",
    "status": "status",
    "alias": "alias",
    "bus": "bus",
    "gas": "gas",
    "yes": "yes",
    "is": "is",
    "has": "has",
    "was": "was",
    "this": "this",
    "its": "its",
    "his": "his",
    "us": "us",
    "os": "os",
    "ios": "ios",
    "macos": "macos",
    "chess": "chess",
    "dress": "dress",
    "business": "business",
    "fitness": "fitness",
    "wellness": "wellness",
    "physics": "physics",
    "politics": "politics",
    "economics": "economics",
    "mathematics": "mathematics",
    "athletics": "athletics",
    "analytics": "analytics",
    "linguistics": "linguistics",
}

# Words that name different facts when two keys differ in them (``first``/``last``,
# ``home``/``work``) are listed as contrast classes in the concept lexicon
# (``data/lexicon.toml``, :mod:`worker.keymatch.lexicon`).

# One key negates what the other states: ``favorite_food`` / ``least_favorite_food``.
_NEGATIONS = frozenset(("not", "non", "never", "least", "dis", "un", "anti", "without", "avoid", "dislike", "hate"))

# Numbered keys (``phone_1``, ``phone_2``, ``n0``, ``n1``) are different slots of one kind.
_DIGITS = re.compile(r"^\d+$")
_DIGIT_RUNS = re.compile(r"\d+")
# Short words that do carry meaning in a key, or carry none (``date_of_birth``).
_SMALL_WORDS = frozenset(
    ("of", "in", "on", "at", "to", "by", "for", "my", "is", "id", "no", "or", "and", "the", "a", "an")
)


def _singular(word: str) -> str:
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if len(word) <= 3 or word.endswith(("ss", "us", "is")):
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("tches", "nches", "rches", "shes", "xes", "zzes", "sses")):
        return word[:-2]
    if word.endswith("s"):
        return word[:-1]
    return word


def _expand(word: str) -> list[str]:
    for form in (word, _singular(word)):
        found = _ABBREVIATIONS.get(form) or _SPELLING.get(form)
        if found is not None:
            return [_SPELLING.get(w, w) for w in found.split("_")]
    return [_singular(word)]


def _join_compounds(words: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(words):
        pair = (words[i], words[i + 1]) if i + 1 < len(words) else None
        if pair is not None and pair in _COMPOUNDS:
            out.extend(_COMPOUNDS[pair].split("_"))
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


@lru_cache(maxsize=65536)
def words(key: str) -> tuple[str, ...]:
    """The key's words in rules form: lowercase, American spelling, singular, abbreviations
    expanded (``DOB`` -> ``date of birth``), compounds joined (``time zone`` -> ``timezone``)."""
    split = _CAMEL.sub(" ", key.strip())
    raw = [w.lower() for w in _WORDS.findall(split)]
    expanded: list[str] = []
    for word in _join_compounds(raw):
        expanded.extend(_expand(word))
    # A compound may only appear once abbreviations are expanded (``e mail``, ``tel no``).
    return tuple(_join_compounds(expanded))


@lru_cache(maxsize=65536)
def normalise(key: str) -> str:
    """The rules form of a key: its :func:`words` joined by ``_`` (the key itself,
    lowercased and trimmed, when it holds no letter or digit)."""
    found = words(key)
    return "_".join(found) if found else key.strip().lower()


def contrasting(a: str, b: str, lexicon: Lexicon | None = None) -> bool:
    """True when the keys differ in a word that names a different fact (``first``/``last``,
    ``home``/``work``, ``dog``/``cat``, ``start``/``end``, ``minimum``/``maximum``, a
    negation, a number): such keys never mean the same, whatever their similarity.

    ``lexicon`` gives the contrast classes and qualifiers (default: the built-in one)."""
    # Numbers count in order, inside words too: ``n0``/``n1``, ``note_0_1``/``note_1_0``.
    if _DIGIT_RUNS.findall("_".join(words(a))) != _DIGIT_RUNS.findall("_".join(words(b))):
        return True
    wa, wb = set(words(a)), set(words(b))
    only_a, only_b = wa - wb, wb - wa
    if not only_a and not only_b:
        return False
    # A differing word of one or two letters (``a0``/``b0``, ``x``/``y``) carries no
    # meaning a model can judge: such keys are matched by the rules alone.
    if any(sum(c.isalpha() for c in w) < 3 and w not in _SMALL_WORDS for w in only_a | only_b):
        return True
    if (only_a & _NEGATIONS) or (only_b & _NEGATIONS):
        return True
    if any(_DIGITS.match(w) for w in only_a | only_b):
        return True
    if lexicon is None:
        from worker.keymatch.lexicon import load

        lexicon = load()
    return lexicon.contrasting(only_a, only_b)


def head(key: str) -> str:
    """The word a key is about: the last one, or the one before ``of`` (``date_of_birth``)."""
    found = words(key)
    if "of" in found[1:]:
        return found[found.index("of") - 1]
    return found[-1] if found else ""


def other_slot(a: str, b: str) -> bool:
    """True when the keys share words but are about different things: the same frame with
    another slot (``favorite_movie`` / ``favorite_book``), or the same thing with another
    modifier on each side (``gross_salary`` / ``net_salary``, ``dog_breed`` /
    ``cat_breed``). Usually another fact; a model must be surer to join them."""
    wa, wb = set(words(a)), set(words(b))
    ha, hb = head(a), head(b)
    if not wa & wb:
        return False
    if ha != hb:
        return ha not in wb and hb not in wa
    return bool((wa - wb - _SMALL_WORDS) and (wb - wa - _SMALL_WORDS))
