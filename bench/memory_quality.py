"""Q1: does memory stay canonical when the model names things the way hosted models do?

A seeded corpus of multi-session users (``corpus``): each tells an agent about
themselves over several sessions, restating facts in other words and changing a few
(a move to another city, a new favourite colour, a new job), beside look-alike facts
that are different (home city and work city, first and last name, dog and cat). The
drifting built-in model (``offline/drift``) extracts them: it names a concept by any of
its usual keys, varies the case and punctuation of values and wraps its JSON in prose.
After each round of sessions the pass ``reverie run --all`` makes runs (signals, then a
dream of every user: contradiction detection; pruning and summarization off, so rows
are only what the signals wrote). Besides, labelled users hold one pair of entries
each, written by two agents with different values: keys that mean the same (a
contradiction to flag) or look-alike keys that do not.

The same corpus runs twice in one run, each on a throwaway PostgreSQL database: as
Reverie is configured by default, and as the baseline, with the known entries left out
of the prompt (``REVERIE_KNOWN_ENTRIES_TOKEN_BUDGET=0``) and the key matcher off.

    python -m bench Q1            # or: python bench/memory_quality.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.table import Row, ratio, render

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ADMIN_URL = os.environ.get("REVERIE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SEED = 20261123
AGENT = "assistant"

#: Concept -> the words a user says it with ("my <words> is <value>"), and its values.
CONCEPTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "favorite_color": (("favorite color", "favourite colour", "preferred color"), ("blue", "green", "red", "purple")),
    "home_city": (("home city", "city of residence", "current city"), ("Lisbon", "Porto", "Berlin", "Oslo", "Austin")),
    "work_city": (("work city", "office city"), ("Madrid", "Munich", "Dublin", "Boston")),
    "job_title": (("job title", "job", "occupation"), ("nurse", "data analyst", "teacher", "architect")),
    "birthday": (("birthday", "date of birth"), ("March 3", "July 21", "May 9", "October 30")),
    "preferred_language": (("preferred language", "main language"), ("Portuguese", "German", "English")),
    "first_name": (("first name", "given name"), ("Ana", "Jonas", "Mei", "Tomas")),
    "last_name": (("last name", "surname", "family name"), ("Silva", "Berg", "Chen", "Novak")),
    "dog_name": (("dog's name",), ("Rex", "Bolt", "Luna")),
    "cat_name": (("cat's name",), ("Misu", "Tom", "Nala")),
    "favorite_food": (("favorite food", "favourite food", "preferred food"), ("ramen", "paella", "falafel")),
}
#: Concepts whose value changes now and then between sessions.
CHANGING = ("favorite_color", "home_city", "job_title")

#: Labelled key pairs for contradiction detection: (key a, key b, same meaning?).
LABELLED: tuple[tuple[str, str, bool], ...] = (
    ("birthday", "date_of_birth", True),
    ("home_city", "city_of_residence", True),
    ("language", "preferred_language", True),
    ("favorite_color", "favourite_colour", True),
    ("job_title", "occupation", True),
    ("timezone", "time_zone", True),
    ("surname", "last_name", True),
    ("dob", "birthday", True),
    ("email", "email_address", True),
    ("favorite_food", "preferred_food", True),
    ("first_name", "last_name", False),
    ("home_city", "work_city", False),
    ("dog_name", "cat_name", False),
    ("start_date", "end_date", False),
    ("min_budget", "max_budget", False),
    ("home_address", "work_address", False),
    ("mother_name", "father_name", False),
    ("previous_employer", "current_employer", False),
    ("home_phone", "work_phone", False),
    ("favorite_food", "favorite_drink", False),
)


@dataclass
class User:
    user_id: str
    sessions: list[list[str]] = field(default_factory=list)
    #: concept -> the value the user said last.
    latest: dict[str, str] = field(default_factory=dict)
    said: list[str] = field(default_factory=list)


def corpus(users: int, sessions: int, seed: int = SEED) -> list[User]:
    """Seeded users, each with ``sessions`` lists of user messages."""
    rng = random.Random(seed)
    out: list[User] = []
    for n in range(users):
        user = User(f"q-user-{n:03d}")
        concepts = ["home_city", "work_city", *rng.sample(sorted(set(CONCEPTS) - {"home_city", "work_city"}), 5)]
        values = {c: rng.choice(CONCEPTS[c][1]) for c in concepts}
        for session in range(sessions):
            told = concepts if session == 0 else rng.sample(concepts, rng.randint(2, 4))
            lines = []
            for concept in told:
                if session > 0 and concept in CHANGING and rng.random() < 0.4:
                    values[concept] = rng.choice([v for v in CONCEPTS[concept][1] if v != values[concept]])
                words = rng.choice(CONCEPTS[concept][0])
                lines.append(f"My {words} is {values[concept]}.")
                user.latest[concept] = values[concept]
            user.sessions.append(lines)
            user.said.extend(lines)
        out.append(user)
    return out


def _url(database: str, driver: str = "postgresql") -> str:
    return driver + "://" + ADMIN_URL.split("://", 1)[1].rsplit("/", 1)[0] + "/" + database


@contextmanager
def throwaway_database() -> Iterator[str]:
    """A fresh, migrated database (its SQLAlchemy URL); dropped afterwards."""
    name = f"reverie_bench_q1_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _url(name, "postgresql+psycopg")
    try:
        from store.migrate import upgrade

        upgrade(_settings(url, baseline=False))
        yield url
    finally:
        from store.db import dispose_engines

        dispose_engines()
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _settings(url: str, *, baseline: bool) -> Any:
    from worker.settings import Settings

    values: dict[str, Any] = {
        "database_url": url,
        "broker_url": "",
        "llm_model": "offline/drift",
        "llm_drift_seed": SEED,
        "summarize_interactions": False,
        "prune_stale_after_days": 0,
        "detect_contradictions": True,
        "contradiction_resolution": "flag",
        "log_level": "WARNING",
    }
    if baseline:
        values.update(BASELINE)
    return Settings(_env_file=None, **values)


#: Today's approach: no known entries in the prompt, no key matching.
BASELINE: dict[str, Any] = {"known_entries_token_budget": 0, "key_matching": "off"}


@dataclass
class Figures:
    pairs: int = 0
    one_row_latest: int = 0
    duplicates: int = 0
    unflagged: int = 0
    unsupported: int = 0
    true_flags: int = 0
    false_flags: int = 0
    positives: int = 0
    calls: float = 0.0
    cost: float = 0.0
    sessions: int = 0

    @property
    def share(self) -> float:
        return 100.0 * self.one_row_latest / self.pairs if self.pairs else 0.0

    @property
    def recall(self) -> float:
        return 100.0 * self.true_flags / self.positives if self.positives else 0.0

    @property
    def precision(self) -> float:
        flagged = self.true_flags + self.false_flags
        return 100.0 * self.true_flags / flagged if flagged else 100.0


def _counter_total(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() if m.name == name for s in m.samples if s.name.endswith("_total"))


def run_corpus(users: list[User], *, baseline: bool) -> Figures:
    """Send every session through the signal path, dream after each round, measure."""
    from schedules.cron import run_once
    from worker.producer import enqueue_signal

    figures = Figures()
    with throwaway_database() as url:
        settings = _settings(url, baseline=baseline)
        _seed_labelled(settings)
        calls0 = _counter_total("dream_llm_requests")
        cost0 = _counter_total("dream_llm_cost_usd")
        for round_ in range(max(len(u.sessions) for u in users)):
            for user in users:
                if round_ >= len(user.sessions):
                    continue
                payload = {
                    "conversation_id": f"{user.user_id}-s{round_}",
                    "agent_id": AGENT,
                    "messages": [{"role": "user", "content": line} for line in user.sessions[round_]],
                }
                enqueue_signal("session_end", user.user_id, payload, agent_id=AGENT, settings=settings)
                figures.sessions += 1
            run_once(settings, all_users=True)
        figures.calls = _counter_total("dream_llm_requests") - calls0
        figures.cost = _counter_total("dream_llm_cost_usd") - cost0
        _measure(settings, users, figures)
    return figures


def _seed_labelled(settings: Any) -> None:
    from store.db import session_scope
    from store.memories import table_for, upsert_entry

    with session_scope(settings) as session:
        for n, (a, b, _) in enumerate(LABELLED):
            for agent, key, value in (("agent-x", a, "value one"), ("agent-y", b, "value two")):
                upsert_entry(
                    session,
                    table_for(settings),
                    user_id=f"q-labelled-{n:02d}",
                    key=key,
                    value=value,
                    category="fact",
                    source="seed",
                    source_agent_id=agent,
                )


def _norm(value: Any) -> str:
    from tasks.canonical import clean_value
    from tasks.decisions import normalise

    return normalise(clean_value(value)) if isinstance(value, str) else str(value)


def _measure(settings: Any, users: list[User], figures: Figures) -> None:
    from sqlalchemy import select

    from store.db import session_scope
    from store.memories import table_for
    from worker.offline_drift import family_of

    table = table_for(settings)
    with session_scope(settings) as session:
        rows = session.execute(select(table)).all()
    by_user: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        by_user[row.user_id].append(row)
    for user in users:
        said = " ".join(line.casefold() for line in user.said)
        mine = by_user.get(user.user_id, [])
        figures.unsupported += sum(1 for row in mine if _norm(row.value) not in said)
        for concept, latest in user.latest.items():
            family = family_of(concept)
            held = [row for row in mine if family_of(row.key) == family]
            figures.pairs += 1
            figures.duplicates += max(0, len(held) - 1)
            if len(held) == 1 and _norm(held[0].value) == _norm(latest):
                figures.one_row_latest += 1
            if len({_norm(r.value) for r in held}) > 1 and not all(r.conflicted for r in held):
                figures.unflagged += 1
    for n, (_, _, same) in enumerate(LABELLED):
        pair = by_user.get(f"q-labelled-{n:02d}", [])
        flagged = len(pair) == 2 and all(r.conflicted for r in pair)
        figures.positives += same
        figures.true_flags += same and flagged
        figures.false_flags += (not same) and flagged


def measure(quick: bool) -> list[Row]:
    users = corpus(4, 2) if quick else corpus(20, 5)
    now = run_corpus(users, baseline=False)
    before = run_corpus(users, baseline=True)
    per_now = now.cost / max(now.sessions, 1)
    per_before = before.cost / max(before.sessions, 1)
    where = f"{len(users)} users x {len(users[0].sessions)} sessions, drifting model"
    return [
        Row(
            "Q1",
            f"(user, concept) pairs holding one row with the latest value ({where})",
            f"{now.one_row_latest} of {now.pairs} ({now.share:.0f} %)",
            f"{before.one_row_latest} of {before.pairs} ({before.share:.0f} %)",
            "-",
            ">= 98 %",
            now.share >= 98.0,
        ),
        Row("Q1", "duplicate rows (a concept held by more than one row)", str(now.duplicates), str(before.duplicates)),
        Row(
            "Q1",
            "pairs whose rows disagree and are not all flagged",
            str(now.unflagged),
            str(before.unflagged),
            "-",
            "0",
            now.unflagged == 0,
        ),
        Row(
            "Q1",
            "rows whose value the user never said",
            str(now.unsupported),
            str(before.unsupported),
            "-",
            "0",
            now.unsupported == 0,
        ),
        Row(
            "Q1",
            f"contradictions on {len(LABELLED)} labelled key pairs (recall / precision)",
            f"{now.recall:.0f} % / {now.precision:.0f} %",
            f"{before.recall:.0f} % / {before.precision:.0f} %",
            "-",
            ">= 90 % / 100 %",
            now.recall >= 90.0 and now.precision == 100.0,
        ),
        Row(
            "Q1",
            "model calls and cost per session",
            f"{now.calls / max(now.sessions, 1):.2f} calls, {per_now * 1e6:.0f} micro-USD",
            f"{before.calls / max(before.sessions, 1):.2f} calls, {per_before * 1e6:.0f} micro-USD",
            ratio(per_now, per_before),
            "<= 1.25x",
            per_now <= 1.25 * per_before,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny numbers: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    rows = measure(args.quick)
    print(render(rows))
    return 0 if all(r.passed is not False for r in rows) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
