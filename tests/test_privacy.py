"""Privacy across the whole pipeline (real PostgreSQL, the offline model behind litellm).

- the prompt built for one user's work (summarization, fact extraction) never carries
  another user's entries or words: every model input is captured as it reaches the model;
- no metric label of any family the process exposes carries a user id;
- no log line carries a memory value, transcript or feedback text (``tests/test_logging``
  covers careless lines and library loggers; here a full pipeline runs with canaries);
- keys and values that look like SQL, markup or templates are stored verbatim and
  harmlessly.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from sqlalchemy import select
from sqlalchemy import text as sql_text
from sqlalchemy.exc import DataError, IntegrityError

from store.db import session_scope
from store.memories import table_for, upsert_entry
from tasks.activity import detect_routines
from tasks.dream import dream_user
from tasks.signals import process_pending
from tests.test_logging import captured  # noqa: F401 - the log capture fixture
from worker import offline_model
from worker.logs import user_ref
from worker.producer import enqueue_signal
from worker.settings import Settings

USERS = [f"priv-{name}-{n:02d}" for n, name in enumerate(["ada", "bo", "cy", "di", "ed", "fay", "gus", "hal"])]
LONG = "Thanks for asking. " + "The report covers revenue, costs and the outlook for every region we track. " * 3


def canary(user: str, what: str) -> str:
    # Distinctive, and never a substring of another user's canary.
    return f"zq{what}{user.replace('-', '')}qz"


def seed_entries(settings: Settings, user: str, n: int = 6) -> list[str]:
    table = table_for(settings)
    values = [canary(user, f"entry{i}x") for i in range(n)]
    with session_scope(settings) as session:
        for i, value in enumerate(values):
            session.execute(
                table.insert().values(
                    id=f"{user}-e{i}", user_id=user, key=f"note_{i}", value=value, category="fact", source_agent_id="a"
                )
            )
    return values


def feed(settings: Settings, user: str) -> None:
    said = f"My favorite color is {canary(user, 'color')}. My secret plan is {canary(user, 'plan')}"
    enqueue_signal(
        "session_end",
        user,
        {"conversation_id": f"c-{user}", "messages": [{"role": "user", "content": said}]},
        agent_id="a",
        settings=settings,
    )
    enqueue_signal(
        "feedback",
        user,
        {"deliverable_id": f"d-{user}", "original": LONG + canary(user, "orig"), "edited": canary(user, "edit")},
        agent_id="a",
        settings=settings,
    )
    enqueue_signal(
        "activity",
        user,
        {"events": [{"action": canary(user, "act"), "at": f"2024-05-{6 + 7 * w:02d}T09:00:00Z"} for w in range(3)]},
        settings=settings,
    )


@pytest.fixture()
def prompts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(purpose, everything sent to the model) for every model call made."""
    seen: list[tuple[str, str]] = []
    real_input_of: Callable[[list[dict[str, Any]]], Any] = offline_model.input_of

    def recording(messages: list[dict[str, Any]]) -> Any:
        seen.append((offline_model.purpose_of(messages), json.dumps(messages, ensure_ascii=False)))
        return real_input_of(messages)

    monkeypatch.setattr(offline_model, "input_of", recording)
    return seen


def owners_in(text: str) -> set[str]:
    return {user for user in USERS if user.replace("-", "") in text}


def test_each_prompt_carries_one_users_entries_and_words_only(
    pg_settings: Settings, prompts: list[tuple[str, str]]
) -> None:
    for user in USERS:
        seed_entries(pg_settings, user)
        feed(pg_settings, user)
    process_pending(pg_settings)
    for user in USERS:
        assert dream_user(pg_settings, user).status == "succeeded"

    by_purpose: dict[str, set[str]] = {}
    for purpose, text in prompts:
        owners = owners_in(text)
        assert len(owners) == 1, (purpose, sorted(owners))
        by_purpose.setdefault(purpose, set()).update(owners)
    # Every user's work reached the model, each in prompts of its own.
    assert by_purpose.get("summarize") == set(USERS)
    assert by_purpose.get("extract_facts") == set(USERS)
    assert by_purpose.get("feedback") == set(USERS)
    # And the canaries reached it at all (the capture sees the real input).
    assert any(canary(USERS[0], "entry0x") in text for _, text in prompts)


def label_values() -> list[tuple[str, str, str]]:
    out = []
    for family in REGISTRY.collect():
        for sample in family.samples:
            out.extend((sample.name, name, value) for name, value in sample.labels.items())
    return out


def test_no_metric_label_carries_a_user_id(pg_settings: Settings) -> None:
    users = ["uid-Zebra-7f3a91", "uid-Quokka-c0ffee", "42424242-beef-4bad-8ace-000000000042"]
    for user in users:
        seed_entries(pg_settings, user)
        feed(pg_settings, user)
    with session_scope(pg_settings) as session:  # one rejected too, as a foreign producer's
        session.execute(
            sql_text("INSERT INTO dream_signals (kind, user_id, payload) VALUES ('session_end', :u, '{}')"),
            {"u": users[0]},
        )
    process_pending(pg_settings)
    detect_routines(pg_settings)
    for user in users:
        dream_user(pg_settings, user)

    labels = label_values()
    families = {name.split("_total")[0].split("_bucket")[0] for name, _, _ in labels}
    assert {"dream_signals_processed", "dream_memory_writes", "dream_llm_requests"} <= families
    exposed = generate_latest(REGISTRY).decode()
    for user in users:
        hashed = user_ref(user, pg_settings.log_hash_key)
        for sample, label, value in labels:
            assert user not in value and hashed not in value, (sample, label, value)
            assert value not in user or len(value) < 8, (sample, label, value)
        assert user not in exposed and hashed not in exposed
    # The label sets stay bounded: kinds, outcomes, sources, actions, models, purposes.
    assert all(len(value) <= 64 for _, _, value in labels)


