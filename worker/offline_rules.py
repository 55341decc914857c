"""The deterministic rules behind the offline model's ``extract_facts`` and ``feedback``.

They see what a real model would see (every message of the transcript the extractor
is shown, whatever its role; the whole original and edited text) and propose
candidates the same way a model would. They do
not judge where a candidate came from: the evidence checks in ``tasks.session_end``
and ``tasks.feedback`` refuse anything not backed by the user's own words.
"""

from __future__ import annotations

import re
from typing import Any

#: "my X is Y" with X of one to four words (docs/reference.md, The offline model).
_MY_X_IS_Y = re.compile(r"\bmy\s+(?P<x>[^\W\d_][\w'-]*(?:\s+[\w'-]+){0,3}?)\s+(?:is|are)\s+(?P<y>\S.*)", re.I)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_PREFERENCE_WORDS = ("favorite", "favourite", "preferred")
_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d{1,3}[.)])\s+\S")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(?P<title>\S.*?)\s*#*\s*$")
_GREETING = re.compile(r"^\s*(?:hi|hello|hey|dear|greetings)\b", re.I)
_SIGN_OFF = re.compile(
    r"^\s*(?:best regards|kind regards|regards|cheers|sincerely|best|thanks|thank you)\b[,!.]?", re.I
)
_WORD = re.compile(r"\w+")

#: Shortening or lengthening must be this strong to count as a preference.
SHORTER_RATIO = 0.7
LONGER_RATIO = 1.5
MIN_WORDS_FOR_LENGTH = 20
EVIDENCE_CHARS = 200
#: The extraction prompt's limits (``tasks.session_end``): key and value lengths.
MAX_KEY = 100
MAX_VALUE = 1000
#: A longer sentence is quoted from "my" on: still the user's exact words.
MAX_EVIDENCE = 1000


def snake_case(text: str) -> str:
    """``Favorite Color`` -> ``favorite_color``; anything not a letter or digit is a separator."""
    return "_".join(_WORD.findall(text.lower().replace("_", " ").replace("'", "")))


def sentences(text: str) -> list[str]:
    """The sentences of ``text``, split at ``.!?`` followed by space and at line breaks."""
    return [part.strip() for part in _SENTENCE_END.split(text) if part and part.strip()]


def extract_facts(task: dict[str, Any]) -> list[dict[str, Any]]:
    """Facts stated as "my X is Y" in any message of ``task["messages"]``.

    Each is ``{"key", "value", "category", "evidence"}``: key = X in snake_case,
    value = Y without closing punctuation, category ``preference`` when X begins
    with favorite/favourite/preferred else ``fact``, evidence = the sentence (from
    "my" on, when the sentence is longer than ``MAX_EVIDENCE``). Facts whose key or
    value exceeds the prompt's limits are not proposed; a fact said again (same key
    and value) is proposed once, as a model would.
    """
    facts: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    messages = task.get("messages")
    if not isinstance(messages, list):
        return facts
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            continue
        for sentence in sentences(content):
            fact = _fact_in(sentence)
            if fact is not None and (fact["key"], fact["value"]) not in seen:
                seen.add((fact["key"], fact["value"]))
                facts.append(fact)
    return facts


def _fact_in(sentence: str) -> dict[str, Any] | None:
    match = _MY_X_IS_Y.search(sentence)
    if match is None:
        return None
    subject = match.group("x").strip()
    value = match.group("y").strip().rstrip(".!?;:,").strip().strip("\"'").strip()
    key = snake_case(subject)
    if not key or not value or len(subject.split()) > 4:
        return None
    # The prompt's own limits, as a model that follows it keeps them: a longer value is
    # not a fact worth proposing, and echoing a huge sentence would only run the reply
    # into the output ceiling (cut off: the whole signal fails, every time).
    if len(key) > MAX_KEY or len(value) > MAX_VALUE:
        return None
    evidence = sentence if len(sentence) <= MAX_EVIDENCE else match.group(0).strip()
    category = "preference" if subject.lower().startswith(_PREFERENCE_WORDS) else "fact"
    return {"key": key, "value": value, "category": category, "evidence": evidence}


