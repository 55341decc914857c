"""The profile's text format, and the cut to a token budget, shared by the builder and
the readers (no tokenizer here: token counts come in with the lines).

A profile is Markdown: fixed sections in a fixed order, one line per entry, and a last
line saying how many entries were left out. Entries arrive ranked (most important
first); a cut keeps the longest prefix of that ranking whose estimated tokens fit the
budget, so a reader holding the stored lines and counts cuts exactly as the builder
would at that budget. The estimate is an upper bound of the count (see :func:`edge_slack`).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from operator import itemgetter
from typing import Any, NamedTuple

SECTIONS = ("About the user", "Preferences", "Work", "Context", "Follow-ups")
ABOUT, PREFERENCES, WORK, CONTEXT, FOLLOW_UPS = range(len(SECTIONS))
MAX_KEY_CHARS = 60
MAX_VALUE_CHARS = 200
#: What a line shows of a value nested deeper than Python can write out.
NESTED_TOO_DEEP = "(a value nested too deep to show)"
#: litellm counts long texts in windows of this many characters; a window's edge can
#: cut a word, whose pieces may take more tokens than the word (see :func:`edge_slack`).
COUNT_WINDOW_CHARS = 1024

_FOLLOW_UP_WORDS = frozenset({"followup", "follow", "todo", "reminder", "remind", "task", "deadline", "pending", "due"})
_WORK_WORDS = frozenset(
    {"work", "job", "company", "employer", "role", "occupation", "profession", "project", "team", "office"}
    | {"colleague", "manager", "career", "title", "industry", "client", "workplace"}
)
_PREFERENCE_WORDS = frozenset({"favorite", "favourite", "preferred", "prefers", "prefer", "likes", "dislikes"})
_CONTEXT_CATEGORIES = frozenset({"context", "routine", "habit", "summary", "legacy"})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


class Line(NamedTuple):
    """One entry's line (with its newline), its section and its token count."""

    section: int
    tokens: int
    text: str


_SECTION, _TOKENS, _TEXT = itemgetter(0), itemgetter(1), itemgetter(2)


