"""The concept lexicon: words that name one concept inside memory keys, and words that never do.

Read from ``data/lexicon.toml`` (or the file ``REVERIE_KEY_LEXICON_PATH`` names) once
per process. Synonyms are written as their concept's own wording (``role`` ->
``job title``, ``office`` -> ``work``, ``given name`` -> ``first name``), so keys that
come out the same are one key by the rules. Contrast classes veto: keys that differ in
words from two sides of a class (``home``/``work``, ``first``/``last``, ``wife``/
``husband``) are never one key, whatever the model says.
"""

from __future__ import annotations

import threading
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from worker.errors import LexiconInvalid
from worker.keymatch import rules

BUILTIN_PATH = Path(__file__).parent / "data" / "lexicon.toml"
# Replacing a phrase may form another one ("preferred dish" -> "favorite food"); a few
# passes reach the fixed point of any sensible file.
_PASSES = 4

Words = tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Lexicon:
    """Synonym phrases (anywhere in a key, or only as the whole key), contrast classes
    (each a tuple of sides) and one-sided qualifiers, all in rules form."""

    terms: Mapping[Words, Words] = field(default_factory=dict)
    alone: Mapping[Words, Words] = field(default_factory=dict)
    classes: tuple[tuple[frozenset[str], ...], ...] = ()
    qualifiers: frozenset[str] = frozenset()
    _longest: int = 1

    @property
    def synonyms(self) -> int:
        """How many phrases are written as another (0: synonyms are off)."""
        return sum(k != v for k, v in self.terms.items()) + len(self.alone)

    def without_synonyms(self) -> Lexicon:
        """The same contrasts and qualifiers, no synonyms (``REVERIE_KEY_LEXICON=false``)."""
        return replace(self, terms={}, alone={}, _longest=1)

    def canonical(self, words: Words) -> Words:
        """``words`` with every synonym phrase written as its concept (longest phrase first)."""
        current = words
        for _ in range(_PASSES):
            found = self.alone.get(current)
            if found is not None:
                current = found
            after = self._replace(current)
            if after == current:
                return current
            current = after
        return current

    def _replace(self, words: Words) -> Words:
        out: list[str] = []
        i = 0
        while i < len(words):
            for size in range(min(self._longest, len(words) - i), 0, -1):
                found = self.terms.get(words[i : i + size])
                if found is not None:
                    out.extend(found)
                    i += size
                    break
            else:
                out.append(words[i])
                i += 1
        return tuple(out)

    def contrasting(self, only_a: set[str], only_b: set[str]) -> bool:
        """True when words found in one key only name another fact: a qualifier on one
        side, or words from two sides of one contrast class."""
        if (only_a & self.qualifiers) or (only_b & self.qualifiers):
            return True
        for sides in self.classes:
            hit_a = {n for n, side in enumerate(sides) if only_a & side}
            if not hit_a:
                continue
            hit_b = {n for n, side in enumerate(sides) if only_b & side}
            if hit_b and (len(hit_a | hit_b) > 1):
                return True
        return False


def _phrase(text: Any, path: Path) -> Words:
    if not isinstance(text, str) or not text.strip():
        raise LexiconInvalid(path, f"{text!r} is not a phrase")
    found = rules.words(text)
    if not found:
        raise LexiconInvalid(path, f"{text!r} holds no word")
    return found


def _strings(table: Mapping[str, Any], name: str, path: Path) -> list[Any]:
    value = table.get(name, [])
    if not isinstance(value, list):
        raise LexiconInvalid(path, f"{name} must be a list")
    return value


def parse(document: Mapping[str, Any], path: Path) -> Lexicon:
    """A lexicon from a parsed TOML document (see ``data/lexicon.toml`` for the layout)."""
    terms: dict[Words, Words] = {}
    alone: dict[Words, Words] = {}
    for group in _strings(document, "same", path):
        if not isinstance(group, dict):
            raise LexiconInvalid(path, "each [[same]] must be a table")
        concept = _phrase(group.get("as"), path)
        # The concept's own wording stands for itself, so a shorter phrase inside it is
        # not rewritten again ("zip" -> "zip code" leaves "zip code" alone).
        if len(concept) > 1:
            terms.setdefault(concept, concept)
        for target, key in ((terms, "terms"), (alone, "alone")):
            for text in _strings(group, key, path):
                phrase = _phrase(text, path)
                if target.get(phrase, concept) != concept or (phrase in terms and terms[phrase] == phrase != concept):
                    raise LexiconInvalid(path, f"{text!r} is listed under two concepts")
                if phrase != concept:
                    target[phrase] = concept
    classes: list[tuple[frozenset[str], ...]] = []
    for entry in _strings(document, "contrast", path):
        sides = entry.get("sides") if isinstance(entry, dict) else None
        if not isinstance(sides, list) or len(sides) < 2 or not all(isinstance(s, list) for s in sides):
            raise LexiconInvalid(path, "each [[contrast]] needs sides: a list of at least two lists of words")
        classes.append(tuple(frozenset(w for text in side for w in _phrase(text, path)) for side in sides))
    qualifier = document.get("qualifier", {})
    if not isinstance(qualifier, dict):
        raise LexiconInvalid(path, "[qualifier] must be a table")
    qualifiers = frozenset(w for text in _strings(qualifier, "words", path) for w in _phrase(text, path))
    longest = max((len(p) for p in terms), default=1)
    return Lexicon(terms, alone, tuple(classes), qualifiers, longest)


_lock = threading.Lock()
_loaded: dict[Path, Lexicon] = {}


def load(path: str | Path | None = None) -> Lexicon:
    """The lexicon in ``path`` (default: the built-in one), read and parsed once per process."""
    where = Path(path) if path else BUILTIN_PATH
    with _lock:
        found = _loaded.get(where)
        if found is None:
            try:
                document = tomllib.loads(where.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
                raise LexiconInvalid(where, f"cannot be read ({type(exc).__name__})") from exc
            found = _loaded[where] = parse(document, where)
        return found


def concepts(lexicon: Lexicon) -> Iterable[Words]:
    """Every concept the lexicon writes phrases as (for checks and documentation)."""
    return sorted(set(lexicon.terms.values()) | set(lexicon.alone.values()))