def feedback_candidates(task: dict[str, Any]) -> list[dict[str, Any]]:
    """Candidate preferences from how ``task["edited"]`` differs from ``task["original"]``.

    Deterministic rules: consistent shortening or lengthening, bullets instead of
    prose (or the reverse), removed sections (Markdown headings), a removed greeting
    or sign-off. Each candidate is ``{"key", "value", "category", "evidence"}`` with
    evidence quoted from the user's edit: text found only in the edited version (the
    user wrote it) or only in the original (the user deleted it).
    """
    original = task.get("original")
    edited = task.get("edited")
    if not isinstance(original, str) or not isinstance(edited, str) or original == edited:
        return []
    candidates: list[dict[str, Any]] = []
    for rule in (_length_rule, _list_rule, _section_rule, _greeting_rule, _sign_off_rule):
        candidates.extend(rule(original, edited))
    return candidates


def _candidate(key: str, value: str, evidence: str) -> dict[str, Any]:
    return {"key": key, "value": value, "category": "preference", "evidence": evidence[:EVIDENCE_CHARS].strip()}


def _only_in(text: str, other: str) -> list[str]:
    """Sentences of ``text`` that do not occur in ``other`` (case and spacing folded)."""
    folded = " ".join(other.lower().split())
    return [s for s in sentences(text) if " ".join(s.lower().split()) not in folded]


def _length_rule(original: str, edited: str) -> list[dict[str, Any]]:
    before, after = len(_WORD.findall(original)), len(_WORD.findall(edited))
    if before >= MIN_WORDS_FOR_LENGTH and after and after <= before * SHORTER_RATIO:
        cut = _only_in(original, edited)
        if cut:
            return [_candidate("response_length", "shorter, more concise responses", cut[0])]
    if after >= MIN_WORDS_FOR_LENGTH and before and after >= before * LONGER_RATIO:
        added = _only_in(edited, original)
        if added:
            return [_candidate("response_length", "longer, more detailed responses", added[0])]
    return []


def _bullets(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _BULLET.match(line)]


def _list_rule(original: str, edited: str) -> list[dict[str, Any]]:
    before, after = _bullets(original), _bullets(edited)
    folded_original, folded_edited = " ".join(original.lower().split()), " ".join(edited.lower().split())
    if len(before) < 2 and len(after) >= 2:
        new = [b for b in after if " ".join(b.lower().split()) not in folded_original]
        if new:
            return [_candidate("response_format", "bullet points instead of prose", new[0])]
    if len(before) >= 2 and not after and edited.strip():
        gone = [b for b in before if " ".join(b.lower().split()) not in folded_edited]
        if gone:
            return [_candidate("response_format", "prose instead of bullet points", gone[0])]
    return []


def _headings(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _HEADING.match(line)
        if match is not None:
            found.setdefault(" ".join(match.group("title").lower().split()), line.strip())
    return found


def _section_rule(original: str, edited: str) -> list[dict[str, Any]]:
    kept = _headings(edited)
    out = []
    for title, line in _headings(original).items():
        slug = snake_case(title)[:60]
        if title not in kept and slug:
            out.append(_candidate(f"omit_section_{slug}", f"leave out the {title!r} section", line))
    return out


def _edge_line(text: str, *, last: bool) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[-1] if last else lines[0]


def _greeting_rule(original: str, edited: str) -> list[dict[str, Any]]:
    first = _edge_line(original, last=False)
    if _GREETING.match(first) and not _GREETING.match(_edge_line(edited, last=False)):
        return [_candidate("greeting", "no greeting", first)]
    return []


def _sign_off_rule(original: str, edited: str) -> list[dict[str, Any]]:
    last = _edge_line(original, last=True)
    if _SIGN_OFF.match(last) and len(last) <= 40 and not _SIGN_OFF.match(_edge_line(edited, last=True)):
        return [_candidate("sign_off", "no sign-off", last)]
    return []