def test_a_full_pipeline_logs_no_value_transcript_or_feedback(
    pg_settings: Settings,
    captured: io.StringIO,  # noqa: F811 - the fixture imported above
    prompts: list[tuple[str, str]],
) -> None:
    user = USERS[0]
    seed_entries(pg_settings, user)
    feed(pg_settings, user)
    report = process_pending(pg_settings)
    assert report.processed == 3
    detect_routines(pg_settings)
    outcome = dream_user(pg_settings, user)
    assert outcome.status == "succeeded" and outcome.entries_summarized > 0
    assert prompts  # the model saw the canaries; the logs must not

    output = captured.getvalue()
    events = {json.loads(line)["event"] for line in output.splitlines() if line.strip()}
    assert {"signal_done", "dream_finished"} <= events  # the pipeline did log
    leaks = sorted(set(re.findall(r"zq\w+?qz", output)))
    assert leaks == []
    assert user not in output
    for word in ("favorite color", "secret plan", "Thanks for asking", "revenue"):
        assert word not in output


HOSTILE = [
    "'); DROP TABLE usermemories; --",
    "<script>alert('x')</script>",
    "{{7*7}}",
    "${7*7}",
    "\x01\x02\x07\x08\x0b\x0c\x1b[31mred\x1b[0m\x7f",
    "line\nbreak\r\ttab",
    "\u202eevil\u200b\ufeff",
    'quote " and \\ backslash',
    "%s %d %(user)s",
]


def test_sql_and_markup_keys_and_values_are_stored_verbatim(pg_settings: Settings) -> None:
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        for i, text in enumerate(HOSTILE):
            upsert_entry(
                session,
                table,
                user_id="verbatim",
                key=text,
                value=text + f" #{i}",
                category="fact",
                source="test",
                source_agent_id=f"a{i}",  # groups of one: the dream run below keeps them as they are
            )
    # Through the signal path too: a user who says it about themselves.
    said = "My favorite quote is x'); DROP TABLE usermemories; -- <script>alert(1)</script> {{7*7}}"
    enqueue_signal(
        "session_end",
        "verbatim2",
        {"conversation_id": "c", "messages": [{"role": "user", "content": said}]},
        settings=pg_settings,
    )
    assert process_pending(pg_settings).processed == 1
    assert dream_user(pg_settings, "verbatim").status == "succeeded"

    with session_scope(pg_settings) as session:
        rows = {r.key: r.value for r in session.execute(select(table.c.key, table.c.value))}
        count = session.scalar(select(table.c.id).limit(1))
    assert count is not None  # the table is still there
    for i, text in enumerate(HOSTILE):
        assert rows.get(text) == text + f" #{i}", text
    assert rows["favorite_quote"] == "x'); DROP TABLE usermemories; -- <script>alert(1)</script> {{7*7}}"


def test_a_run_the_database_refuses_logs_and_keeps_no_value_of_the_rows_it_wrote(
    pg_settings: Settings,
    captured: io.StringIO,  # noqa: F811 - the fixture imported above
) -> None:
    """The host's table refuses every write (a check no new row passes): the error the
    run logs and keeps names the constraint, not the rows, whose values both the
    driver's detail (``Failing row contains ...``) and the statement's parameters hold."""
    user = USERS[1]
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        for i in range(5):
            session.execute(
                table.insert().values(
                    id=f"{user}-n{i}", user_id=user, key=f"note_{i}", value=canary(user, f"note{i}x"),
                    category="context", source_agent_id="a",
                )
            )  # fmt: skip
        session.execute(sql_text("ALTER TABLE usermemories ADD CONSTRAINT host_frozen CHECK (false) NOT VALID"))
    try:
        with pytest.raises(IntegrityError):  # for the worker's retry policy to judge
            dream_user(pg_settings, user)
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text("ALTER TABLE usermemories DROP CONSTRAINT host_frozen"))
    with session_scope(pg_settings) as session:
        status, kept = session.execute(
            sql_text("SELECT status, error FROM dream_runs WHERE user_id = :u"), {"u": user}
        ).one()
    assert status == "failed" and "host_frozen" in kept
    output = captured.getvalue()
    assert "dream_failed" in output and "host_frozen" in output
    for place in (output, kept):
        assert re.findall(r"zq\w+?qz", place) == []
        assert user not in place


def test_a_failed_run_keeps_no_value_when_the_value_has_a_newline(
    pg_settings: Settings,
    captured: io.StringIO,  # noqa: F811 - the fixture imported above
) -> None:
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        for i in range(5):
            session.execute(
                table.insert().values(
                    id=f"n{i}",
                    user_id="alice",
                    key=f"note_{i}",
                    value=f"zqsecret{i}qz\nsecond line",
                    category="context",
                    source_agent_id="a",
                )
            )
        # A host rule on its own column of context notes: a number, checked by a cast.
        session.execute(
            sql_text(
                "ALTER TABLE usermemories ADD CONSTRAINT host_numeric CHECK "
                "(category <> 'context' OR (value #>> '{}')::numeric IS NOT NULL) NOT VALID"
            )
        )
    try:
        with pytest.raises(DataError):
            dream_user(pg_settings, "alice")
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text("ALTER TABLE usermemories DROP CONSTRAINT host_numeric"))
    with session_scope(pg_settings) as session:
        kept = session.scalar(sql_text("SELECT error FROM dream_runs WHERE user_id = 'alice'"))
    assert "zqsecret" not in kept
    assert "zqsecret" not in captured.getvalue()
