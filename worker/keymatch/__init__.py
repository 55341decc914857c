"""Memory keys matched by meaning, at no model cost.

One matcher answers "do these two keys name the same fact about the user?" for every
place that compares keys: writes, contradiction detection and feedback recurrence.

- Rules first (:mod:`worker.keymatch.rules`): case, separators, British and American
  spelling, plurals and common abbreviations make ``Favourite-Colours`` and
  ``favorite_color`` one key; the concept lexicon (:mod:`worker.keymatch.lexicon`)
  writes synonyms as their concept (``role`` -> ``job_title``, ``office_city`` ->
  ``work_city``), so those are one key too. Keys that differ in a contrasting word
  (``first_name`` / ``last_name``, ``home_city`` / ``work_city``, ``residence_city`` /
  ``office_city``) are never one key.
- Then, where the rules leave it open, a small local embedding model
  (:mod:`worker.keymatch.embedding`) compares short phrases about the user built from
  the keys (``the user's home city``): at or above ``key_match_threshold`` they are one
  key; keys that share words but are about another thing (``favorite_movie`` /
  ``favorite_book``) need ``key_match_strict_threshold``. The model learned English:
  keys in another script, or without a letter or digit, are left to the rules
  (:func:`readable`).

With ``REVERIE_KEY_MATCHING=rules`` (or when the model cannot be loaded) the rules
alone decide; with ``off`` keys match only when equal after case and separators.

Vectors are kept per rules form, in memory and (through :mod:`store.key_vectors`) in
``dream_key_vectors``, so a key is run through the model once.

This package is part of the kernel: it imports nothing from the Celery app, the CLI
or the demo.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog

from worker.errors import KeyModelUnavailable, LexiconInvalid
from worker.keymatch import lexicon as lexicons
from worker.keymatch import rules
from worker.keymatch.lexicon import Lexicon
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.keymatch.embedding import Embedder, Vectors

Mode = Literal["embedding", "rules", "off"]

log = structlog.get_logger("reverie.keymatch")

_SEPARATORS = re.compile(r"[\s_.\-]+")
# Keys a process remembers vectors for; beyond it the memory starts again (about 1.5 KB each).
MEMORY_VECTORS = 20_000
#: Each new key is weighed against its this many closest known keys at most (those over
#: the threshold): a key means the same as a handful of others, and a family of look-alike
#: keys (``note_1`` ... ``note_5000``) would otherwise be weighed pair by pair. Look-alikes
#: the rules then refuse (``diet_1`` ... beside ``diet``) take places too: a true match
#: is missed only behind more than this many of them closer to the key than it is.
NEIGHBOURS = 64
#: New keys are scored against the known ones this many at a time (memory: a block of
#: scores, not one for every pair).
SCORE_BLOCK = 256


def _plain(key: str) -> str:
    """Case and separators only: how keys were compared before any matching."""
    return _SEPARATORS.sub("_", key.strip().lower()).strip("_")


@lru_cache(maxsize=65_536)
def readable(norm: str) -> bool:
    """Whether the model can read a key in rules form for its meaning: it holds a letter
    or digit, and every letter is of the Latin script. The built-in model learned
    English: it reads ``город`` and ``профессия`` as strings of single letters, and
    an emoji or ``___`` as nothing, so any two such keys look alike to it. Keys it
    cannot read match by their rules form only."""
    if not any(ch.isalnum() for ch in norm):
        return False
    return all(not ch.isalpha() or unicodedata.name(ch, "").startswith("LATIN") for ch in norm)


class KeyMatcher:
    """Decides whether keys mean the same fact. Safe to share between threads.

    Without an embedder (``mode`` ``rules`` or ``off``, or a model that failed to load)
    only the rules match keys.
    """

    def __init__(
        self,
        *,
        mode: Mode = "rules",
        embedder: Embedder | None = None,
        threshold: float = 0.70,
        strict_threshold: float = 0.90,
        lexicon: Lexicon | None = None,
    ) -> None:
        self.mode: Mode = mode
        #: Synonyms and contrasts (default: the built-in lexicon, synonyms on).
        self.lexicon = lexicon if lexicon is not None else lexicons.load()
        self._forms: dict[str, str] = {}
        self.embedder = embedder if mode == "embedding" else None
        self.threshold = threshold
        self.strict_threshold = strict_threshold
        self._lock = threading.Lock()
        #: Rules forms whose vectors were computed here and not stored (see :meth:`hold_back`).
        self._unstored: set[str] = set()
        # Every rules form with a vector: its row in ``_matrix``, and the known rules forms
        # it matches (with their similarity), found once when it was added.
        self._norms: list[str] = []
        self._index: dict[str, int] = {}
        self._matrix: Any = None
        self._matches: dict[str, dict[str, float]] = {}

    # -- the rules ------------------------------------------------------------------

    def normalise(self, key: str) -> str:
        """The key's rules form (``Date-Of-Birth``, ``DOB`` -> ``birthday``, ``role`` ->
        ``job_title``); under ``off``, only case and separators are normalised."""
        if self.mode == "off":
            return _plain(key)
        found = self._forms.get(key)
        if found is None:
            if len(self._forms) >= MEMORY_VECTORS:
                self._forms = {}
            words = self.lexicon.canonical(rules.words(key))
            found = self._forms[key] = "_".join(words) if words else key.strip().lower()
        return found

    def contrasting(self, a: str, b: str) -> bool:
        """True when keys in rules form differ in a word that names another fact."""
        return rules.contrasting(a, b, self.lexicon)

    @staticmethod
    def phrase(norm: str) -> str:
        """What the model embeds for a key in rules form: a phrase about the user."""
        return "the user's " + norm.replace("_", " ")

    # -- vectors --------------------------------------------------------------------

    @property
    def model_id(self) -> str | None:
        """Names the model and phrase form that vectors come from (None: rules only)."""
        return None if self.embedder is None else self.embedder.model_id

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The rules forms of ``keys`` that have no vector in this process yet."""
        if self.embedder is None:
            return []
        with self._lock:
            return sorted({n for n in map(self.normalise, keys) if n not in self._index})

    def hold_back(self, norms: Iterable[str]) -> None:
        """Note rules forms whose vectors this process computed and did not store (keys a
        signal proposed): :meth:`held_back` hands them out once a row holds the key."""
        with self._lock:
            self._unstored.update(n for n in norms if n in self._index)

    def held_back(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The vectors held back (:meth:`hold_back`) of these keys' rules forms, as bytes
        for the cache table. They stay held back until :meth:`stored` says they were
        stored (the write's transaction may still roll back)."""
        if not self._unstored:
            return {}
        with self._lock:
            forms = {n for n in map(self.normalise, keys) if n in self._unstored and n in self._index}
            return {n: self._matrix[self._index[n]].tobytes() for n in sorted(forms)}

    def stored(self, forms: Iterable[str]) -> None:
        """Vectors of :meth:`held_back` that a committed transaction stored: not held back any more."""
        with self._lock:
            self._unstored.difference_update(forms)

    def remember(self, vectors: Mapping[str, bytes]) -> None:
        """Take vectors (rules form -> float32 bytes) read from the cache table."""
        if self.embedder is None or not vectors:
            return
        import numpy as np

        norms = sorted(vectors)
        self._add(norms, np.stack([np.frombuffer(vectors[n], dtype=np.float32) for n in norms]))

    def embed(self, norms: Iterable[str]) -> dict[str, bytes]:
        """Run the model on rules forms it has no vector for; returns the new vectors as
        bytes (for the cache table) and remembers them."""
        if self.embedder is None:
            return {}
        todo = self.missing(norms)
        if not todo:
            return {}
        from worker import metrics

        computed = self.embedder.embed([self.phrase(n) for n in todo])
        metrics.KEY_EMBEDDINGS.inc(len(todo))
        self._add(todo, computed)
        return {norm: vector.tobytes() for norm, vector in zip(todo, computed, strict=True)}

    def _add(self, norms: list[str], vectors: Vectors) -> None:
        """Remember vectors and find, once, which known keys each new one matches: the
        answers below are then lookups, however many users share the keys."""
        import numpy as np

        with self._lock:
            fresh = [i for i, n in enumerate(norms) if n not in self._index]
            if not fresh:
                return
            if len(self._norms) + len(fresh) > MEMORY_VECTORS:
                self._norms, self._index, self._matches = [], {}, {}
                self._unstored = set()
            new_norms = [norms[i] for i in fresh]
            base = len(self._norms)
            added = np.asarray(vectors[fresh], dtype=np.float32)
            self._matrix = np.vstack([self._matrix, added]) if base else added
            for offset, norm in enumerate(new_norms):
                self._norms.append(norm)
                self._index[norm] = base + offset
                self._matches[norm] = {}
            lowest = min(self.threshold, self.strict_threshold)
            known = self._matrix.T
            for start in range(0, len(new_norms), SCORE_BLOCK):
                scores = self._matrix[base + start : base + start + SCORE_BLOCK] @ known
                if scores.shape[1] > NEIGHBOURS + 1:
                    # Each row's closest keys (itself among them), in no order.
                    closest = np.argpartition(scores, -(NEIGHBOURS + 1), axis=1)[:, -(NEIGHBOURS + 1) :]
                else:
                    closest = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
                picked = np.take_along_axis(scores, closest, axis=1)
                for row, at in zip(*np.nonzero(picked >= lowest), strict=True):
                    a, b = new_norms[start + row], self._norms[closest[row, at]]
                    score = float(picked[row, at])
                    if a != b and self._decide(a, b, score):
                        self._matches[a][b] = score
                        self._matches[b][a] = score

    def _ensure(self, norms: Iterable[str]) -> None:
        """Vectors for rules forms not seen yet (a model run, not stored in the table)."""
        if self.embedder is not None:
            self.embed(norms)

    # -- answers --------------------------------------------------------------------

    def _decide(self, a: str, b: str, similarity: float | None) -> bool:
        """``a`` and ``b`` in rules form, different; ``similarity`` None: rules only."""
        if similarity is None or not (readable(a) and readable(b)) or self.contrasting(a, b):
            return False
        needed = self.strict_threshold if rules.other_slot(a, b) else self.threshold
        return similarity >= needed

    def similarity(self, a: str, b: str) -> float | None:
        """Cosine similarity of the phrases about two keys (None: no model)."""
        if self.embedder is None:
            return None
        na, nb = self.normalise(a), self.normalise(b)
        self._ensure([na, nb])
        with self._lock:
            return float(self._matrix[self._index[na]] @ self._matrix[self._index[nb]])

    def _matched(self, norm: str) -> dict[str, float]:
        with self._lock:
            return dict(self._matches.get(norm, {}))

    def same(self, a: str, b: str) -> bool:
        """True when the two keys mean the same fact about the user."""
        na, nb = self.normalise(a), self.normalise(b)
        if a == b or na == nb:
            return True
        if self.embedder is None or self.contrasting(na, nb):
            return False
        self._ensure([na, nb])
        return nb in self._matched(na)

    def find(self, proposed: str, existing: Sequence[str]) -> str | None:
        """The key of ``existing`` that means ``proposed`` (the best match: the identical
        key, else one with the same rules form, else the closest by meaning), or None.

        Costs one model run for each rules form never seen before (none for keys whose
        vectors were read from the cache table), then a lookup."""
        if proposed in existing:
            return proposed
        norm = self.normalise(proposed)
        norms = [self.normalise(key) for key in existing]
        for key, other in zip(existing, norms, strict=True):
            if other == norm:
                return key
        if self.embedder is None or not existing:
            return None
        self._ensure([norm, *norms])
        matched = self._matched(norm)
        scored = [(matched[other], key) for key, other in zip(existing, norms, strict=True) if other in matched]
        return max(scored, key=lambda pair: pair[0])[1] if scored else None

    def groups(self, keys: Sequence[str]) -> dict[str, str]:
        """Each key -> the representative key of its meaning-group (the group's smallest
        key by rules form, then by spelling, so the choice does not depend on order).

        Keys with one rules form are one group; with the model, two groups join only
        when every pair across them matches, so ``name`` cannot chain ``first_name`` to
        ``last_name``."""
        norm_of = {key: self.normalise(key) for key in keys}
        by_norm: dict[str, list[str]] = {}
        for key, norm in norm_of.items():
            by_norm.setdefault(norm, []).append(key)
        representative: dict[str, str] = {}
        clusters = self._cluster(list(by_norm)) if self.embedder is not None and len(by_norm) > 1 else None
        if clusters is None:
            for group in by_norm.values():
                representative.update(dict.fromkeys(group, min(group)))
            return representative
        for cluster in clusters:
            members = [key for norm in cluster for key in by_norm[norm]]
            chosen = min(members, key=lambda k: (norm_of[k], k))
            representative.update(dict.fromkeys(members, chosen))
        return representative

    def _cluster(self, norms: list[str]) -> list[list[str]] | None:
        """Complete-link groups of rules forms (None: no two of them match)."""
        self._ensure(norms)
        present = set(norms)
        with self._lock:
            linked = [a for a in norms if (found := self._matches.get(a)) and not present.isdisjoint(found)]
            if not linked:
                return None
            edges = sorted(
                (
                    (-score, a, b)
                    for a in norms
                    for b, score in self._matches.get(a, {}).items()
                    if b in present and a < b
                ),
            )
            matches = {a: set(self._matches.get(a, {})) for a in norms}
        cluster_of = {n: n for n in norms}
        members: dict[str, list[str]] = {n: [n] for n in norms}
        for _, a, b in edges:
            ca, cb = cluster_of[a], cluster_of[b]
            if ca == cb:
                continue
            if all(y in matches[x] for x in members[ca] for y in members[cb]):
                for y in members.pop(cb):
                    cluster_of[y] = ca
                    members[ca].append(y)
        return [sorted(group) for group in members.values()]


_lock = threading.Lock()
_matchers: dict[tuple[object, ...], KeyMatcher] = {}
_warned: set[tuple[object, ...]] = set()


def _load_embedder(settings: Settings) -> Embedder | None:
    ident = ("model", settings.key_matching_model_path)
    try:
        from worker.keymatch.embedding import Embedder

        path = Path(settings.key_matching_model_path) if settings.key_matching_model_path else None
        return Embedder(path)
    except ImportError as exc:
        failure = KeyModelUnavailable("runtime", f"{exc.name or 'numpy'} is not installed")
    except KeyModelUnavailable as exc:
        failure = exc
    from worker import metrics

    metrics.KEY_MODEL_UNAVAILABLE.labels(failure.reason).inc()
    if ident not in _warned:
        _warned.add(ident)
        log.warning("key matching falls back to rules", reason=failure.reason, detail=failure.detail)
    return None


def get_matcher(settings: Settings) -> KeyMatcher:
    """The process-wide matcher for these settings, built (and its model loaded) once.

    A model that cannot be loaded leaves a rules-only matcher, a warning in the log and
    a count in ``dream_key_model_unavailable_total``; it never raises for the model. A
    lexicon file (``key_lexicon_path``) that cannot be read raises :class:`LexiconInvalid`."""
    ident: tuple[object, ...] = (
        settings.key_matching,
        settings.key_match_threshold,
        settings.key_match_strict_threshold,
        settings.key_matching_model_path,
        settings.key_lexicon,
        settings.key_lexicon_path,
    )
    with _lock:
        matcher = _matchers.get(ident)
        if matcher is None:
            lexicon = lexicons.load(settings.key_lexicon_path)
            embedder = _load_embedder(settings) if settings.key_matching == "embedding" else None
            matcher = _matchers[ident] = KeyMatcher(
                mode=settings.key_matching,
                embedder=embedder,
                threshold=settings.key_match_threshold,
                strict_threshold=settings.key_match_strict_threshold,
                lexicon=lexicon if settings.key_lexicon else lexicon.without_synonyms(),
            )
        return matcher


def key_forms(settings: Settings) -> Callable[[str], set[str]]:
    """The forms a key's vectors may be kept under, without loading the model: its rules
    form under the settings' lexicon and the built-in one, with synonyms and without
    (the settings may have changed since a vector was stored), and its plain form. A
    lexicon file that cannot be read is left out (the built-in one is not)."""
    built_in = lexicons.load(None)
    lexicons_ = [built_in, built_in.without_synonyms()]
    if settings.key_lexicon_path:
        try:
            own = lexicons.load(settings.key_lexicon_path)
        except LexiconInvalid:
            log.warning("key forms without the lexicon file", reason="lexicon_invalid")
        else:
            lexicons_ += [own, own.without_synonyms()]
    matchers = [KeyMatcher(mode="rules", lexicon=lexicon) for lexicon in lexicons_]

    def forms(key: str) -> set[str]:
        return {_plain(key), *(matcher.normalise(key) for matcher in matchers)}

    return forms


def forget_matchers() -> None:
    """Drop the process's matchers (the next :func:`get_matcher` loads again)."""
    with _lock:
        _matchers.clear()
        _warned.clear()
