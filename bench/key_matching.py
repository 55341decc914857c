"""Key matching: what the local model costs, and how well it separates labelled pairs.

Loads the matcher as the worker does, then times one new key, a batch of new keys, and
``find`` against keys already seen, and scores three sets of labelled pairs with the
model and with the rules alone: the calibration set (``tests/key_pairs.py``), the
held-out set (``tests/key_pairs_heldout.py``, concepts the lexicon was not written
for) and the blind set (``tests/key_pairs_blind.py``, written after the lexicon).

    python -m bench.key_matching [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.table import Row, render

if TYPE_CHECKING:
    from worker.keymatch import KeyMatcher

BATCH = 1000
QUICK_BATCH = 100


Pairs = tuple[tuple[str, str], ...]


def labelled_sets() -> dict[str, tuple[Pairs, Pairs]]:
    """Set name -> (pairs that mean the same, look-alike pairs that do not)."""
    from tests import key_pairs, key_pairs_blind, key_pairs_heldout

    return {
        "calibration": (key_pairs.SAME, key_pairs.DIFFERENT),
        "held-out": (key_pairs_heldout.SAME, key_pairs_heldout.DIFFERENT),
        "blind": (key_pairs_blind.SAME, key_pairs_blind.DIFFERENT),
    }


@dataclass(frozen=True)
class Score:
    """How a matcher does on one labelled set."""

    found: int
    same: int
    wrong: int
    different: int

    @property
    def precision(self) -> float:
        return self.found / (self.found + self.wrong) if self.found + self.wrong else 1.0

    @property
    def recall(self) -> float:
        return self.found / self.same if self.same else 1.0

    @property
    def contrast_precision(self) -> float:
        """The share of look-alike pairs kept apart."""
        return 1.0 - self.wrong / self.different if self.different else 1.0


def score(matcher: KeyMatcher, same: Pairs, different: Pairs) -> Score:
    found = sum(matcher.same(a, b) for a, b in same)
    wrong = sum(matcher.same(a, b) for a, b in different)
    return Score(found, len(same), wrong, len(different))


#: Recall each set must keep with the model (precision must be total on all three).
RECALL_GOALS = {"calibration": 0.90, "held-out": 0.60, "blind": 0.80}


def measure(quick: bool) -> list[Row]:
    from worker.keymatch import get_matcher
    from worker.settings import Settings

    started = time.perf_counter()
    matcher = get_matcher(Settings(key_matching="embedding"))
    loaded = time.perf_counter() - started
    if matcher.embedder is None:
        raise RuntimeError("the key-matching model did not load; see the warning above")
    rows = [Row("K", "load the matcher (imports, digest checks, model session)", f"{loaded:.2f} s")]

    singles = [f"single key {i}" for i in range(10 if quick else 50)]
    started = time.perf_counter()
    for norm in singles:
        matcher.embed([norm])
    one = (time.perf_counter() - started) / len(singles)
    rows.append(Row("K", "one new key (one model run)", f"{one * 1000:.1f} ms"))

    batch = [f"batch_key_{i}_of_many" for i in range(QUICK_BATCH if quick else BATCH)]
    started = time.perf_counter()
    matcher.embed([matcher.normalise(k) for k in batch])
    took = time.perf_counter() - started
    rows.append(Row("K", f"{len(batch)} new keys in one batch", f"{took:.2f} s ({len(batch) / took:.0f} keys/s)"))

    existing = [*(f"known_key_{i}" for i in range(200)), "date_of_birth"]
    matcher.embed([matcher.normalise(k) for k in existing])
    started = time.perf_counter()
    for _ in range(200):
        found = matcher.find("birthday", existing)
    per_find = (time.perf_counter() - started) / 200
    rows.append(
        Row(
            "K",
            "find a key among 200 already seen",
            f"{per_find * 1000:.2f} ms",
            goal="finds date_of_birth for birthday",
            passed=found == "date_of_birth",
        )
    )

    from worker.keymatch import KeyMatcher

    rules_only = KeyMatcher(mode="rules", lexicon=matcher.lexicon)
    for set_name, (same, different) in labelled_sets().items():
        for name, candidate in (("model", matcher), ("rules alone", rules_only)):
            got = score(candidate, same, different)
            goal = RECALL_GOALS[set_name]
            rows.append(
                Row(
                    "K",
                    f"{set_name} pairs, {name}: precision / recall",
                    f"{got.precision:.0%} / {got.recall:.0%} ({got.found} of {got.same} found, "
                    f"{got.wrong} of {got.different} wrong)",
                    goal=f"100 % / >= {goal:.0%}" if name == "model" else "-",
                    passed=(got.wrong == 0 and got.recall >= goal) if name == "model" else None,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.key_matching", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer keys: a smoke run")
    args = parser.parse_args(argv)
    rows = measure(args.quick)
    print(render(rows))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
