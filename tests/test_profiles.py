"""Profiles: visibility, the token budget, freshness, reading, erasure (real PostgreSQL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from sqlalchemy import delete, select, update

from store.db import session_scope
from store.erase import rows_about
from store.memories import table_for
from store.models import Profile
from tasks import profiles
from tasks.dream import dream_users
from tasks.erase import erase_user
from tests.dream_seed import entry, seed
from worker import llm
from worker.policy import book
from worker.profile_text import Layout, assemble, cut, estimate
from worker.profiles_reader import get_for_prompt
from worker.settings import Settings

REVERIE = [sys.executable, "-c", "from worker.cli import main; main()"]


def _stored(settings: Settings, user: str) -> dict[str, Profile]:
    with session_scope(settings) as session:
        rows = session.scalars(select(Profile).where(Profile.user_id == user)).all()
        session.expunge_all()
    return {row.agent_id: row for row in rows}


def _refresh(settings: Settings, users: list[str]) -> dict[str, list[int]]:
    with session_scope(settings) as session:
        return profiles.refresh(session, settings, users, book=book(settings, {}))


def _world(user: str) -> list[dict[str, Any]]:
    return [
        entry(user, "home_city", "Lisbon", visibility="global", agent="agent-a"),
        entry(user, "favorite_editor", "vim", category="preference", visibility="self", agent="agent-a"),
        entry(user, "secret_of_b", "canary-b-self", visibility="self", agent="agent-b"),
        entry(user, "team_channel", "#ops", visibility="group", agent="agent-b"),
    ]


def test_each_agent_sees_its_own_and_global_entries_never_another_agents_self(pg_settings: Settings) -> None:
    seed(pg_settings, _world("u1"))
    outcome = dream_users(pg_settings, ["u1"])[0]
    assert outcome.status == "succeeded"
    assert outcome.profiles_built == 3  # agent-a, agent-b and the agent-less one
    stored = _stored(pg_settings, "u1")
    assert set(stored) == {"", "agent-a", "agent-b"}
    a, b, none = stored["agent-a"].text, stored["agent-b"].text, stored[""].text
    assert "Lisbon" in a and "Lisbon" in b and "Lisbon" in none
    assert "vim" in a and "vim" not in b and "vim" not in none
    assert "canary-b-self" in b and "canary-b-self" not in a and "canary-b-self" not in none
    assert "#ops" in b and "#ops" not in a
    assert "## Preferences\n- favorite editor: vim\n" in a
    # An agent that owns no entries reads the global ones.
    other = get_for_prompt("u1", "agent-z", settings=pg_settings)
    assert other.text == none and "canary" not in other.text


def test_contradicted_entries_are_marked_and_stale_ones_hidden(pg_settings: Settings) -> None:
    rows = [
        entry("u1", "city", "Paris", visibility="global", agent=None),
        entry("u1", "old_hobby", "chess-stale", visibility="global", agent=None, age_days=200),
    ]
    rows[0]["conflicted"] = True
    seed(pg_settings, rows)
    _refresh(pg_settings, ["u1"])
    text = _stored(pg_settings, "u1")[""].text
    assert "- city: Paris (contradicted)\n" in text
    assert "chess-stale" not in text


def test_only_users_whose_memory_changed_are_rebuilt(pg_settings: Settings) -> None:
    seed(pg_settings, _world("u1") + _world("u2"))
    first = {o.user_id: o.profiles_built for o in dream_users(pg_settings, ["u1", "u2"])}
    assert first == {"u1": 3, "u2": 3}
    built = {u: _stored(pg_settings, u)[""].built_at for u in ("u1", "u2")}

    built_before = REGISTRY.get_sample_value("dream_profiles_built_total") or 0.0
    again = {o.user_id: o.profiles_built for o in dream_users(pg_settings, ["u1", "u2"])}
    assert again == {"u1": 0, "u2": 0}
    assert (REGISTRY.get_sample_value("dream_profiles_built_total") or 0.0) == built_before
    assert {u: _stored(pg_settings, u)[""].built_at for u in ("u1", "u2")} == built

    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:  # the application's own write
        session.execute(update(table).where(table.c.user_id == "u1", table.c.key == "home_city").values(value="Porto"))
    assert {o.user_id: o.profiles_built for o in dream_users(pg_settings, ["u1", "u2"])} == {"u1": 3, "u2": 0}
    assert REGISTRY.get_sample_value("dream_profiles_built_total") == built_before + 3
    assert "Porto" in _stored(pg_settings, "u1")["agent-a"].text

    with session_scope(pg_settings) as session:  # the application deletes agent-b's entries
        session.execute(delete(table).where(table.c.user_id == "u2", table.c.source_agent_id == "agent-b"))
    assert {o.user_id: o.profiles_built for o in dream_users(pg_settings, ["u1", "u2"])} == {"u1": 0, "u2": 2}
    assert set(_stored(pg_settings, "u2")) == {"", "agent-a"}


def _rows(draw_values: list[tuple[str, Any, str, int, int, bool]]) -> list[SimpleNamespace]:
    base = datetime(2026, 1, 1)
    return [
        SimpleNamespace(
            id=f"e{i}",
            key=key,
            value=value,
            category=category,
            visibility="global",
            source_agent_id=None,
            conflicted=conflicted,
            access_count=recalls,
            created_at=base,
            updated_at=base + timedelta(hours=age),
            last_recalled_at=None,
        )
        for i, (key, value, category, age, recalls, conflicted) in enumerate(draw_values)
    ]


_values = st.one_of(
    st.text(max_size=60),
    st.text(min_size=2000, max_size=4000),
    st.just(""),
    st.integers(),
    st.lists(st.text(max_size=10), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.none(),
)
_entries = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=40),
        _values,
        st.sampled_from(["fact", "preference", "context", "property", "legacy", "work", "task"]),
        st.integers(0, 2000),
        st.integers(0, 50),
        st.booleans(),
    ),
    max_size=120,
)


@hyp_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(entries=_entries, budget=st.integers(50, 8000), smaller=st.floats(0.0, 1.0))
def test_budget_is_never_exceeded_and_a_smaller_read_cuts_as_the_builder(
    entries: list[tuple[str, Any, str, int, int, bool]], budget: int, smaller: float
) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]

    def count(text: str) -> int:
        return llm.count_text_tokens(settings, text) if text else 0

    rows = _rows(entries)
    built = profiles.build(rows, budget, count)
    assert count(built.text) == built.tokens <= budget
    assert built.included + built.left_out == len(rows)
    if built.left_out:
        assert built.text.endswith(
            f"({built.left_out} more {'entry' if built.left_out == 1 else 'entries'} left out)\n"
        )
    assert built.text.count("\n- ") + built.text.startswith("- ") == built.included
    # A reader with a smaller budget, with the stored counts only, makes the builder's cut.
    low = int(budget * smaller)
    again = profiles.build(rows, low, count)
    layout = Layout.from_json(json.loads(json.dumps(built.layout.to_json())))
    kept = cut(layout, low)
    reader_text = assemble(layout.lines[:kept], layout.total - kept) if estimate(layout, kept) <= low else ""
    assert (kept, reader_text) == (again.included, again.text)
    assert count(reader_text) <= low


def test_smaller_budget_read_from_the_database(pg_settings: Settings) -> None:
    rows = [
        entry("u1", f"fact_{i:03d}", f"value number {i} " * 3, visibility="global", age_days=1 + i / 100)
        for i in range(60)
    ]
    seed(pg_settings, rows)
    _refresh(pg_settings, ["u1"])
    whole = get_for_prompt("u1", settings=pg_settings)
    assert whole.entries_included == 60 and whole.entries_left_out == 0
    small = get_for_prompt("u1", token_budget=120, settings=pg_settings)
    assert 0 < small.entries_included < 60
    assert small.entries_left_out == 60 - small.entries_included
    assert llm.count_text_tokens(pg_settings, small.text) <= small.tokens <= 120
    # The newest entries are kept: the ranking's prefix.
    assert "fact 000" in small.text and "fact 059" not in small.text
    assert small.text.endswith(f"({small.entries_left_out} more entries left out)\n")
    # The same as a build at that budget.
    rebuilt = pg_settings.model_copy(update={"profile_token_budget": 120})
    with session_scope(rebuilt) as session:
        session.execute(delete(Profile))
    _refresh(rebuilt, ["u1"])
    assert _stored(rebuilt, "u1")[""].text == small.text


def test_erasure_removes_profiles_and_no_profile_holds_another_users_data(pg_settings: Settings) -> None:
    seed(
        pg_settings,
        [
            entry("u1", "code", "canary-one", visibility="global"),
            entry("u2", "code", "canary-two", visibility="global"),
        ],
    )
    dream_users(pg_settings, ["u1", "u2"])
    for user, mine, theirs in (("u1", "canary-one", "canary-two"), ("u2", "canary-two", "canary-one")):
        for profile in _stored(pg_settings, user).values():
            assert theirs not in profile.text and theirs not in json.dumps(profile.layout)
        assert mine in _stored(pg_settings, user)[""].text
    erase_user(pg_settings, "u1")
    with session_scope(pg_settings) as session:
        assert rows_about(session, pg_settings, "u1")["dream_profiles"] == 0
    assert _stored(pg_settings, "u1") == {}
    assert get_for_prompt("u1", settings=pg_settings).built_at is None
    assert set(_stored(pg_settings, "u2")) == {"", "agent-a"}


def _cli(args: list[str], settings: Settings) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env["REVERIE_DATABASE_URL"] = settings.database_url
    return subprocess.run(REVERIE + args, capture_output=True, text=True, env=env, timeout=120, check=False)


def test_cli_profile_json_and_unknown_user(pg_settings: Settings) -> None:
    seed(pg_settings, _world("u1"))
    dream_users(pg_settings, ["u1"])
    shown = _cli(["profile", "u1", "--agent", "agent-a", "--budget", "500", "--json"], pg_settings)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    keys = {"user_id", "agent_id", "text", "tokens", "budget", "entries_included", "entries_left_out", "built_at"}
    assert keys <= set(data)
    assert data["user_id"] == "u1" and data["agent_id"] == "agent-a" and "vim" in data["text"]
    assert data["tokens"] <= data["budget"] <= 500
    missing = _cli(["profile", "nobody"], pg_settings)
    assert missing.returncode == 1
    assert "Traceback" not in missing.stderr
    lines = [line for line in missing.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no profile yet for user nobody" in lines[0]


def test_reader_imports_neither_celery_nor_litellm() -> None:
    script = (
        "import sys\n"
        "from worker.profiles_reader import get_for_prompt\n"
        "print('celery' in sys.modules, 'litellm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
