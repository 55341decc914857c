"""Generated hostile signals, INSERTed by plain SQL as a foreign producer would, then processed.

Hypothesis builds batches of signals: valid ones, valid ones with a field dropped, retyped
or replaced by nested junk, arbitrary JSON values, huge strings, odd unicode, SQL- and
markup-looking text, kinds, users and agents no schema knows. Each batch is inserted in
one transaction and processed in one pass. Every signal must end ``rejected`` with a
reason naming the field, or ``done`` with memory writes for its own user only; the pass
never raises, and nothing ever lands for a user no signal was for.

The default run covers at least 1,000 signals; ``-m slow`` runs ten times as many.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from tasks.signals import process_pending
from tests.test_hostile_signals import FIELD_REASON, HOSTILE_TEXTS, LONG
from worker.settings import Settings

VICTIM = "victim"
KINDS = ("session_end", "feedback", "activity")
BATCH = (20, 30)
DEFAULT_SIGNALS = 1_000
SLOW_SIGNALS = 10_000


@dataclass(frozen=True)
class Generated:
    kind: str
    user: str
    agent: str | None
    payload: str  # JSON text as the producer sends it
    valid: bool  # built to be accepted: must end done


# PostgreSQL refuses NUL in text and jsonb, and UTF-8 cannot carry lone surrogates: a
# producer cannot store those at all, so they are not generated.
CHARS = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
MARKUP = [
    "'); DROP TABLE usermemories; --",
    "<script>alert(1)</script>",
    "{{7*7}}",
    "${jndi:ldap://x/a}",
    "\u202e\u200b\ufeff",
    "\x01\x02\x1b[31m\x7f",
    "Ω≈ç√∫ 田中 \U0001d54f 👩‍👩‍👧",
    "\\u0000",
]
SHORT_TEXT = st.text(CHARS, max_size=30)
WORD = st.text(CHARS, min_size=1, max_size=20)
TEXT = st.one_of(
    SHORT_TEXT,
    st.sampled_from(MARKUP + HOSTILE_TEXTS[:-1]),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "😀", "my name is "]), st.integers(0, 3000)),
    st.builds(lambda x, y: f"My {x} is {y}", st.sampled_from(["favorite color", "name", "dog", "home town"]), WORD),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(SHORT_TEXT, inner, max_size=4),
    max_leaves=10,
)
NON_BLANK = st.text(CHARS, min_size=1, max_size=60).filter(lambda s: s.strip() != "")
STAMPS = st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(9998, 12, 30)).map(datetime.isoformat)
BAD_STAMPS = st.one_of(SHORT_TEXT, st.integers(), st.sampled_from(["2024-02-30T10:00:00", "0000-01-01", "NaN"]))

MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "assistant", "tool", "system"]), "content": TEXT},
    optional={"at": STAMPS, "extra": JSON},
)
VALID_PAYLOADS = {
    "session_end": st.fixed_dictionaries(
        {"conversation_id": NON_BLANK, "messages": st.lists(MESSAGE, max_size=6)},
        optional={"agent_id": NON_BLANK, "ended_at": STAMPS, "junk": JSON},
    ),
    "feedback": st.fixed_dictionaries(
        {"deliverable_id": NON_BLANK, "original": st.one_of(st.just(LONG), TEXT), "edited": TEXT},
        optional={"agent_id": NON_BLANK, "at": STAMPS, "junk": JSON},
    ),
    "activity": st.fixed_dictionaries(
        {
            "events": st.lists(
                st.fixed_dictionaries(
                    {"action": NON_BLANK, "at": STAMPS},
                    optional={"attributes": st.dictionaries(SHORT_TEXT, JSON, max_size=3)},
                ),
                max_size=6,
            )
        },
        optional={"agent_id": NON_BLANK, "junk": JSON},
    ),
}
NESTED = [
    '{"conversation_id": "c", "messages": [], "x": ' + "[" * 40 + "]" * 40 + "}",
    '{"events": [{"action": "a", "at": "2024-05-06T09:00:00Z", "attributes": {"x": ' + "[" * 5000 + "]" * 5000 + "}}]}",
    '{"events": [], "x": 1e400, "y": -0, "z": 1e-400}',
    '{"deliverable_id": "d", "original": "a", "edited": "' + "z" * 1_100_000 + '"}',
    '{"conversation_id": "c", "messages": ' + json.dumps([{"role": "user", "content": "x"}] * 2001) + "}",
]


@st.composite
def mutated(draw: st.DrawFn, kind: str) -> Any:
    """A valid payload with one thing broken: a field dropped, retyped, or the whole replaced."""
    payload: dict[str, Any] = draw(VALID_PAYLOADS[kind])
    how = draw(st.sampled_from(["drop", "retype", "retype", "stamp", "item", "replace"]))
    if how == "replace":
        return draw(JSON)
    fields = sorted(payload) or ["x"]
    name = draw(st.sampled_from(fields))
    if how == "drop":
        payload.pop(name, None)
    elif how == "retype":
        payload[name] = draw(JSON)
    elif how == "stamp":
        payload["ended_at" if kind == "session_end" else "at"] = draw(BAD_STAMPS)
    else:
        items = payload.get("messages") or payload.get("events")
        if isinstance(items, list) and items:
            items[draw(st.integers(0, len(items) - 1))] = draw(JSON)
        else:
            payload[name] = draw(JSON)
    return payload


@st.composite
def signal(draw: st.DrawFn, prefix: str, n: int) -> Generated:
    kind = draw(st.sampled_from(KINDS))
    user = f"{prefix}-{n}"
    agent: str | None = None
    shape = draw(st.sampled_from(["valid", "valid", "mutated", "mutated", "junk", "raw", "identity"]))
    valid = shape == "valid"
    if shape in ("valid", "identity"):
        payload_text = json.dumps(draw(VALID_PAYLOADS[kind]), ensure_ascii=draw(st.booleans()))
    elif shape == "mutated":
        payload_text = json.dumps(draw(mutated(kind)), ensure_ascii=False)
    elif shape == "junk":
        payload_text = json.dumps(draw(JSON), ensure_ascii=False)
    else:
        payload_text = draw(st.sampled_from(NESTED))
    if shape == "identity":
        # Odd kinds, users and agents around a valid payload.
        which = draw(st.sampled_from(["kind", "user", "agent", "agent"]))
        if which == "kind":
            kind = draw(st.one_of(st.text(CHARS, max_size=32), st.sampled_from(["SESSION_END", "dream", "activity "])))
        elif which == "user":
            user = draw(st.text(CHARS, min_size=0, max_size=255).filter(lambda u: u != VICTIM))
        else:
            agent = draw(st.one_of(st.text(CHARS, max_size=255), st.sampled_from(MARKUP)))
        valid = False
    elif draw(st.booleans()):
        agent = draw(st.sampled_from(["bot", "writer", "agent-ü"]))
    return Generated(kind, user, agent, payload_text, valid)


def batches(prefix: str) -> st.SearchStrategy[list[Generated]]:
    return st.integers(*BATCH).flatmap(lambda size: st.tuples(*(signal(prefix, i) for i in range(size)))).map(list)


def insert(url: str, generated: list[Generated]) -> dict[int, Generated]:
    """All of a batch in one transaction; ids of the rows the database accepted."""
    ids: dict[int, Generated] = {}
    with psycopg.connect(url) as conn:
        for item in generated:
            key = f"fuzz-{uuid.uuid4()}"
            row = conn.execute(
                "INSERT INTO dream_signals (kind, user_id, agent_id, payload, idempotency_key) "
                "VALUES (%s, %s, %s, %s::jsonb, %s) RETURNING id",
                (item.kind, item.user, item.agent, item.payload, key),
            ).fetchone()
            assert row is not None
            ids[row[0]] = item
    return ids


def check(url: str, ids: dict[int, Generated]) -> None:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, status, last_error FROM dream_signals WHERE id = ANY(%s)", (list(ids),)
        ).fetchall()
        assert len(rows) == len(ids)
        for signal_id, status, error in rows:
            item = ids[signal_id]
            where = (item.kind, item.user, item.agent, item.payload[:300], status, error)
            assert status in ("done", "rejected"), where
            if item.valid:
                assert status == "done", where
            if status == "rejected":
                assert error and FIELD_REASON.match(error), where
        # Every write names the writing signal's own user, and only done signals wrote.
        strays = conn.execute(
            "SELECT e.signal_id, e.user_id, s.user_id, s.status FROM dream_events e "
            "LEFT JOIN dream_signals s ON s.id = e.signal_id "
            "WHERE e.signal_id IS NOT NULL AND (s.id IS NULL OR e.user_id <> s.user_id OR s.status <> 'done')"
        ).fetchall()
        assert strays == []
        orphans = conn.execute(
            "SELECT DISTINCT m.user_id FROM usermemories m WHERE NOT EXISTS "
            "(SELECT 1 FROM dream_signals s WHERE s.user_id = m.user_id AND s.status = 'done')"
        ).fetchall()
        assert orphans == []
        for table in ("usermemories", "dream_events", "dream_observations", "dream_activity"):
            assert conn.execute(f"SELECT count(*) FROM {table} WHERE user_id = %s", (VICTIM,)).fetchone() == (0,)
        too_long = conn.execute(
            "SELECT count(*) FROM usermemories WHERE length(key) > 100 OR length(value #>> '{}') > 1000"
        ).fetchone()
        assert too_long == (0,)


def run_fuzz(settings: Settings, examples: int, minimum: int) -> None:
    url = settings.database_url.replace("+psycopg", "")
    seen = [0]
    prefix = f"fz{uuid.uuid4().hex[:6]}"

    @hyp_settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(generated=batches(prefix))
    def one_batch(generated: list[Generated]) -> None:
        ids = insert(url, generated)
        report = process_pending(settings)
        assert set(ids) <= {r.signal_id for r in report.results}
        check(url, ids)
        seen[0] += len(ids)

    one_batch()
    assert seen[0] >= minimum, f"only {seen[0]} signals generated"


def test_generated_signals_end_rejected_with_a_field_or_done_for_their_own_user(pg_settings: Settings) -> None:
    run_fuzz(pg_settings, examples=DEFAULT_SIGNALS // BATCH[0], minimum=DEFAULT_SIGNALS)


@pytest.mark.slow
def test_generated_signals_long_form(pg_settings: Settings) -> None:
    run_fuzz(pg_settings, examples=SLOW_SIGNALS // BATCH[0], minimum=SLOW_SIGNALS)
