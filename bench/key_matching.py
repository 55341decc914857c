"""Key matching: what the local model costs, and how well it separates labelled pairs.

Loads the matcher as the worker does, then times one new key, a batch of new keys, and
``find`` against keys already seen, and scores the labelled pairs of
``tests/key_pairs.py`` with the model and with the rules alone.

    python -m bench.key_matching [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.table import Row, render

BATCH = 1000
QUICK_BATCH = 100


def measure(quick: bool) -> list[Row]:
    from tests.key_pairs import DIFFERENT, SAME
    from worker.keymatch import KeyMatcher, get_matcher
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

    for name, candidate in (("model", matcher), ("rules alone", KeyMatcher(mode="rules"))):
        hits = sum(candidate.same(a, b) for a, b in SAME)
        wrong = sum(candidate.same(a, b) for a, b in DIFFERENT)
        precision = hits / (hits + wrong) if hits + wrong else 1.0
        recall = hits / len(SAME)
        rows.append(
            Row(
                "K",
                f"labelled pairs, {name}: precision / recall",
                f"{precision:.0%} / {recall:.0%} ({hits} of {len(SAME)} found, {wrong} of {len(DIFFERENT)} wrong)",
                goal="100 % / >= 90 %" if name == "model" else "-",
                passed=(precision == 1.0 and recall >= 0.9) if name == "model" else None,
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
