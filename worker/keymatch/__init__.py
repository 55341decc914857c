"""Memory keys matched by meaning, at no model cost.

One matcher answers "do these two keys name the same fact about the user?" for every
place that compares keys: writes, contradiction detection and feedback recurrence.

- Rules first (:mod:`worker.keymatch.rules`): case, separators, British and American
  spelling, plurals and common abbreviations make ``Favourite-Colours`` and
  ``favorite_color`` one key. Keys that differ in a contrasting word (``first_name`` /
  ``last_name``, ``home_city`` / ``work_city``) are never one key.
- Then, where the rules leave it open, a small local embedding model compares short
  phrases about the user built from the keys (``the user's home city``).

With ``REVERIE_KEY_MATCHING=rules`` (or when the model cannot be loaded) the rules
alone decide; with ``off`` keys match only when equal after case and separators.

This package is part of the kernel: it imports nothing from the Celery app, the CLI
or the demo.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Literal

from worker.keymatch import rules
from worker.settings import Settings

Mode = Literal["embedding", "rules", "off"]

_SEPARATORS = re.compile(r"[\s_.\-]+")


def _plain(key: str) -> str:
    """Case and separators only: how keys were compared before any matching."""
    return _SEPARATORS.sub("_", key.strip().lower()).strip("_")


class KeyMatcher:
    """Decides whether keys mean the same fact. Safe to share between threads."""

    def __init__(self, *, mode: Mode = "rules") -> None:
        self.mode: Mode = mode

    def normalise(self, key: str) -> str:
        """The key's rules form (``Date-Of-Birth``, ``DOB`` -> ``date_of_birth``);
        under ``off``, only case and separators are normalised."""
        if self.mode == "off":
            return _plain(key)
        return rules.normalise(key)

    def same(self, a: str, b: str) -> bool:
        """True when the two keys mean the same fact about the user."""
        return a == b or self.normalise(a) == self.normalise(b)

    def find(self, proposed: str, existing: Sequence[str]) -> str | None:
        """The key of ``existing`` that means ``proposed`` (the best match: the identical
        key, else one with the same rules form, else the closest by meaning), or None."""
        if proposed in existing:
            return proposed
        norm = self.normalise(proposed)
        for key in existing:
            if self.normalise(key) == norm:
                return key
        return None

    def groups(self, keys: Sequence[str]) -> dict[str, str]:
        """Each key -> the representative key of its meaning-group (the group's smallest
        key by rules form, then by spelling, so the choice does not depend on order)."""
        distinct = sorted(set(keys), key=lambda k: (self.normalise(k), k))
        representative: dict[str, str] = {}
        by_norm: dict[str, str] = {}
        for key in distinct:
            norm = self.normalise(key)
            representative[key] = by_norm.setdefault(norm, key)
        return representative


_lock = threading.Lock()
_matchers: dict[tuple[object, ...], KeyMatcher] = {}


def get_matcher(settings: Settings) -> KeyMatcher:
    """The process-wide matcher for these settings, built (and its model loaded) once."""
    mode: Mode = "off" if settings.key_matching == "off" else "rules"
    ident: tuple[object, ...] = (mode,)
    with _lock:
        matcher = _matchers.get(ident)
        if matcher is None:
            matcher = _matchers[ident] = KeyMatcher(mode=mode)
        return matcher
