"""Seeded, deterministic signal payloads for the signal benchmarks (``P2``, ``P5``).

The same seed gives the same signals, byte for byte: users, events, transcripts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

ACTIONS = ("open_digest", "run_report", "search", "export_csv", "review_inbox", "plan_week", "sync_calendar")
SUBJECTS = ("favorite color", "home city", "preferred editor", "team name", "favourite drink", "job title", "dog name")
VALUES = ("blue", "Lisbon", "vim", "platform", "green tea", "staff engineer", "Rex", "Oslo", "emacs", "coffee")
BASE_TIME = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)

#: The realistic mix of ``P5``: mostly activity and session ends, some feedback.
MIX = (("activity", 0.80), ("session_end", 0.15), ("feedback", 0.05))


@dataclass(frozen=True)
class SignalSpec:
    kind: str
    user_id: str
    agent_id: str | None
    payload: dict[str, Any]


def activity_payload(rng: random.Random, events: int = 5) -> dict[str, Any]:
    """A few timestamped actions, as a product's event pipeline would batch them."""
    out = []
    for _ in range(events):
        at = BASE_TIME + timedelta(days=rng.randrange(56), minutes=rng.randrange(-40, 40))
        event: dict[str, Any] = {"action": rng.choice(ACTIONS), "at": at.isoformat()}
        if rng.random() < 0.3:
            event["attributes"] = {"items": rng.randrange(1, 50)}
        out.append(event)
    return {"events": out}


def session_end_payload(rng: random.Random, serial: int, turns: int = 3) -> dict[str, Any]:
    """A short transcript with one "my X is Y" sentence the offline model extracts."""
    subject, value = rng.choice(SUBJECTS), rng.choice(VALUES)
    messages = [{"role": "user", "content": f"Hi. My {subject} is {value}. Thanks."}]
    for turn in range(turns - 1):
        messages.append({"role": "assistant", "content": f"Noted, step {turn}."})
        messages.append({"role": "user", "content": f"Question {rng.randrange(10_000)} about item {serial}."})
    return {"conversation_id": f"conv-{serial}", "messages": messages}


def feedback_payload(rng: random.Random, serial: int) -> dict[str, Any]:
    original = "Dear team, please find the report attached. Regards"
    edited = original.replace("Dear team", rng.choice(("Hi all", "Hello team", "Hey folks")))
    return {"deliverable_id": f"deliverable-{serial}", "original": original, "edited": edited}


def signals(kind: str, count: int, *, seed: int = 7, users: int = 200, start: int = 0) -> Iterator[SignalSpec]:
    """``count`` signals of one kind (``activity``, ``session_end`` or ``feedback``)."""
    rng = random.Random(f"{seed}:{kind}:{start}")
    for serial in range(start, start + count):
        yield _one(rng, kind, serial, users)


def mixed_signals(count: int, *, seed: int = 7, users: int = 1000, start: int = 0) -> Iterator[SignalSpec]:
    """``count`` signals drawn from :data:`MIX`."""
    rng = random.Random(f"{seed}:mix:{start}")
    kinds = [kind for kind, _ in MIX]
    weights = [weight for _, weight in MIX]
    for serial in range(start, start + count):
        yield _one(rng, rng.choices(kinds, weights)[0], serial, users)


def _one(rng: random.Random, kind: str, serial: int, users: int) -> SignalSpec:
    user = f"bench-user-{rng.randrange(users):05d}"
    agent = rng.choice(("assistant", "writer", None))
    if kind == "activity":
        payload = activity_payload(rng)
    elif kind == "session_end":
        payload = session_end_payload(rng, serial)
    else:
        payload = feedback_payload(rng, serial)
    return SignalSpec(kind, user, agent, payload)
