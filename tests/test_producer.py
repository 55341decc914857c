"""The producer side: enqueue_signal and `reverie enqueue` refuse bad input clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from sqlalchemy import select
from typer.testing import CliRunner

from store.db import session_scope
from store.models import Signal
from worker.cli import app
from worker.errors import InvalidSignal
from worker.payloads import validate_signal
from worker.producer import enqueue_signal
from worker.settings import Settings, get_settings

OK = {"conversation_id": "c", "messages": [{"role": "user", "content": "hi"}]}


def signal_count(settings: Settings) -> int:
    with session_scope(settings) as session:
        return len(session.scalars(select(Signal.id)).all())


@pytest.mark.parametrize(
    ("kind", "user", "payload", "field"),
    [
        ("session_end", "u", {"messages": []}, "payload"),
        ("session_end", "u", {"conversation_id": 5, "messages": []}, "payload.conversation_id"),
        ("session_end", "u", {"conversation_id": "c", "messages": "hi"}, "payload.messages"),
        (
            "session_end",
            "u",
            {"conversation_id": "c", "messages": [{"role": "bot", "content": "x"}]},
            "payload.messages[0].role",
        ),
        ("session_end", "u", {**OK, "ended_at": "tomorrow"}, "payload.ended_at"),
        ("session_end", "u", {**OK, "ended_at": "2024-02-30T00:00:00"}, "payload.ended_at"),
        ("session_end", "u", {"conversation_id": "c\x00", "messages": []}, "payload.conversation_id"),
        (
            "session_end",
            "u",
            {"conversation_id": "c", "messages": [{"role": "user", "content": "x"}] * 2001},
            "payload.messages",
        ),
        ("feedback", "u", {"deliverable_id": "d", "original": "a" * (1024 * 1024), "edited": "b"}, "payload"),
        ("feedback", "u", {"deliverable_id": "d", "original": 1, "edited": "b"}, "payload.original"),
        ("activity", "u", {"events": [{"action": "a", "at": "noon"}]}, "payload.events[0].at"),
        ("activity", "u", {"events": [{"action": "a"}]}, "payload.events[0]"),
        ("gossip", "u", OK, "kind"),
        ("session_end", "", OK, "user_id"),
        ("session_end", 42, OK, "user_id"),
        ("session_end", "u\x00", OK, "user_id"),
        ("session_end", "u" * 256, OK, "user_id"),
        ("session_end", "u", [OK], "payload"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_writes_nothing(
    pg_settings: Settings, kind: Any, user: Any, payload: Any, field: str
) -> None:
    with pytest.raises(InvalidSignal) as info:
        enqueue_signal(kind, user, payload, settings=pg_settings)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert signal_count(pg_settings) == 0


def test_duplicate_is_a_no_op_that_says_so(store_settings: Settings) -> None:
    first = enqueue_signal("session_end", "u", OK, settings=store_settings)
    again = enqueue_signal("session_end", "u", OK, settings=store_settings)
    assert first.created and not again.created
    assert again.signal_id == first.signal_id
    assert signal_count(store_settings) == 1


def test_idempotency_keys_are_per_user(store_settings: Settings) -> None:
    key = "session_end:c-1001"
    mallory = enqueue_signal("session_end", "mallory", OK, idempotency_key=key, settings=store_settings)
    alice = enqueue_signal("session_end", "alice", OK, idempotency_key=key, settings=store_settings)
    assert mallory.created and alice.created
    assert alice.signal_id != mallory.signal_id
    again = enqueue_signal(
        "session_end", "alice", {**OK, "conversation_id": "d"}, idempotency_key=key, settings=store_settings
    )
    assert (again.signal_id, again.created) == (alice.signal_id, False)
    with session_scope(store_settings) as session:
        rows = session.execute(select(Signal.user_id, Signal.idempotency_key).order_by(Signal.id)).all()
    assert [tuple(r) for r in rows] == [("mallory", key), ("alice", key)]


def test_sql_producer_conflicts_per_user(pg_settings: Settings) -> None:
    import psycopg

    insert = (
        "INSERT INTO dream_signals (kind, user_id, payload, idempotency_key) "
        "VALUES ('activity', %s, '{\"events\": []}', 'session_end:c-1001') "
        "ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING id"
    )
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
        first = conn.execute(insert, ("mallory",)).fetchone()
        alice = conn.execute(insert, ("alice",)).fetchone()
        duplicate = conn.execute(insert, ("alice",)).fetchone()
    assert first is not None and alice is not None and first != alice
    assert duplicate is None
    assert signal_count(pg_settings) == 2


@pytest.mark.parametrize(
    "blank",
    ["", "   ", "\t\n", "\u3000", "\xa0 \u2003"],
    ids=["empty", "spaces", "tab-newline", "ideographic", "nbsp-em"],
)
def test_a_sql_insert_with_a_blank_key_is_refused_not_dropped_as_a_duplicate(
    store_settings: Settings, blank: str
) -> None:
    """A blank key is refused at the INSERT, as the CLI and Python producers refuse it:
    taken as a key, it made every later signal of that user a duplicate that ``ON
    CONFLICT DO NOTHING`` dropped without a word. A NULL key still gets the default."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    insert = text(
        "INSERT INTO dream_signals (kind, user_id, payload, idempotency_key) "
        "VALUES ('activity', 'alice', :payload, :key) ON CONFLICT (user_id, idempotency_key) DO NOTHING"
    )
    for n in range(2):
        with (
            pytest.raises(DBAPIError, match="idempotency_key must not be empty"),
            session_scope(store_settings) as session,
        ):
            session.execute(insert, {"payload": json.dumps({"events": [], "n": n}), "key": blank})
    assert signal_count(store_settings) == 0
    with session_scope(store_settings) as session:
        for n in range(2):
            session.execute(insert, {"payload": json.dumps({"events": [], "n": n}), "key": None})
    assert signal_count(store_settings) == 2


