"""The small, realistic world ``reverie demo`` seeds: users, agents, entries, signals.

Deterministic: the same world every time, dated relative to "now" so that ages
(fresh, stale, recalled) mean the same whenever the demo runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

USERS = ("alice", "bruno", "chen")
AGENTS = ("travel-agent", "coach-agent", "inbox-agent")
#: The (user, agent) whose profile the demo prints before and after.
PROFILE_SHOWN = ("alice", "travel-agent")


@dataclass(frozen=True)
class SeedEntry:
    user_id: str
    key: str
    value: Any
    category: str = "fact"
    visibility: str = "self"
    agent: str | None = "travel-agent"
    age_days: int = 1
    access_count: int = 0
    group_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SeedSignal:
    kind: str
    user_id: str
    payload: dict[str, Any]
    agent_id: str | None = None


def entries() -> list[SeedEntry]:
    """Entries of several ages and categories, with contradictions across agents."""
    world = [
        # alice: a fresh preference, a stale one, a protected key and a protected category.
        SeedEntry("alice", "preferred_airline", "Lufthansa", "preference", age_days=3),
        SeedEntry("alice", "hotel_chain", "Ibis", "preference", age_days=200),
        SeedEntry("alice", "_gdpr_consent", "granted 2024-01-02", "fact", "global", None, age_days=400),
        SeedEntry("alice", "passport_country", "DE", "property", "global", None, age_days=500),
        # A contradiction across agents and visibilities: same key after normalising.
        SeedEntry("alice", "language", "English", "preference", "self", "travel-agent", age_days=10),
        SeedEntry("alice", "Language", "German", "preference", "global", "coach-agent", age_days=4),
        # Spelled the British way: a fact said later as "favorite color" lands on this entry.
        SeedEntry("alice", "favourite_colour", "green", "preference", age_days=40),
        # Old but recalled often: the application increments access_count on recall.
        SeedEntry("alice", "seat", "aisle", "preference", age_days=150, access_count=12),
        # bruno: six facts from one agent that summarization compresses.
        *[
            SeedEntry("bruno", f"trip_note_{i}", text, "context", "self", "travel-agent", age_days=20 + i)
            for i, text in enumerate(
                (
                    "Flew Lisbon to Porto in March",
                    "Took the train Porto to Madrid",
                    "Stayed three nights in Madrid",
                    "Visited the Prado on the second day",
                    "Flew Madrid to Berlin afterwards",
                    "Missed a connection in Frankfurt once",
                )
            )
        ],
        SeedEntry("bruno", "home-city", "Berlin", "fact", "group", "coach-agent", age_days=30, group_ids=["family"]),
        SeedEntry("bruno", "home_city", "Munich", "fact", "self", "inbox-agent", age_days=2),
        SeedEntry("bruno", "gym_days", "mon,wed", "context", age_days=120, agent="coach-agent"),
        # chen: values that agree (no contradiction) and a stale legacy entry kept by policy.
        SeedEntry("chen", "timezone", "Asia/Shanghai", "fact", "self", "travel-agent", age_days=5),
        SeedEntry("chen", "Time Zone", "Asia/Shanghai", "fact", "global", "coach-agent", age_days=6),
        SeedEntry("chen", "old_nickname", "CC", "legacy", "self", "inbox-agent", age_days=900),
        SeedEntry("chen", "newsletter_topic", "rust", "preference", age_days=95, agent="inbox-agent"),
    ]
    return world


def signals(at: datetime) -> list[SeedSignal]:
    """Signals of all three kinds, including some that must be refused."""
    monday_9 = (at - timedelta(days=at.weekday(), weeks=1)).replace(hour=9, minute=0, second=0, microsecond=0)
    return [
        SeedSignal(
            "session_end",
            "alice",
            {
                "conversation_id": "conv-100",
                "agent_id": "travel-agent",
                "messages": [
                    {"role": "user", "content": "Hi! My favorite color is blue. My home airport is Munich."},
                    {"role": "assistant", "content": "Noted. My name is TravelBot, by the way."},
                    {"role": "tool", "content": "lookup: my loyalty tier is platinum"},
                    {"role": "user", "content": "Book the usual, thanks."},
                ],
            },
            agent_id="travel-agent",
        ),
        SeedSignal(
            "session_end",
            "chen",
            {
                "conversation_id": "conv-200",
                "agent_id": "inbox-agent",
                "messages": [
                    {"role": "user", "content": "my preferred language is Mandarin"},
                    {"role": "assistant", "content": "Understood, the user's favorite food is durian."},
                ],
            },
            agent_id="inbox-agent",
        ),
        *[
            SeedSignal(
                "feedback",
                "bruno",
                {
                    "deliverable_id": f"report-{n}",
                    "agent_id": "inbox-agent",
                    "original": (
                        "Dear team, I hope this message finds you well. Here is the weekly summary. "
                        "We shipped the importer and fixed the billing bug. Kind regards, Bruno"
                    ),
                    "edited": "- shipped the importer\n- fixed the billing bug",
                },
                agent_id="inbox-agent",
            )
            for n in (1, 2)
        ],
        SeedSignal(
            "activity",
            "chen",
            {
                "agent_id": "inbox-agent",
                "events": [
                    {"action": "weekly_digest", "at": (monday_9 - timedelta(weeks=w, minutes=5 * w)).isoformat() + "Z"}
                    for w in range(4)
                ],
            },
            agent_id="inbox-agent",
        ),
    ]


#: Rows a foreign producer might INSERT by hand: the processing step refuses them.
MALFORMED_SQL_SIGNALS: list[tuple[str, str, str]] = [
    ("session_end", "bruno", '{"conversation_id": 42, "messages": []}'),
    ("activity", "chen", '{"events": [{"action": "x", "at": "yesterday"}]}'),
]
