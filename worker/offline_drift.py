"""The built-in model's drifting mode: the offline rules, answered the way hosted models do.

``REVERIE_LLM_MODEL=offline/drift`` (seed ``REVERIE_LLM_DRIFT_SEED``). The facts and
preferences are the offline rules' own, but from one call to the next this mode:

- names a concept with any of its usual keys (``favorite_color``, ``favourite_colour``,
  ``preferred_color``...), unless it is shown a known entry or pending preference of
  that concept: then, as a good model does, it leaves a known fact out when it has not
  changed, names a changed one by that entry's handle, and reuses a pending key; now
  and then it still drifts, so the key matcher is exercised too;
- varies the case of values and adds closing punctuation or quotes;
- wraps its JSON in prose or code fences, and sometimes in an object;
- rewrites a profile with the value of its first line retouched (so the rewrite is
  refused: that line is no entry's).

Seeded and deterministic: the same seed and prompt give the same reply, in any process.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from worker import offline_rules

#: Keys that name one concept, as different models (or one model twice) write them.
FAMILIES: tuple[tuple[str, ...], ...] = (
    ("favorite_color", "favourite_colour", "preferred_color", "favorite_colour"),
    ("favorite_food", "favourite_food", "preferred_food", "favorite_dish"),
    ("home_city", "city_of_residence", "current_city", "residence_city"),
    ("work_city", "office_city", "city_of_work"),
    ("job_title", "job", "occupation", "role"),
    ("employer", "company", "employer_name"),
    ("birthday", "date_of_birth", "dob", "birth_date"),
    ("preferred_language", "language", "main_language"),
    ("timezone", "time_zone", "tz"),
    ("first_name", "given_name"),
    ("last_name", "surname", "family_name"),
    ("dog_name", "dogs_name", "name_of_dog"),
    ("cat_name", "cats_name", "name_of_cat"),
    ("home_airport", "home_airport_code", "usual_airport"),
    ("response_length", "answer_length", "reply_length"),
    ("response_format", "format_preference", "output_format"),
    ("greeting", "greetings", "salutation"),
    ("sign_off", "signoff", "closing"),
)
#: How often a concept already shown is answered by its handle (or its pending key).
REUSE_SHOWN = 0.8
_PROSE_BEFORE = (
    "Here are the facts I found:",
    "Sure! Based on the conversation, this is what I extracted.",
    "I analysed the text. Result:",
)
_PROSE_AFTER = ("Let me know if you need anything else.", "Hope this helps!", "")


def family_of(key: str) -> tuple[str, ...]:
    """The keys that name the same concept as ``key`` (just ``key`` when none is listed)."""
    plain = offline_rules.snake_case(key)
    for family in FAMILIES:
        if plain in family:
            return family
    return (plain,)


def rng_for(seed: int, purpose: str, task: Any) -> random.Random:
    digest = hashlib.sha256(f"{seed}|{purpose}|{json.dumps(task, sort_keys=True, default=str)}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def answer(purpose: str, task: Any, seed: int) -> str:
    """The drifting reply text for a purpose and its input."""
    from worker.offline_model import answer as plain_answer

    if isinstance(task, dict) and purpose == "profile":
        return _retouched_profile(task, rng_for(seed, purpose, task))
    if not isinstance(task, dict) or purpose not in ("extract_facts", "feedback"):
        return plain_answer(purpose, task)
    rng = rng_for(seed, purpose, task)
    if purpose == "extract_facts":
        drifted = [_drift(item, task, rng, vary=True) for item in offline_rules.extract_facts(task)]
        items = [item for item in drifted if item is not None]
        wrapper = "facts"
    else:
        # Preference values are the rules' own phrases: only their keys drift.
        drifted = [_drift(item, task, rng, vary=False) for item in offline_rules.feedback_candidates(task)]
        items = [item for item in drifted if item is not None]
        wrapper = "preferences"
    return _wrap(items, wrapper, rng)


def _retouched_profile(task: dict[str, Any], rng: random.Random) -> str:
    """A whole rewrite whose first line's value is retouched (cased or punctuated
    anew), as a drifting model rewords: a line no entry backs."""
    from worker.offline_model import profile_lines, profile_text

    lines = profile_lines(task)
    if lines:
        section, line = lines[0]
        key, sep, value = line.partition(": ")
        retouched = _vary_value(value, rng)
        if retouched == value:
            retouched = value.upper() + "!" if value.upper() != value else value.lower() + "."
        lines[0] = (section, f"{key}{sep}{retouched}")
    return json.dumps({"profile": profile_text(lines)}, ensure_ascii=False)


def _drift(item: dict[str, Any], task: dict[str, Any], rng: random.Random, *, vary: bool) -> dict[str, Any] | None:
    """One proposed item, drifted; None when a good model would leave it out (known, unchanged)."""
    family = family_of(item["key"])
    value = str(item["value"])
    out = {**item, "value": _vary_value(value, rng) if vary else value}
    shown = [k for k in task.get("known") or [] if isinstance(k, dict) and family_of(str(k.get("key"))) == family]
    pending = [p for p in task.get("pending") or [] if isinstance(p, dict) and family_of(str(p.get("key"))) == family]
    reuse = rng.random() < REUSE_SHOWN
    if shown and reuse:
        entry = shown[0]
        if str(entry.get("value", "")).casefold() == value.casefold():
            return None
        out.update(key=str(entry["key"]), handle=entry.get("handle"))
        if rng.random() < 0.5:
            out["relation"] = "update"
    elif pending and reuse:
        out["key"] = str(pending[0]["key"])
    else:
        out["key"] = rng.choice(family)
    return out


def _vary_value(value: str, rng: random.Random) -> str:
    cased = rng.choice((value, value.lower(), value.title(), value.upper() if len(value) <= 12 else value))
    return rng.choice((cased, cased, cased + ".", f'"{cased}"', cased + "!"))


def _wrap(items: list[dict[str, Any]], wrapper: str, rng: random.Random) -> str:
    body: Any = {wrapper: items} if rng.random() < 0.3 else items
    text = json.dumps(body, ensure_ascii=False, indent=rng.choice((None, 2)))
    style = rng.randrange(4)
    if style == 1:
        return f"```json\n{text}\n```"
    if style == 2:
        return f"{rng.choice(_PROSE_BEFORE)}\n{text}\n{rng.choice(_PROSE_AFTER)}".strip()
    if style == 3:
        return f"{rng.choice(_PROSE_BEFORE)}\n\n```\n{text}\n```\n\n{rng.choice(_PROSE_AFTER)}".strip()
    return text