@dataclass(frozen=True)
class Layout:
    """What a cut needs: the lines in ranked order, each section header's tokens, the
    left-out line's tokens (an upper bound: the most any number it can show takes),
    and how many entries the profile had in all."""

    lines: Sequence[Line]
    header_tokens: Sequence[int]
    left_out_tokens: int
    total: int

    def to_json(self) -> dict[str, Any]:
        return {
            "lines": list(map(list, self.lines)),  # [section, tokens, text] each
            "headers": list(self.header_tokens),
            "left_out_line": self.left_out_tokens,
            "total": self.total,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        lines = [Line(int(s), int(t), str(x)) for s, t, x in data.get("lines", [])]
        return cls(
            lines, [int(t) for t in data.get("headers", [])], int(data.get("left_out_line", 0)), int(data["total"])
        )


def _words(key: str) -> set[str]:
    return {word.lower() for word in _WORD.findall(key)}


@lru_cache(maxsize=65_536)
def section_of(category: str | None, key: str) -> int:
    """The section an entry goes to, from its category, else the words of its key."""
    category = (category or "fact").lower()
    words = _words(key)
    if category in ("follow_up", "followup", "task", "todo", "reminder") or words & _FOLLOW_UP_WORDS:
        return FOLLOW_UPS
    if category == "preference" or words & _PREFERENCE_WORDS:
        return PREFERENCES
    if category in ("work", "project") or words & _WORK_WORDS:
        return WORK
    if category in _CONTEXT_CATEGORIES:
        return CONTEXT
    return ABOUT


def _plain(text: str, limit: int) -> str:
    # One line whatever the value holds: control characters dropped, whitespace runs
    # (newlines included) made one space, and long values shortened.
    if len(text) <= limit and text.isprintable() and "  " not in text and text[:1] != " " and text[-1:] != " ":
        # Nothing to drop or join (printable: no control character, no space but ' ').
        return text
    # Printable text holds no control (``C*``) character: only a long or spaced value is here.
    kept = text if text.isprintable() else "".join(ch for ch in text if _shown_char(ch))
    flat = " ".join(kept.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


#: Invisible characters kept: the joiners that make one emoji of several (👨‍👩‍👧) and
#: spell Persian and Indic words. Every other format character (bidirectional overrides,
#: tag characters that hide text from a reader) is dropped with the control characters.
_JOINERS = frozenset("\u200c\u200d")


def _shown_char(ch: str) -> bool:
    return unicodedata.category(ch)[0] != "C" or ch.isspace() or ch in _JOINERS


def value_text(value: Any) -> str:
    """A JSON value as the line shows it: a string plainly, anything else compactly."""
    if isinstance(value, str):
        return _plain(value, MAX_VALUE_CHARS)
    try:
        return _plain(json.dumps(value, ensure_ascii=False, separators=(",", ":")), MAX_VALUE_CHARS)
    except RecursionError:
        return NESTED_TOO_DEEP


def json_value_text(raw: str | None) -> str:
    """:func:`value_text` of a value given as JSON text (as the database hands it out):
    a string without escapes is shown without parsing it; text that is not JSON is
    shown as it is."""
    if raw is None:
        return value_text(None)
    if len(raw) > 1 and raw[0] == raw[-1] == '"' and "\\" not in raw and '"' not in raw[1:-1]:
        return _plain(raw[1:-1], MAX_VALUE_CHARS)
    written: list[_Written] = []

    def number(text: str) -> float | _Written:
        # A number with a fraction or an exponent, as written where a float would round
        # it (a 17-digit balance) or where the written form is short (25000000000000000.00,
        # not 2.5e+16); a float's own form where that is exact and the written one long
        # (PostgreSQL writes 1e-30 out in 32 characters).
        value = float(text)
        if (len(text) <= MAX_WRITTEN_NUMBER and math.isfinite(value)) or Decimal(repr(value)) != Decimal(text):
            found = _Written(text)
            written.append(found)
            return found
        return value

    try:
        value = json.loads(raw, parse_float=number)
    except (ValueError, RecursionError):
        # Not JSON, or nested deeper than Python reads: shown as the database gave it.
        return _plain(raw, MAX_VALUE_CHARS)
    if not written:
        return value_text(value)
    try:
        return _plain(_compact_json(value), MAX_VALUE_CHARS)
    except RecursionError:
        return _plain(raw, MAX_VALUE_CHARS)


#: A number written in at most this many characters is shown as written (see :func:`json_value_text`).
MAX_WRITTEN_NUMBER = 24


class _Written:
    """A JSON number as written (:func:`json_value_text`)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _compact_json(value: Any) -> str:
    """``value`` as compact JSON, as ``value_text`` writes it, its numbers as written."""
    if isinstance(value, _Written):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{_json_text(key)}:{_compact_json(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_compact_json, value)) + "]"
    return _json_text(value)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def entry_line(key: str, value: Any, *, conflicted: bool) -> str:
    """``- key: value`` (``(contradicted)`` after a contradicted entry's value)."""
    return line_of(key, value_text(value), conflicted=conflicted)


def line_of(key: str, shown: str, *, conflicted: bool) -> str:
    """:func:`entry_line` of a value already made its text (:func:`value_text`)."""
    return line_and_head(key, shown, conflicted)[0]


def line_and_head(key: str, shown: str, conflicted: bool) -> tuple[str, int]:
    """:func:`line_of`'s line, and how many of its characters come before the space
    that starts its value (``- key:``; 0 where no space does: an empty value, not
    contradicted)."""
    part = _key_part(key)
    if shown:  # a shown value has no space at either end
        return part + shown + (_MARKED if conflicted else "\n"), len(part) - 1
    # Only an empty value leaves a space to strip.
    stripped = part.rstrip()
    return (stripped + _MARKED, len(stripped)) if conflicted else (stripped + "\n", 0)


_MARKED = " (contradicted)\n"


@lru_cache(maxsize=65_536)
def _key_part(key: str) -> str:
    """``- key: `` (keys recur: every user has the same few)."""
    return f"- {_plain(key.replace('_', ' '), MAX_KEY_CHARS) or '(no key)'}: "


_HEADER_LINES = tuple(f"## {name}\n" for name in SECTIONS)


def header_line(section: int) -> str:
    return _HEADER_LINES[section]


@lru_cache(maxsize=4096)
def left_out_line(count: int) -> str:
    return f"({count} more {'entry' if count == 1 else 'entries'} left out)\n"


def _by_section(lines: Sequence[Line]) -> list[Line]:
    # Stable: ranked within each section.
    return sorted(lines, key=_SECTION)


def assemble(lines: Sequence[Line], left_out: int) -> str:
    """The profile text of these ranked lines: by section, ranked within each."""
    parts: list[str] = []
    current = -1
    for line in _by_section(lines):
        if line.section != current:
            current = line.section
            parts.append(_HEADER_LINES[current])
        parts.append(line.text)
    if left_out:
        parts.append(left_out_line(left_out))
    return "".join(parts)


def pieces(
    lines: Sequence[Line], left_out: int, header_tokens: Sequence[int], count: Callable[[str], int]
) -> list[tuple[str, int]]:
    """:func:`assemble`'s parts with their tokens (the left-out line counted by ``count``):
    their texts joined are the profile's text."""
    parts: list[tuple[str, int]] = []
    current = -1
    for section, tokens, text in _by_section(lines):
        if section != current:
            current = section
            parts.append((_HEADER_LINES[section], header_tokens[section]))
        parts.append((text, tokens))
    if left_out:
        last = left_out_line(left_out)
        parts.append((last, count(last)))
    return parts


def windowed_tokens(
    parts: Sequence[tuple[str, int]], count: Callable[[str], int], window: int = COUNT_WINDOW_CHARS
) -> int:
    """The tokens of the parts' joined text as a counter counting each ``window``
    characters on its own gives them, from the parts' own counts: a window's count is
    its whole parts' counts plus the counts of the pieces of parts cut at its edges.

    Exact for a tokenizer whose pre-tokenizer never joins a line's end to what follows
    (cl100k's: a newline followed by a non-space always ends a piece), each part being
    whole lines that start with a non-space (every line of a profile)."""
    if sum(map(len, map(_FIRST, parts))) <= window:
        return sum(map(_SECOND, parts))
    ends: list[int] = []
    chars = 0
    for text, _ in parts:
        chars += len(text)
        ends.append(chars)
    whole = "".join(text for text, _ in parts)
    total = 0
    first = 0  # the first part not ending before the window
    for start in range(0, chars, window):
        stop = min(start + window, chars)
        while ends[first] <= start:
            first += 1
        begin = ends[first - 1] if first else 0  # where part ``first`` starts
        index = first if begin == start else first + 1  # the first part starting in the window
        head_end = ends[index - 1] if index else 0
        tokens = 0
        last = index
        while last < len(parts) and ends[last] <= stop:
            tokens += parts[last][1]
            last += 1
        if last == index:  # no whole part in the window
            total += count(whole[start:stop])
            continue
        total += count(whole[start:head_end]) + tokens + count(whole[ends[last - 1] : stop])
    return total


_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def edge_slack(text: str, window: int = COUNT_WINDOW_CHARS) -> int:
    """An upper bound of the tokens a counter that counts each ``window`` characters on
    its own gives ``text`` beyond the sum of its lines' counts.

    Only the pieces of text around each window's edge are counted otherwise than in the
    whole: the words the edge cuts, with the spaces beside them (a word's piece may take
    a leading space, and spaces their trailing newlines). Cut in two, such a stretch
    takes at most one token per byte, where it took at least one: at most its bytes less
    one more. An edge between two lines cuts nothing (a line starts with a non-space, and
    no piece runs from a newline into it)."""
    slack = 0
    for edge in range(window, len(text), window):
        if text[edge - 1] == "\n" and not text[edge].isspace():
            continue
        start = _word_start(text, edge)
        while start > 0 and text[start - 1].isspace() and text[start - 1] != "\n":
            start -= 1
        end = _word_end(text, edge)
        while end < len(text) and text[end].isspace():
            end += 1
        end = _word_end(text, end)
        slack += len(text[start:end].encode()) - 1
    return slack


def _word_start(text: str, at: int) -> int:
    while at > 0 and not text[at - 1].isspace():
        at -= 1
    return at


def _word_end(text: str, at: int) -> int:
    while at < len(text) and not text[at].isspace():
        at += 1
    return at


def _prefix_tokens(layout: Layout, kept: int) -> int:
    """The tokens of the first ``kept`` lines, their headers and the left-out line, each
    counted on its own: the count of their text where no counting window cuts it."""
    lines = layout.lines[:kept]
    sections = set(map(_SECTION, lines))
    tokens: int = sum(map(_TOKENS, lines)) + sum(layout.header_tokens[s] for s in sections)
    return tokens + (layout.left_out_tokens if kept < layout.total else 0)


def estimate(layout: Layout, kept: int) -> int:
    """Tokens of the profile holding the first ``kept`` lines: an upper bound of the
    count, exact where the text fits one counting window."""
    return estimate_of(layout, kept, assemble(layout.lines[:kept], layout.total - kept))


def estimate_of(layout: Layout, kept: int, text: str) -> int:
    """:func:`estimate`, given the text of the first ``kept`` lines (:func:`assemble`'s)."""
    return _prefix_tokens(layout, kept) + edge_slack(text)


def cut(layout: Layout, budget: int) -> int:
    """How many of the ranked lines fit ``budget``: the largest prefix whose
    :func:`estimate` is at most ``budget``. Prefixes whose lines alone are over it are
    not looked at; of the others, the longest are tried first."""
    lines = layout.lines
    tokens = 0
    sections: set[int] = set()
    fitting = 0  # the longest prefix whose lines, headers and left-out line fit alone
    for kept in range(len(lines) + 1):
        if kept:
            line = lines[kept - 1]
            tokens += line.tokens
            if line.section not in sections:
                sections.add(line.section)
                tokens += layout.header_tokens[line.section]
        if tokens > budget:
            break  # every longer prefix holds these tokens and more
        if tokens + (layout.left_out_tokens if kept < layout.total else 0) <= budget:
            fitting = kept
    for kept in range(fitting, 0, -1):
        if estimate(layout, kept) <= budget:
            return kept
    return 0


def whole_if_fits(layout: Layout, budget: int, count: Callable[[str], int]) -> tuple[str, int] | None:
    """The text of every line of the layout and its tokens, when the whole text fits
    ``budget`` and one counting window (then its count is exactly its parts' counts, for
    a counter whose text counts are made from its lines': see :func:`windowed_tokens`);
    else None. What :func:`cut` and :func:`pieces` would give, without an estimate first."""
    if len(layout.lines) < layout.total:
        return None
    parts = pieces(layout.lines, 0, layout.header_tokens, count)
    tokens: int = sum(map(_SECOND, parts))
    if tokens > budget:
        return None
    text = "".join(map(_FIRST, parts))
    return (text, tokens) if len(text) <= COUNT_WINDOW_CHARS else None


def lines_fit(layout: Layout, kept: int, budget: int) -> bool:
    """Whether the first ``kept`` lines, their headers and the left-out line, each
    counted on its own, fit ``budget`` (their :func:`estimate` is that and more)."""
    return _prefix_tokens(layout, kept) <= budget