def test_enqueue_inside_the_callers_transaction(pg_settings: Settings) -> None:
    with pytest.raises(RuntimeError), session_scope(pg_settings) as session:
        enqueue_signal("session_end", "u", OK, session=session, settings=pg_settings)
        raise RuntimeError("the producer's own transaction fails")
    assert signal_count(pg_settings) == 0


@pytest.fixture()
def cli_env(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("REVERIE_DATABASE_URL", pg_settings.database_url)
    get_settings.cache_clear()
    yield CliRunner()
    get_settings.cache_clear()


def test_cli_enqueue_bad_input(cli_env: CliRunner, pg_settings: Settings, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"conversation_id": "c", "messages": [{"role": "user"}]}')
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for args in (
        ["enqueue", "gossip", "--user", "u", "--payload", str(bad)],
        ["enqueue", "session_end", "--user", "u", "--payload", str(bad)],
        ["enqueue", "session_end", "--user", "u", "--payload", str(broken)],
        ["enqueue", "session_end", "--user", "u", "--payload", str(tmp_path / "missing.json")],
    ):
        result = cli_env.invoke(app, args)
        assert result.exit_code != 0, args
    assert signal_count(pg_settings) == 0


def test_cli_enqueue_duplicate_says_so(cli_env: CliRunner, pg_settings: Settings, tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(OK))
    args = ["enqueue", "session_end", "--user", "u", "--payload", str(good)]
    assert "enqueued signal" in cli_env.invoke(app, args).output
    second = cli_env.invoke(app, args)
    assert second.exit_code == 0 and "duplicate" in second.output and "nothing written" in second.output
    assert signal_count(pg_settings) == 1


def test_cli_enqueue_never_returns_another_users_signal(
    cli_env: CliRunner, pg_settings: Settings, tmp_path: Path
) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(OK))
    mallory = enqueue_signal("session_end", "mallory", OK, idempotency_key="session_end:c-1001", settings=pg_settings)
    args = ["enqueue", "session_end", "--user", "alice", "--idempotency-key", "session_end:c-1001"]
    result = cli_env.invoke(app, [*args, "--payload", str(good)])
    assert result.exit_code == 0 and "enqueued signal" in result.output
    assert f"signal {mallory.signal_id} " not in result.output
    assert signal_count(pg_settings) == 2


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=30,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "bot"]) | JSON, "content": st.text() | JSON},
    optional={"at": st.text(max_size=30) | JSON},
)
PAYLOADS = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {"conversation_id": st.text(max_size=5) | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON}
    ),
    st.fixed_dictionaries(
        {"deliverable_id": st.text(max_size=5), "original": st.text() | JSON, "edited": st.text() | JSON}
    ),
    st.fixed_dictionaries(
        {"events": st.lists(st.fixed_dictionaries({"action": st.text(), "at": st.text() | JSON}), max_size=3)}
    ),
)


@hyp_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["session_end", "feedback", "activity", "other"]),
    user=st.text(max_size=5) | JSON,
    payload=PAYLOADS,
)
def test_validator_never_crashes(kind: str, user: Any, payload: Any) -> None:
    settings = Settings(_env_file=None)
    try:
        validate_signal(kind, user, payload, settings)
    except InvalidSignal as exc:
        assert exc.field.startswith(("kind", "user_id", "payload"))
