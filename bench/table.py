"""One row per measure, one table for all: figure, baseline, ratio, goal, pass or miss.

Every benchmark module exposes ``measure(quick: bool) -> list[Row]``; the runner
(``python -m bench``) prints the rows of all of them as one Markdown table, and each
module run on its own prints its own rows the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Row:
    """One measured figure.

    ``ratio`` is figure / baseline (or the goal's own ratio, said in ``goal``) where a
    baseline was measured in the same run; ``passed`` is None where the row has no goal
    (a baseline shown for reference).
    """

    measure: str  # "P1", "P2", ...
    what: str
    figure: str
    baseline: str = "-"
    ratio: str = "-"
    goal: str = "-"
    passed: bool | None = None

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "MISS", None: "-"}[self.passed]


COLUMNS = ("", "what", "figure", "baseline", "ratio", "goal", "verdict")


def render(rows: Iterable[Row]) -> str:
    """The rows as a Markdown table (readable as plain text too)."""
    cells = [[r.measure, r.what, r.figure, r.baseline, r.ratio, r.goal, r.verdict] for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(COLUMNS, *cells, strict=False)]

    def line(values: Iterable[str]) -> str:
        return "| " + " | ".join(str(v).ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line(COLUMNS), "| " + " | ".join("-" * w for w in widths) + " |"]
    out += [line(c) for c in cells]
    return "\n".join(out)


def as_json(rows: Iterable[Row]) -> str:
    return json.dumps([{**asdict(r), "verdict": r.verdict} for r in rows])


def ratio(figure: float, baseline: float) -> str:
    """``figure / baseline`` formatted, e.g. ``1.43x``."""
    return f"{figure / baseline:.2f}x" if baseline else "n/a"


def seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
