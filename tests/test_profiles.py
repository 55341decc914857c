"""Profiles: visibility, the token budget, freshness, reading, erasure (real PostgreSQL)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import unicodedata
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from sqlalchemy import case, delete, select, update
from sqlalchemy import text as sql_text

from store.db import session_scope
from store.erase import rows_about
from store.memories import table_for
from store.models import Profile
from store.types import now
from tasks import profile_writer, profiles
from tasks.dream import dream_users
from tasks.erase import erase_user
from tests.dream_seed import entry, seed
from tests.scripted_model import SCRIPTED_REPLY, scripted_settings
from worker import llm
from worker.policy import book
from worker.profile_text import cut, estimate
from worker.profile_text import value_text as fmt_value_text
from worker.profiles_reader import from_stored, get_for_prompt
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
    if built.left_out and built.included:
        assert built.text.endswith(
            f"({built.left_out} more {'entry' if built.left_out == 1 else 'entries'} left out)\n"
        )
    if not built.included:
        assert built.text == ""  # no entry fits: empty, not a line saying how many were left out
    assert built.text.count("\n- ") + built.text.startswith("- ") == built.included
    # A reader with a smaller budget, with the stored counts only, makes the builder's cut.
    low = int(budget * smaller)
    again = profiles.build(rows, low, count)
    read = from_stored(_stored_row(built), None, low)
    assert (read.entries_included, read.text) == (again.included, again.text)
    assert count(read.text) <= read.tokens <= low


def _stored_row(built: profiles.Built) -> SimpleNamespace:
    """A built profile as the database hands it to a reader (its layout through JSON)."""
    return SimpleNamespace(
        user_id="u",
        text=built.text,
        tokens=built.tokens,
        budget=built.budget,
        entries_included=built.included,
        entries_left_out=built.left_out,
        built_at=None,
        layout=json.loads(json.dumps(built.layout.to_json())),
    )


@pytest.mark.parametrize(
    "word", ["telecommunications", "internationalization", "Donaudampfschifffahrt", "1234567890", "東京都"]
)
def test_a_smaller_read_stays_within_its_budget_where_a_counting_window_cuts_a_long_word(word: str) -> None:
    # The count is made over 1,024-character windows: a window's edge inside a word
    # counts the word's pieces, which can take several tokens more than the word. Every
    # budget from 50 to 700 is read from the stored counts alone, and counted for real.
    settings = Settings(_env_file=None)  # type: ignore[call-arg]

    def count(text: str) -> int:
        return llm.count_text_tokens(settings, text) if text else 0

    rows = _rows([(f"k{i:02d}", " ".join([word] * 5), "fact", i, 0, False) for i in range(40)])
    built = profiles.build(rows, 2000, count)
    stored = _stored_row(built)
    over = []
    for low in range(50, 700):
        read = from_stored(stored, None, low)
        if not count(read.text) <= read.tokens <= low:
            over.append((low, read.entries_included, count(read.text), read.tokens))
    assert over == []
    # And the reader keeps what a build at that budget keeps.
    for low in (120, 333, 650, built.tokens):
        read = from_stored(stored, None, low)
        again = profiles.build(rows, low, count)
        assert (read.entries_included, read.text) == (again.included, again.text)


@pytest.mark.parametrize(
    ("model", "total"),
    [("claude-sonnet-4-5", 532), ("claude-sonnet-4-5", 572), ("claude-sonnet-4-5", 720), ("gpt-4o", 532)],
)
def test_a_smaller_read_stays_within_its_budget_whatever_number_the_left_out_line_shows(model: str, total: int) -> None:
    # A tokenizer need not count a larger number in more tokens: Anthropic's counts
    # "(531 more entries left out)" in 9 and 532's in 8. A reader cutting a profile of
    # 532 entries down to one kept went over its budget, and differed from the builder;
    # so did one of 572 or 720 when the bound hung on the budget built with.
    settings = Settings(_env_file=None, llm_model=model)  # type: ignore[call-arg]
    count = profiles.counter(settings)
    rows = _rows([(f"k{i:03d}", f"v{i}", "fact", i, 0, False) for i in range(total)])
    built = profiles.build(rows, 20_000, count)
    assert built.left_out == 0
    stored = _stored_row(built)
    wrong = []
    for low in range(5, 60):
        read = from_stored(stored, None, low)
        again = profiles.build(rows, low, count)
        if not count(read.text) <= read.tokens <= low or read.text != again.text:
            wrong.append((low, read.entries_included, read.tokens, count(read.text), again.included))
    assert wrong == []


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
    assert len(lines) == 1 and "no profile for user nobody: no entries and no schedule" in lines[0]
    # Known, with entries no dream has built a profile of yet: how to build it now.
    seed(pg_settings, [entry("u2", "city", "Lisbon", visibility="global")])
    waiting = _cli(["profile", "u2"], pg_settings)
    assert waiting.returncode == 1
    assert waiting.stderr.strip().endswith(
        "no profile yet for user u2: it is built by the next dream of that user"
        " (`reverie run --user u2` dreams them now)"
    )
    assert _cli(["run", "--user", "u2"], pg_settings).returncode == 0
    assert "Lisbon" in _cli(["profile", "u2"], pg_settings).stdout
    # The command it names runs as pasted into a shell, whatever the id holds.
    for user in ("jane doe", "x;touch pwned", "o'brien", "-dash"):
        seed(pg_settings, [entry(user, "city", "Oslo", visibility="global")])
        hint = _cli(["profile", "--", user], pg_settings).stderr.split("`")[1]
        words = shlex.split(hint)
        assert words[:3] == ["reverie", "run", "--user"] and words[3:] == [user], hint
        assert _cli(words[1:], pg_settings).returncode == 0, hint
        assert "Oslo" in _cli(["profile", "--", user], pg_settings).stdout
    # An empty name is refused as a usage error, as `reverie run --user ""` refuses it.
    for argv in (["profile", ""], ["profile", "u1", "--agent", ""]):
        refused = _cli(argv, pg_settings)
        assert refused.returncode == 2 and "must not be empty" in refused.stderr, refused.stderr


def test_a_user_and_an_agent_named_by_spaces_alone_are_dreamed_read_and_erased(pg_settings: Settings) -> None:
    """The application's rows may name a user or an agent so (a signal may not): the
    commands that look them up take the name as it is, as the dream does."""
    seed(
        pg_settings,
        [
            entry("  ", "city", "Lisbon", visibility="global", agent=None),
            entry("  ", "editor", "vim", visibility="self", agent=" "),
        ],
    )
    assert _cli(["run", "--user", "  "], pg_settings).returncode == 0
    shared = _cli(["profile", "  "], pg_settings)
    assert shared.returncode == 0 and "Lisbon" in shared.stdout and "vim" not in shared.stdout, shared.stderr
    own = _cli(["profile", "  ", "--agent", " "], pg_settings)
    assert own.returncode == 0 and "vim" in own.stdout, own.stderr
    erased = _cli(["erase-user", "  ", "--yes", "--json"], pg_settings)
    assert erased.returncode == 0, erased.stderr
    assert json.loads(erased.stdout)["rows_removed"][table_for(pg_settings).name] == 2
    with session_scope(pg_settings) as session:
        assert set(rows_about(session, pg_settings, "  ").values()) == {0}


def test_cli_says_why_a_built_profile_is_empty_and_prints_nothing_on_stdout(pg_settings: Settings) -> None:
    seed(pg_settings, [entry("u3", "editor", "vim", visibility="self", agent="agent-a")])
    assert _cli(["run", "--user", "u3"], pg_settings).returncode == 0
    cases = {
        ("profile", "u3"): "user u3's profile is empty: it shows the shared entries only",
        (
            "profile",
            "u3",
            "--agent",
            "agent-b",
        ): "for agent agent-b is empty: the last dream of this user found no entry",
        ("profile", "u3", "--agent", "agent-a", "--budget", "0"): "its entry does not fit in 0 tokens",
        # Room for the line saying how many were left out, alone: no entry fits all the same.
        ("profile", "u3", "--agent", "agent-a", "--budget", "8"): "its entry does not fit in 8 tokens",
    }
    for argv, words in cases.items():
        shown = _cli(list(argv), pg_settings)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == ""
        lines = shown.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("reverie: ") and words in lines[0], (argv, shown.stderr)
        assert "vim" not in shown.stderr
    # Built under a budget that holds none of them: a larger --budget cannot help (a reader
    # only cuts what was built), and the line names the build's budget instead.
    tiny = pg_settings.model_copy(update={"profile_token_budget": 9})
    seed(tiny, [entry("u4", f"pet_{i}", "a cat", visibility="global") for i in range(2)])
    dream_users(tiny, ["u4"])
    for argv in (["profile", "u4"], ["profile", "u4", "--budget", "5000"]):
        shown = _cli(argv, pg_settings)
        assert shown.returncode == 0 and shown.stdout == "", shown.stderr
        assert shown.stderr == (
            "reverie: user u4's profile is empty: none of its 2 entries fits in the 9 tokens it was built with "
            "(REVERIE_PROFILE_TOKEN_BUDGET)\n"
        )
    full = _cli(["profile", "u3", "--agent", "agent-a"], pg_settings)
    assert "vim" in full.stdout and full.stderr == ""


@pytest.mark.parametrize(
    ("budget", "error", "words"),
    [
        (float("nan"), TypeError, "not float"),
        (500.0, TypeError, "not float"),
        (True, TypeError, "not bool"),
        ("50", TypeError, "not str"),
        (-1, ValueError, "at least 0"),
    ],
)
def test_get_for_prompt_refuses_a_budget_that_is_not_a_whole_number_and_leaves_the_transaction_usable(
    pg_settings: Settings, budget: object, error: type[Exception], words: str
) -> None:
    seed(pg_settings, _world("u1"))
    dream_users(pg_settings, ["u1"])
    with session_scope(pg_settings) as session:
        with pytest.raises(error, match=words):
            get_for_prompt("u1", "agent-a", budget, session)  # type: ignore[arg-type]
        # The caller's transaction goes on.
        assert "vim" in get_for_prompt("u1", "agent-a", 500, session).text


@pytest.mark.parametrize(
    ("user", "agent", "words"),
    [(5, "agent-a", "user_id must be a string, not int"), ("u1", 7, "agent_id must be a string, not int")],
)
def test_get_for_prompt_refuses_an_id_that_is_not_a_string_and_leaves_the_transaction_usable(
    pg_settings: Settings, user: object, agent: object, words: str
) -> None:
    # Else the database's own error, which aborts the caller's transaction.
    seed(pg_settings, _world("u1"))
    dream_users(pg_settings, ["u1"])
    with session_scope(pg_settings) as session:
        with pytest.raises(TypeError, match=words):
            get_for_prompt(user, agent, None, session)  # type: ignore[arg-type]
        assert "vim" in get_for_prompt("u1", "agent-a", 500, session).text


def test_reader_imports_neither_celery_nor_litellm() -> None:
    script = (
        "import sys\n"
        "from worker.profiles_reader import get_for_prompt\n"
        "print('celery' in sys.modules, 'litellm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


# -- model-written profiles ------------------------------------------------------------


def _about(user: str) -> list[dict[str, Any]]:
    # Three lines of one section, ranked home city, first name, birthday.
    return [
        entry(user, "home_city", "Lisbon", visibility="global", agent=None, age_days=1),
        entry(user, "first_name", "Ana", visibility="global", agent=None, age_days=2),
        entry(user, "birthday", "May 4", visibility="global", agent=None, age_days=3),
    ]


def _deterministic(settings: Settings, user: str) -> dict[str, str]:
    """What the deterministic builder makes of the user's rows now."""
    with session_scope(settings) as session:
        session.execute(delete(Profile).where(Profile.user_id == user))
    _refresh(settings.model_copy(update={"profile_writer": "deterministic"}), [user])
    return {agent: row.text for agent, row in _stored(settings, user).items()}


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _spent(settings: Settings, user: str) -> int:
    from store.models import Run

    with session_scope(settings) as session:
        return int(sum(session.scalars(select(Run.cost_nano).where(Run.user_id == user)).all()))


def test_model_written_profile_under_a_tiny_cap_makes_no_call_and_keeps_the_deterministic_one(
    pg_settings: Settings,
) -> None:
    settings = pg_settings.model_copy(update={"profile_writer": "model", "max_cost_per_day": 1e-9})
    seed(settings, _world("u1"))
    calls = _sample("dream_llm_requests_total", model="offline", outcome="ok")
    not_called = _sample("dream_profile_model_replies_total", verdict="not_called")
    outcome = dream_users(settings, ["u1"])[0]
    assert outcome.status == "succeeded" and outcome.profiles_built == 3
    assert _sample("dream_llm_requests_total", model="offline", outcome="ok") == calls
    assert _sample("dream_profile_model_replies_total", verdict="not_called") == not_called + 3
    assert _spent(settings, "u1") == 0
    stored = _stored(settings, "u1")
    assert {row.layout["writer"] for row in stored.values()} == {"deterministic"}
    assert {agent: row.text for agent, row in stored.items()} == _deterministic(settings, "u1")


def test_a_rewrite_that_adds_a_fact_is_refused_and_counted(pg_settings: Settings) -> None:
    settings = scripted_settings(pg_settings)
    seed(settings, _about("u1"))
    SCRIPTED_REPLY["text"] = json.dumps(
        {"profile": "## About the user\n- home city: Lisbon\n- pet name: Rex\n- first name: Ana\n- birthday: May 4\n"}
    )
    refused = _sample("dream_profile_model_replies_total", verdict="refused")
    assert dream_users(settings, ["u1"])[0].profiles_built == 1
    assert _sample("dream_profile_model_replies_total", verdict="refused") == refused + 1
    kept = _stored(settings, "u1")[""]
    assert "Rex" not in kept.text and kept.layout["writer"] == "deterministic"
    assert kept.text == _deterministic(settings, "u1")[""]
    # The call was made and paid for, under its own purpose.
    assert _spent(settings, "u1") > 0


def test_one_users_failed_build_costs_the_others_no_second_model_call(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model writes every profile; building u2's fails (a value no code foresaw) after
    # u1's profile was written by the model. u1 is not written again (a second call, paid
    # twice), u3 is written once, and u2's old profile stays to the next pass.
    settings = scripted_settings(pg_settings)
    seed(settings, [*_about("u1"), entry("u2", "home_city", "Porto", visibility="global", agent=None), *_about("u3")])
    SCRIPTED_REPLY["text"] = json.dumps({"unchanged": True})
    build_lines = profiles.build_lines

    def failing_for_u2(lines: Any, *args: Any, **kwargs: Any) -> Any:
        if any("Porto" in line.text for line in lines):
            raise ArithmeticError("a value no code foresaw")
        return build_lines(lines, *args, **kwargs)

    monkeypatch.setattr(profiles, "build_lines", failing_for_u2)
    failed = _sample("dream_profile_build_failures_total")
    outcomes = dream_users(settings, ["u1", "u2", "u3"])
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 1), ("succeeded", 0), ("succeeded", 1)]
    assert _sample("dream_profile_build_failures_total") == failed + 1
    # One call each for u1 and u3 (the same rows: the same prompt and cost), none for u2.
    assert _spent(settings, "u1") == _spent(settings, "u3") > 0
    assert _spent(settings, "u2") == 0
    assert set(_stored(settings, "u2")) == set()


def _writer_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The model writer's clock, moved on by what the returned list's one item holds (seconds)."""
    import time as real_time

    shift = [0.0]
    monkeypatch.setattr(profile_writer, "time", SimpleNamespace(monotonic=lambda: real_time.monotonic() + shift[0]))
    return shift


def _dirty(settings: Settings, users: list[str]) -> set[str]:
    from store.models import UserState

    with session_scope(settings) as session:
        marked = select(UserState.user_id).where(UserState.user_id.in_(users), UserState.dirty_since.is_not(None))
        return set(session.scalars(marked))


def test_no_profile_call_starts_once_the_chunks_time_for_model_work_is_up(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model writes every profile, and each call takes the chunk past its time budget
    # (a clock moved on by each call): the user whose call was made is written, the
    # others wait for the next pass with their old profiles, and no call is made twice.
    from tasks.profile_writer import ProfileWriter

    settings = scripted_settings(pg_settings)
    seed(settings, [row for user in ("u1", "u2", "u3") for row in _about(user)])
    SCRIPTED_REPLY["text"] = json.dumps({"unchanged": True})
    shift = _writer_clock(monkeypatch)
    write = ProfileWriter.__call__

    def slow(self: ProfileWriter, *args: Any, **kwargs: Any) -> Any:
        try:
            return write(self, *args, **kwargs)
        finally:
            shift[0] += 3600.0  # the call took an hour

    monkeypatch.setattr(ProfileWriter, "__call__", slow)
    outcomes = dream_users(settings, ["u1", "u2", "u3"], budget_seconds=600)
    assert [(o.user_id, o.status, o.profiles_built) for o in outcomes] == [
        ("u1", "succeeded", 1),
        ("u2", "succeeded", 0),
        ("u3", "succeeded", 0),
    ]
    assert _spent(settings, "u1") > 0 and _spent(settings, "u2") == _spent(settings, "u3") == 0
    assert _stored(settings, "u1")[""].layout["writer"] == "model"
    assert not _stored(settings, "u2") and not _stored(settings, "u3")
    # Left to the next pass, which writes them, and asks nothing again for u1.
    assert _dirty(settings, ["u1", "u2", "u3"]) == {"u2", "u3"}
    first = _spent(settings, "u1")
    dream_users(settings, ["u1", "u2", "u3"])
    assert _spent(settings, "u1") == first and _spent(settings, "u2") == _spent(settings, "u3") == first
    assert {_stored(settings, u)[""].layout["writer"] for u in ("u2", "u3")} == {"model"}


def test_a_pass_killed_amid_the_model_written_profiles_pays_for_none_of_them_twice(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process dies (a kill, not an error it can handle) while the model writes u3's
    # profile: u1's and u2's, paid for, were kept as they were written, so the next pass
    # asks the model for u3's alone.
    from tasks.profile_writer import ProfileWriter

    class Killed(BaseException):
        pass

    settings = scripted_settings(pg_settings)
    seed(settings, [row for user in ("u1", "u2", "u3") for row in _about(user)])
    SCRIPTED_REPLY["text"] = json.dumps({"unchanged": True})
    write = ProfileWriter.__call__

    def killed_at_u3(self: ProfileWriter, user_id: str, *args: Any, **kwargs: Any) -> Any:
        if user_id == "u3":
            raise Killed()
        return write(self, user_id, *args, **kwargs)

    monkeypatch.setattr(ProfileWriter, "__call__", killed_at_u3)
    with pytest.raises(Killed):
        dream_users(settings, ["u1", "u2", "u3"])
    paid = {user: _spent(settings, user) for user in ("u1", "u2", "u3")}
    assert paid["u1"] > 0 and paid["u2"] > 0 and paid["u3"] == 0
    assert {_stored(settings, user)[""].layout["writer"] for user in ("u1", "u2")} == {"model"}
    monkeypatch.setattr(ProfileWriter, "__call__", write)
    dream_users(settings, ["u1", "u2", "u3"])
    assert _spent(settings, "u1") == paid["u1"] and _spent(settings, "u2") == paid["u2"]
    assert _spent(settings, "u3") > 0 and _stored(settings, "u3")[""].layout["writer"] == "model"


def _three_agents(user: str) -> list[dict[str, Any]]:
    return [
        entry(user, "home_city", "Lisbon", visibility="global", agent=None),
        entry(user, "job_title", "Engineer", visibility="self", agent="writer"),
        entry(user, "trip_destination", "Rome", visibility="self", agent="travel"),
    ]


def _model_calls() -> float:
    return _sample("dream_llm_requests_total", model="offline", outcome="ok")


@pytest.mark.parametrize("stop", ["deadline", "interrupted"])
def test_a_user_stopped_between_two_model_written_profiles_keeps_the_paid_one(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    # The model writes u1's three profiles; the time for model work runs out after the
    # first call (the chunk's budget, or the soft time limit in the second call). No call
    # starts after that; the first profile, paid for, is kept, and the next pass asks
    # the model for the two others only.
    from tasks.profile_writer import ProfileWriter
    from worker.errors import Interrupted

    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _three_agents("u1"))
    shift = _writer_clock(monkeypatch)
    write = ProfileWriter.__call__
    made: list[str] = []

    def one_call_then_stop(self: ProfileWriter, user_id: str, agent: str, *args: Any, **kwargs: Any) -> Any:
        if made and stop == "interrupted":
            raise Interrupted("interrupted in the call: SoftTimeLimitExceeded")
        written = write(self, user_id, agent, *args, **kwargs)  # OutOfTime once the time is up
        made.append(agent)
        shift[0] += 3600.0  # the call took an hour
        return written

    monkeypatch.setattr(ProfileWriter, "__call__", one_call_then_stop)
    before = _model_calls()
    [outcome] = dream_users(settings, ["u1"], budget_seconds=600)
    assert _model_calls() == before + 1 and made == [""]
    # The paid profile is written (the closing transaction too writes it), the others wait.
    assert outcome.status == "succeeded" and outcome.profiles_built == 1
    assert set(_stored(settings, "u1")) == {""} and _stored(settings, "u1")[""].layout["writer"] == "model"
    assert _dirty(settings, ["u1"]) == {"u1"}
    monkeypatch.setattr(ProfileWriter, "__call__", write)
    before = _model_calls()
    assert dream_users(settings, ["u1"])[0].profiles_built == 3
    assert _model_calls() == before + 2
    assert {row.layout["writer"] for row in _stored(settings, "u1").values()} == {"model"}


def test_the_soft_time_limit_in_a_single_users_profile_call_leaves_the_user_to_the_next_pass(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dream.run_user's path: the limit in the model's call is not a failed build (no
    # failure counted), and the user is dreamed again soon, not at the next slot.
    from tasks.dream import dream_user
    from worker import llm as gateway
    from worker.errors import Interrupted

    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _about("u1"))

    def interrupted(*_: Any, **__: Any) -> Any:
        raise Interrupted("interrupted in the call: SoftTimeLimitExceeded")

    monkeypatch.setattr(gateway, "complete", interrupted)
    failures = _sample("dream_profile_build_failures_total")
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded" and outcome.profiles_built == 0
    assert _sample("dream_profile_build_failures_total") == failures
    assert _dirty(settings, ["u1"]) == {"u1"}


def test_a_deadline_passed_still_rebuilds_a_model_profile_that_needs_no_call(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A recall changes u1's fingerprint, not the lines the model would be offered: its
    # model-written profiles are kept without a call, so the time being up defers nothing.
    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _three_agents("u1"))
    dream_users(settings, ["u1"])
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(update(table).where(table.c.key == "job_title").values(access_count=5))
    _writer_clock(monkeypatch)[0] = 10.0**6
    before = _model_calls()
    [outcome] = dream_users(settings, ["u1"], budget_seconds=600)
    assert _model_calls() == before and outcome.profiles_built == 3 and not outcome.retry_soon
    assert _dirty(settings, ["u1"]) == set()


def test_a_paid_profile_is_written_by_the_runs_closing_even_where_keeping_it_at_once_failed(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The time runs out after u1's first model-written profile, and writing that profile
    # at once fails (a lock timeout): the transaction that closes the runs writes it, so
    # the next pass asks the model for the two others only.
    from sqlalchemy.exc import OperationalError

    from tasks.profile_writer import ProfileWriter

    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _three_agents("u1"))
    shift = _writer_clock(monkeypatch)
    write = ProfileWriter.__call__

    def an_hour_each(self: ProfileWriter, *args: Any, **kwargs: Any) -> Any:
        written = write(self, *args, **kwargs)
        shift[0] += 3600.0
        return written

    monkeypatch.setattr(ProfileWriter, "__call__", an_hour_each)
    save = profiles.save
    calls = [0]

    def first_save_fails(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise OperationalError("INSERT", {}, Exception("lock timeout"))
        return save(*args, **kwargs)

    monkeypatch.setattr(profiles, "save", first_save_fails)
    before = _model_calls()
    dream_users(settings, ["u1"], budget_seconds=600)
    assert _model_calls() == before + 1 and calls[0] >= 2
    assert _stored(settings, "u1")[""].layout["writer"] == "model"
    monkeypatch.setattr(ProfileWriter, "__call__", write)
    before = _model_calls()
    dream_users(settings, ["u1"])
    assert _model_calls() == before + 2


def test_the_soft_time_limit_stops_the_user_by_user_build_too(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chunk's read failed (a value no code foresaw), so the profiles are built user by
    # user; the soft time limit fires in u1's call: no call starts for u2.
    from worker import llm as gateway
    from worker.errors import Interrupted

    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, [*_three_agents("u1"), *_three_agents("u2")])
    plan = profiles.plan

    def chunk_read_fails(session: Any, settings_: Any, user_ids: Any, **kwargs: Any) -> Any:
        if len(user_ids) > 1:
            raise ValueError("a value no code foresaw")
        return plan(session, settings_, user_ids, **kwargs)

    calls: list[str] = []

    def interrupted(*_: Any, **__: Any) -> Any:
        calls.append("call")
        raise Interrupted("interrupted in the call: SoftTimeLimitExceeded")

    monkeypatch.setattr(profiles, "plan", chunk_read_fails)
    monkeypatch.setattr(gateway, "complete", interrupted)
    dream_users(settings, ["u1", "u2"])
    assert calls == ["call"]
    assert _dirty(settings, ["u1", "u2"]) == {"u1", "u2"}


def test_a_deadline_passed_leaves_users_who_need_no_model_call_to_be_built(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the writer agent's profiles are the model's: once the time for model work is
    # up, u2's deterministic profiles are built all the same.
    settings = pg_settings
    with session_scope(settings) as session:
        from store import policies as policy_store

        policy_store.merge_config(session, "writer", {"profileWriter": "model"})
    seed(settings, [entry("u1", "job_title", "Engineer", visibility="self", agent="writer"), *_about("u2")])
    _writer_clock(monkeypatch)[0] = 10.0**6
    outcomes = {o.user_id: o for o in dream_users(settings, ["u1", "u2"], budget_seconds=600)}
    assert outcomes["u2"].profiles_built == 1 and "writer" not in _stored(settings, "u1")
    assert _dirty(settings, ["u1", "u2"]) == {"u1"}


def test_an_entry_moved_to_another_section_asks_the_model_again(pg_settings: Settings) -> None:
    # The same line under another heading (its category changed) is not what the model
    # wrote the profile from: it is asked again, not kept as it was.
    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(
        settings,
        [
            entry("u1", "coffee", "black, no sugar", category="fact", visibility="global", agent=None),
            entry("u1", "home_city", "Lisbon", visibility="global", agent=None),
        ],
    )
    dream_users(settings, ["u1"])
    assert "## Preferences" not in _stored(settings, "u1")[""].text
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(update(table).where(table.c.key == "coffee").values(category="preference"))
    before = _model_calls()
    dream_users(settings, ["u1"])
    assert _model_calls() == before + 1
    assert "## Preferences\n- coffee: black, no sugar\n" in _stored(settings, "u1")[""].text


def test_the_soft_time_limit_in_a_profile_call_stops_the_chunks_model_work(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The soft time limit fires in u2's call: u1's written profile is kept, u3's call is
    # never made, and both wait for the next pass (not u3 built after the limit, as if the
    # interruption were one user's failure).
    from celery.exceptions import SoftTimeLimitExceeded

    from tasks.profile_writer import ProfileWriter

    settings = scripted_settings(pg_settings)
    seed(settings, [row for user in ("u1", "u2", "u3") for row in _about(user)])
    SCRIPTED_REPLY["text"] = json.dumps({"unchanged": True})
    write = ProfileWriter.__call__

    def limited(self: ProfileWriter, user_id: str, *args: Any, **kwargs: Any) -> Any:
        if user_id == "u2":
            raise SoftTimeLimitExceeded()
        return write(self, user_id, *args, **kwargs)

    monkeypatch.setattr(ProfileWriter, "__call__", limited)
    outcomes = dream_users(settings, ["u1", "u2", "u3"], interrupts=(SoftTimeLimitExceeded,))
    assert [(o.user_id, o.profiles_built) for o in outcomes] == [("u1", 1), ("u2", 0), ("u3", 0)]
    assert _spent(settings, "u1") > 0 and _spent(settings, "u3") == 0
    assert _stored(settings, "u1")[""].layout["writer"] == "model" and not _stored(settings, "u3")
    assert _dirty(settings, ["u1", "u2", "u3"]) == {"u2", "u3"}


def test_a_line_two_entries_show_may_be_written_twice_and_no_more(pg_settings: Settings) -> None:
    # Two entries of one line (the same key and value, owned otherwise): the profile shows
    # it twice, and the model keeping that profile is not refused for it (a refusal on
    # every change, each one paid for).
    settings = scripted_settings(pg_settings)
    seed(
        settings,
        [
            entry("d1", "home_city", "Lisbon", visibility="global", agent="agent-a"),
            entry("d1", "home_city", "Lisbon", visibility="self", agent=None),
            entry("d1", "first_name", "Ana", visibility="global", agent=None),
        ],
    )
    SCRIPTED_REPLY["text"] = json.dumps({"unchanged": True})
    unchanged = _sample("dream_profile_model_replies_total", verdict="unchanged")
    dream_users(settings, ["d1"])
    stored = _stored(settings, "d1")[""]
    assert stored.text.count("- home city: Lisbon\n") == 2
    assert stored.layout["writer"] == "model"
    assert (stored.entries_included, stored.entries_left_out) == (3, 0)
    # The agent-less profile and agent-a's (which shows the same three entries).
    assert set(_stored(settings, "d1")) == {"", "agent-a"}
    assert _sample("dream_profile_model_replies_total", verdict="unchanged") == unchanged + 2
    # Three times is once more than the entries show it: refused.
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(update(table).where(table.c.user_id == "d1", table.c.key == "first_name").values(value="Bea"))
    SCRIPTED_REPLY["text"] = json.dumps(
        {"profile": "## About the user\n- home city: Lisbon\n- home city: Lisbon\n- home city: Lisbon\n"}
    )
    refused = _sample("dream_profile_model_replies_total", verdict="refused")
    dream_users(settings, ["d1"])
    assert _sample("dream_profile_model_replies_total", verdict="refused") == refused + 2
    assert _stored(settings, "d1")[""].layout["writer"] == "deterministic"


def test_a_rewrite_over_the_budget_or_rewording_a_value_is_refused(pg_settings: Settings) -> None:
    settings = scripted_settings(pg_settings).model_copy(update={"profile_token_budget": 12})
    seed(settings, _about("u1"))
    # Every line is an entry's, but the whole is over 12 tokens.
    SCRIPTED_REPLY["text"] = json.dumps(
        {"profile": "## About the user\n- birthday: May 4\n- home city: Lisbon\n- first name: Ana\n"}
    )
    refused = _sample("dream_profile_model_replies_total", verdict="refused")
    dream_users(settings, ["u1"])
    assert _sample("dream_profile_model_replies_total", verdict="refused") == refused + 1
    assert _stored(settings, "u1")[""].layout["writer"] == "deterministic"
    assert _stored(settings, "u1")[""].tokens <= 12
    # The drifting built-in model retouches a value as it rewrites: refused too.
    drifting = pg_settings.model_copy(update={"llm_model": "offline/drift", "profile_writer": "model"})
    seed(drifting, _about("u2"))
    table = table_for(drifting)
    dream_users(drifting, ["u2"])
    with session_scope(drifting) as session:  # the application changes a value: a rewrite follows
        session.execute(update(table).where(table.c.user_id == "u2", table.c.key == "birthday").values(value="May 5"))
    refused = _sample("dream_profile_model_replies_total", verdict="refused")
    dream_users(drifting, ["u2"])
    assert _sample("dream_profile_model_replies_total", verdict="refused") == refused + 1
    assert _stored(drifting, "u2")[""].text == _deterministic(drifting, "u2")[""]


def test_a_change_only_one_agents_profile_shows_costs_one_model_call(pg_settings: Settings) -> None:
    # The model writes every profile. A change to the travel agent's own entry is a
    # change of the user's memory, so all three profiles are looked at; but only the
    # travel agent's offers the model other lines than it wrote from: one call, not three.
    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(
        settings,
        [
            entry("u1", "home_city", "Lisbon", visibility="global", agent=None),
            entry("u1", "job_title", "Engineer", visibility="self", agent="writer"),
            entry("u1", "trip_destination", "Rome", visibility="self", agent="travel"),
        ],
    )

    def calls() -> float:
        return _sample("dream_llm_requests_total", model="offline", outcome="ok")

    before = calls()
    dream_users(settings, ["u1"])
    assert calls() == before + 3
    written = {agent: row.text for agent, row in _stored(settings, "u1").items()}
    assert {row.layout["writer"] for row in _stored(settings, "u1").values()} == {"model"}
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(
            update(table).where(table.c.user_id == "u1", table.c.key == "trip_destination").values(value="Paris")
        )
    before = calls()
    assert dream_users(settings, ["u1"])[0].profiles_built == 3
    assert calls() == before + 1
    after = {agent: row.text for agent, row in _stored(settings, "u1").items()}
    assert after[""] == written[""] and after["writer"] == written["writer"]
    assert "Paris" in after["travel"]
    assert {row.layout["writer"] for row in _stored(settings, "u1").values()} == {"model"}


def test_unchanged_keeps_the_text_and_the_cost_is_recorded_under_purpose_profile(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _about("u1"))
    cost = _sample("dream_llm_cost_usd_total", model="offline", purpose="profile")
    unchanged = _sample("dream_profile_model_replies_total", verdict="unchanged")
    dream_users(settings, ["u1"])
    first = _stored(settings, "u1")[""]
    assert first.layout["writer"] == "model"
    assert _sample("dream_profile_model_replies_total", verdict="unchanged") == unchanged + 1
    assert _sample("dream_llm_cost_usd_total", model="offline", purpose="profile") > cost
    assert _spent(settings, "u1") > 0

    table = table_for(settings)
    with session_scope(settings) as session:  # the application changes a value
        session.execute(update(table).where(table.c.user_id == "u1", table.c.key == "birthday").values(value="May 5"))
    rewritten = _sample("dream_profile_model_replies_total", verdict="rewritten")
    dream_users(settings, ["u1"])
    assert _sample("dream_profile_model_replies_total", verdict="rewritten") == rewritten + 1
    model_text = _stored(settings, "u1")[""].text
    # The built-in model puts the changed line first.
    assert model_text == "## About the user\n- birthday: May 5\n- home city: Lisbon\n- first name: Ana\n"

    with session_scope(settings) as session:  # a recall: the user is rebuilt, no line changed
        session.execute(
            update(table).where(table.c.user_id == "u1", table.c.key == "first_name").values(access_count=3)
        )
    replies = _sample("dream_profile_model_replies_total", verdict="unchanged")
    spent = _spent(settings, "u1")
    assert dream_users(settings, ["u1"])[0].profiles_built == 1
    # The model would be offered the very lines it wrote this profile from: no call, none
    # paid for, and its profile kept.
    assert _sample("dream_profile_model_replies_total", verdict="unchanged") == replies
    assert _spent(settings, "u1") == spent
    kept = _stored(settings, "u1")[""]
    assert kept.text == model_text and kept.layout["writer"] == "model"
    assert model_text != _deterministic(settings, "u1")[""]
    # A reader's smaller budget keeps the start of the model's text (written anew: the
    # comparison above replaced it with the deterministic one).
    with session_scope(settings) as session:
        session.execute(update(table).where(table.c.user_id == "u1", table.c.key == "birthday").values(value="May 6"))
    dream_users(settings, ["u1"])
    assert _stored(settings, "u1")[""].text.startswith("## About the user\n- birthday: May 6\n")
    small = get_for_prompt("u1", token_budget=_stored(settings, "u1")[""].tokens - 1, settings=settings)
    assert small.text.startswith("## About the user\n- birthday: May 6\n") and small.entries_left_out >= 1


def test_profile_metrics_carry_no_user_label(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _world("user-canary-77"))
    dream_users(settings, ["user-canary-77"])
    seen = 0
    for family in REGISTRY.collect():
        if not family.name.startswith(("dream_profile", "dream_llm")):
            continue
        for sample in family.samples:
            seen += 1
            assert not {"user", "user_id"} & set(sample.labels), sample
            assert "user-canary-77" not in json.dumps(sample.labels), sample
    assert seen and _sample("dream_profile_model_replies_total", verdict="unchanged") > 0


# -- the refresh's transactions and clock ------------------------------------------------


def test_the_leases_are_not_locked_while_profiles_are_built(pg_settings: Settings, monkeypatch: Any) -> None:
    import psycopg

    seed(pg_settings, _world("u1"))
    verdicts: list[str] = []
    real_compose = profiles.compose

    def look() -> None:
        url = pg_settings.database_url.replace("+psycopg", "")
        with psycopg.connect(url, autocommit=True) as conn:
            try:
                conn.execute("SELECT 1 FROM dream_user_state WHERE user_id = 'u1' FOR UPDATE NOWAIT")
                verdicts.append("free")
            except psycopg.errors.LockNotAvailable:
                verdicts.append("locked")

    def compose_and_look(*args: Any, **kwargs: Any) -> Any:
        look()
        composed = real_compose(*args, **kwargs)
        look()
        return composed

    monkeypatch.setattr(profiles, "compose", compose_and_look)
    assert dream_users(pg_settings, ["u1"])[0].profiles_built == 3
    assert verdicts == ["free", "free"]


def test_staleness_is_judged_on_the_databases_clock(pg_settings: Settings, monkeypatch: Any) -> None:
    import store.types

    seed(pg_settings, [entry("u1", "home_city", "Lisbon", visibility="global", agent=None, age_days=1)])
    real = store.types.now

    def ahead() -> datetime:  # this host's clock, 200 days ahead of the database's
        return real() + timedelta(days=200)

    monkeypatch.setattr(store.types, "now", ahead)
    monkeypatch.setattr(profiles, "now", ahead, raising=False)
    _refresh(pg_settings, ["u1"])
    assert "Lisbon" in _stored(pg_settings, "u1")[""].text


@hyp_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=_entries, budget=st.integers(0, 4000))
def test_the_one_pass_cut_is_the_largest_prefix_whose_estimate_fits(
    entries: list[tuple[str, Any, str, int, int, bool]], budget: int
) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]

    def count(text: str) -> int:
        return llm.count_text_tokens(settings, text) if text else 0

    layout = profiles.build(_rows(entries), 10**6, count).layout
    fits = [kept for kept in range(len(layout.lines) + 1) if estimate(layout, kept) <= budget]
    assert cut(layout, budget) == max(fits, default=0)


@hyp_settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.text(max_size=30), st.sampled_from(["home_city", "a?", "x.", "42", "é", "_", " k "])),
            st.one_of(
                st.text(max_size=60),
                st.sampled_from(["", " ", "42", ".5", "'s", "Lisbon", "東京", "(x)", "-", ":", "\n"]),
            ),
            st.booleans(),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_a_lines_count_made_of_its_keys_part_and_the_rest_is_the_whole_lines(
    drawn: list[tuple[str, str, bool]],
) -> None:
    # Lines are counted as their key's part plus the rest: exactly the line's count.
    count = profiles.counter(Settings(_env_file=None))  # type: ignore[call-arg]
    assert count.by_lines
    entries = [
        profiles._entry(key, fmt_value_text(value), "fact", "global", None, conflicted=marked)
        for key, value, marked in drawn
    ]
    found = llm._builtin_counter()
    assert found is not None
    assert count.lines(entries) == [found(e.text) for e in entries]
    # (Counted in two parts where a key is followed by a space.)
    assert profiles._entry("home_city", "Lisbon", "fact", "global", None, conflicted=False).head == len("- home city:")


def test_the_recurring_short_texts_are_counted_once_per_process_and_stay_bounded(monkeypatch: Any) -> None:
    # A key's part, a header, a left-out line: each chunk's refresh has the same few,
    # so they are counted once per process (per tokenizer), in a bounded store. A line
    # holding a value is its refresh's own, however short.
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    found = llm._builtin_counter()
    assert found is not None
    encoded: list[str] = []
    real = found._encode
    monkeypatch.setattr(found, "_encode", lambda text: encoded.append(text) or real(text))
    key_part = f"- key {uuid.uuid4().hex}:"
    first, second = profiles.counter(settings), profiles.counter(settings)
    assert first.recurring(key_part) == second.recurring(key_part) == len(real(key_part))
    assert encoded == [key_part]  # the second refresh's counter did not count it again
    value_line = f"- pin: {uuid.uuid4().hex}\n"
    assert first(value_line) == second(value_line) == len(real(value_line))
    assert encoded.count(value_line) == 2
    # What compose counts of a user's lines goes through the store too.
    entry_ = profiles._entry("home_city", f"Lisbon {uuid.uuid4().hex}", "fact", "global", None, conflicted=False)
    encoded.clear()
    assert first.lines([entry_]) == second.lines([entry_]) == [len(real(entry_.text))]
    assert encoded.count("- home city:") <= 1
    # Bounded: the least recently used let go first.
    kept = profiles._recurring_count.cache_info()
    assert kept.maxsize == profiles.RECURRING_TEXTS and kept.currsize <= kept.maxsize


def test_build_profiles_false_builds_none_and_leaves_the_stored_ones(pg_settings: Settings) -> None:
    seed(pg_settings, _world("u1"))
    off = pg_settings.model_copy(update={"build_profiles": False})
    assert dream_users(off, ["u1"])[0].profiles_built == 0
    assert _stored(off, "u1") == {}
    dream_users(pg_settings, ["u1"])
    built = _stored(pg_settings, "u1")
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        session.execute(update(table).where(table.c.user_id == "u1", table.c.key == "home_city").values(value="Porto"))
    assert dream_users(off, ["u1"])[0].profiles_built == 0
    assert {a: p.text for a, p in _stored(off, "u1").items()} == {a: p.text for a, p in built.items()}


@hyp_settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80), limit=st.integers(1, 100))
@example(text="\u200c", limit=1)
@example(text="a\u200db\u202e", limit=10)
def test_a_value_already_plain_is_kept_as_it_is(text: str, limit: int) -> None:
    from worker.profile_text import _plain

    # Control and format characters go, but for spaces and the joiners (ZWNJ, ZWJ) that
    # spell Persian words and join emoji.
    kept = "".join(ch for ch in text if unicodedata.category(ch)[0] != "C" or ch.isspace() or ch in "\u200c\u200d")
    flat = " ".join(kept.split())
    assert _plain(text, limit) == (flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…")


def test_a_refresh_counts_each_line_once_across_the_users_profiles(pg_settings: Settings, monkeypatch: Any) -> None:
    # Global entries are in every agent's profile: their lines are counted once per
    # refresh, not once per profile (a refresh of many users was bound by the tokenizer).
    long = "a value long enough that its line is over sixty-four characters, well over"
    rows = [entry("u1", f"shared_fact_{i}", f"{long} {i}", visibility="global", agent=None) for i in range(12)]
    rows += [entry("u1", f"own_fact_{agent}", f"{long} {agent}", agent=agent) for agent in ("a1", "a2", "a3", "a4")]
    seed(pg_settings, rows)
    counted: list[str] = []
    real_count, real_counter = llm.count_text_tokens, llm.text_counter

    def count_text_tokens(settings: Settings, text: str) -> int:
        counted.append(text)
        return real_count(settings, text)

    def text_counter(settings: Settings) -> Any:
        tokens = real_counter(settings)

        def count(text: str) -> int:
            counted.append(text)
            return tokens(text)

        return count

    monkeypatch.setattr(llm, "count_text_tokens", count_text_tokens)
    monkeypatch.setattr(llm, "text_counter", text_counter)
    made = _refresh(pg_settings, ["u1"])
    assert len(made["u1"]) == 5  # the agent-less profile and one per agent
    assert len(counted) == len(set(counted)), "a text was counted twice in one refresh"
    stored = _stored(pg_settings, "u1")
    for profile in stored.values():
        assert real_count(pg_settings, profile.text) == profile.tokens


def test_the_text_counter_counts_as_count_text_tokens(pg_settings: Settings) -> None:
    count = llm.text_counter(pg_settings)
    for text in ("", "- home city: Lisbon\n", "## Preferences\n", "ünïcødé — 東京 " * 50, "x" * 5000):
        assert count(text) == llm.count_text_tokens(pg_settings, text)


def _seeded_world(users: int = 12, per_user: int = 45) -> list[dict[str, Any]]:
    """A fixed world: ids, times, keys, values, categories, visibilities, owners, recalls
    and contradictions drawn from one seed; times are whole days before today's
    midnight (UTC), so ranking by day and staleness do not depend on the hour."""
    import random
    import uuid

    rng = random.Random(20261123)
    midnight = datetime.now(UTC).replace(tzinfo=None, hour=0, minute=0, second=0, microsecond=0)
    categories = ["fact", "preference", "context", "property", "legacy", "work", "task", "habit", "Preference"]
    words = ["home", "city", "favorite", "editor", "team", "project", "todo", "deadline", "likes", "pet", "job"]
    values: list[Any] = ["Lisbon", "vim", "東京 ünïcødé", "a b  c", "line\nbreak", 42, 3.5, True, None]
    values += [{"a": [1, 2, "x"]}, ["tea", "coffee"], "long " * 60, "  padded  ", "tab\tinside", "— dash"]
    rows: list[dict[str, Any]] = []
    for u in range(users):
        user = f"golden-{u:02d}"
        agents = [f"agent-{a}" for a in range(rng.randint(1, 5))]
        for i in range(per_user):
            days = rng.choice([1, 1, 2, 3, 5, 8, 13, 30, 60, 400])
            at = midnight - timedelta(days=days, seconds=-rng.randint(0, 86_399))
            row = entry(
                user,
                f"{rng.choice(words)}_{rng.choice(words)}_{i % 7}",
                rng.choice(values),
                category=rng.choice(categories),
                visibility=rng.choice(["global", "self", "self", "group"]),
                agent=rng.choice([*agents, None]),
                access_count=rng.choice([0, 0, 1, 2, 5]),
            )
            row.update(
                id=str(uuid.UUID(int=rng.getrandbits(128))),
                created_at=at,
                updated_at=at if rng.random() < 0.8 else at + timedelta(hours=rng.randint(1, 20)),
                conflicted=rng.random() < 0.1,
            )
            rows.append(row)
    return rows


# sha256 of every profile built from ``_seeded_world`` (text, tokens, cut and layout) at
# budgets 2000 and 150: a faster build must build exactly the same profiles. (Made
# again when the self entries no agent owns joined every profile.)
GOLDEN_PROFILES = {
    2000: "1333b7807711ce1a850a2bf4faab9cf2d68b099e3d808ed95607f045c0e8a3ec",
    150: "1605a8d18c749307ae7593421a1f0e88f55d26522a4271a986bec4e489d79f44",
}


@pytest.mark.parametrize("budget", sorted(GOLDEN_PROFILES))
def test_profiles_of_a_seeded_world_are_exactly_as_before(pg_settings: Settings, budget: int) -> None:
    import hashlib

    settings = pg_settings.model_copy(update={"profile_token_budget": budget})
    rows = seed(settings, _seeded_world())
    users = sorted({r["user_id"] for r in rows})
    made = _refresh(settings, users)
    assert len(made) == len(users)
    with session_scope(settings) as session:
        stored = session.execute(
            select(
                Profile.user_id,
                Profile.agent_id,
                Profile.text,
                Profile.tokens,
                Profile.budget,
                Profile.entries_included,
                Profile.entries_left_out,
                Profile.layout,
            ).order_by(Profile.user_id, Profile.agent_id)
        ).all()
    assert len(stored) > 3 * len(users)
    assert any(r.entries_left_out for r in stored) == (budget < 2000)
    for r in stored:
        assert r.tokens == llm.count_text_tokens(settings, r.text) <= budget
    digest = hashlib.sha256(json.dumps([list(r) for r in stored], sort_keys=True, default=str).encode()).hexdigest()
    assert digest == GOLDEN_PROFILES[budget]


@pytest.mark.parametrize("budget", [2000, 250])
def test_profiles_that_fit_whole_are_built_the_short_way_exactly_as_the_long_way(
    pg_settings: Settings, budget: int, monkeypatch: Any
) -> None:
    # The short way (every line fits) and the long one (estimate, cut, count) store the
    # same rows, layout included; both ways are taken in each run.
    settings = pg_settings.model_copy(update={"profile_token_budget": budget})
    rows = seed(settings, _seeded_world())
    users = sorted({r["user_id"] for r in rows})
    taken: list[bool] = []
    real_row = profiles.Whole.row

    def row(self: Any, *args: Any) -> Any:
        fitted = real_row(self, *args)
        taken.append(fitted is not None)
        return fitted

    def stored() -> list[Any]:
        with session_scope(settings) as session:
            found = session.execute(
                select(Profile).order_by(Profile.user_id, Profile.agent_id).execution_options(populate_existing=True)
            ).scalars()
            return [
                (p.user_id, p.agent_id, p.text, p.tokens, p.budget, p.entries_included, p.entries_left_out, p.layout)
                for p in found
            ]

    monkeypatch.setattr(profiles.Whole, "row", row)
    _refresh(settings, users)
    short = stored()
    assert any(taken) and not all(taken), f"{sum(taken)} of {len(taken)} fit whole"
    monkeypatch.setattr(profiles.Whole, "row", lambda *args: None)
    with session_scope(settings) as session:
        session.execute(delete(Profile))
    _refresh(settings, users)
    assert stored() == short


def test_the_tokenizer_is_resolved_once_per_model_not_once_per_refresh(pg_settings: Settings, monkeypatch: Any) -> None:
    from litellm.litellm_core_utils import token_counter

    # A hosted model's name: litellm resolves its tokenizer (the built-in model's count
    # does not go through litellm at all, see tests/test_token_count.py).
    pg_settings = pg_settings.model_copy(update={"llm_model": "gpt-4o-mini"})

    resolved: list[str | None] = []
    real = token_counter._get_count_function

    def resolve(model: str | None, custom: Any = None) -> Any:
        resolved.append(model)
        return real(model, custom)

    monkeypatch.setattr(token_counter, "_get_count_function", resolve)
    monkeypatch.setattr(llm, "_RESOLVED", {}, raising=False)
    seed(pg_settings, _world("u1") + _world("u2"))
    _refresh(pg_settings, ["u1"])
    first = len(resolved)
    assert first and set(resolved) == {llm.model_name(pg_settings)}
    _refresh(pg_settings, ["u2"])
    assert len(resolved) == first, "the second refresh loaded the tokenizer again"
    # One counter per model, so what TokenCount.recurring keeps serves every refresh.
    assert llm.text_counter(pg_settings) is llm.text_counter(pg_settings)
    for user in ("u1", "u2"):
        for profile in _stored(pg_settings, user).values():
            assert profile.tokens == llm.count_text_tokens(pg_settings, profile.text)


def test_a_printable_text_holds_no_character_the_line_drops() -> None:
    # The line format skips its per-character filter for printable text: that is exact
    # only if no printable character is of a control (C*) category, on this Python.
    assert not [c for c in range(sys.maxunicode + 1) if chr(c).isprintable() and unicodedata.category(chr(c))[0] == "C"]


# -- the fast paths hold to the reference ------------------------------------------------


def test_postgresql_ranks_the_rows_exactly_as_the_documented_order(pg_settings: Settings) -> None:
    # The builder takes PostgreSQL's order as it comes; rank_key is the documented order
    # in Python. Ties on every term but the last few, unicode and case in keys, updated
    # and created times out of order, and recalls later than either.
    import random

    from store import profiles as profile_store
    from store.models import EntryState

    rng = random.Random(7)
    noon = datetime(2026, 6, 1, 12, 0, 0)
    keys = ["alpha", "Alpha", "alpha_2", "Äpfel", "émile", "zeta", "Zeta", "_x", "東京", "a b", "ab"]
    rows, recalls = [], []
    for i in range(300):
        category = rng.choice(["fact", "Preference", "context", "work", ""])  # "": no category, a fact
        # One agent per row: the same key recurs (ties broken by id) under the unique keys.
        row = entry("u1", rng.choice(keys), f"v{i}", category=category, visibility="self", agent=f"agent-{i}")
        updated = noon - timedelta(days=rng.choice([0, 0, 1, 2]), hours=rng.choice([0, 0, 5, 13]))
        created = updated - timedelta(hours=rng.choice([0, 30])) if rng.random() < 0.8 else updated + timedelta(hours=3)
        row.update(
            id=f"{rng.randrange(10**6):06d}-{i}",
            created_at=created,
            updated_at=updated,
            access_count=rng.choice([0, 0, 1, 3]),
        )
        rows.append(row)
        if rng.random() < 0.2:
            recalls.append(EntryState(entry_id=row["id"], user_id="u1", last_recalled_at=updated + timedelta(hours=20)))
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        # A host whose keys sort by a language's rules (where "alpha" and "Alpha" sit
        # side by side): the ranking still compares them as Python does.
        session.execute(sql_text(f'ALTER TABLE {table.name} ALTER COLUMN key TYPE varchar(255) COLLATE "en-x-icu"'))
    seed(pg_settings, rows)
    with session_scope(pg_settings) as session:
        session.add_all(recalls)
    policy: dict[str, Any] = {
        "agent_cutoffs": {},
        "default_cutoff": None,
        "protected_categories": (),
        "last_access_column": None,
    }
    with session_scope(pg_settings) as session:
        read = profile_store.read_for_build(session, table, ["u1"], **policy)
        every = profile_store.entries_for_build(session, table, ["u1"], **policy)
    assert read.ranked and read.users == ["u1"] and len(read.rows["u1"]) == len(every) == 300
    id_at = profile_store.BUILD_COLUMNS.index("id")
    assert [r[id_at] for r in read.rows["u1"]] == [r.id for r in sorted(every, key=profiles.rank_key)]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@hyp_settings(max_examples=300, deadline=None)
@given(value=_json_values)
def test_a_value_read_as_json_text_is_shown_as_the_value_itself(value: Any) -> None:
    from worker.profile_text import json_value_text, value_text

    for raw in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=1)):
        assert json_value_text(raw) == value_text(value)


def test_a_value_that_is_not_json_is_shown_as_its_text() -> None:
    from worker.profile_text import json_value_text

    assert json_value_text("Lisbon") == "Lisbon"
    assert json_value_text('"a" "b"') == '"a" "b"'
    assert json_value_text(None) == "null"


@hyp_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(entries=_entries, budget=st.integers(50, 8000))
def test_a_profile_counted_from_its_lines_is_the_profile_counted_whole(
    entries: list[tuple[str, Any, str, int, int, bool]], budget: int
) -> None:
    # The built-in tokenizer's path (lines counted in one call, the text's count made
    # from its lines') builds exactly what counting every text whole builds.
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    fast = profiles.counter(settings)
    assert fast.by_lines

    def whole(text: str) -> int:
        return llm.count_text_tokens(settings, text) if text else 0

    ranked = profiles.ranked_entries(_rows(entries))
    made = profiles.build_ranked(ranked, budget, fast, profiles.header_tokens(fast), by_lines=True)
    reference = profiles.build_ranked(ranked, budget, whole, profiles.header_tokens(whole))
    assert made == reference
    assert whole(made.text) == made.tokens <= budget


def test_a_profile_write_that_fails_leaves_the_runs_closed_and_the_next_pass_builds(
    pg_settings: Settings, monkeypatch: Any
) -> None:
    # A chunk writes its profiles in the transaction that closes its runs, under a
    # savepoint: a failed write costs the runs nothing, and the profiles come next pass.
    seed(pg_settings, _world("u1") + _world("u2"))

    def broken(*args: Any, **kwargs: Any) -> int:
        raise ValueError("the profile write failed")

    real_save = profiles.save
    monkeypatch.setattr(profiles, "save", broken)
    outcomes = dream_users(pg_settings, ["u1", "u2"])
    assert [(o.status, o.profiles_built) for o in outcomes] == [("succeeded", 0), ("succeeded", 0)]
    assert _stored(pg_settings, "u1") == {} and _stored(pg_settings, "u2") == {}
    with session_scope(pg_settings) as session:
        open_runs = session.execute(sql_text("SELECT count(*) FROM dream_runs WHERE status = 'running'")).scalar()
        held = "SELECT count(*) FROM dream_user_state WHERE lock_token IS NOT NULL"
        leases = session.execute(sql_text(held)).scalar()
    assert open_runs == 0 and leases == 0
    monkeypatch.setattr(profiles, "save", real_save)
    assert [o.profiles_built for o in dream_users(pg_settings, ["u1", "u2"])] == [3, 3]


def test_the_one_statement_look_at_who_changed_agrees_with_comparing_fingerprints(pg_settings: Settings) -> None:
    from store.profiles import BUILD_COLUMNS, Fingerprint, compare_fingerprints, entries_for_build, read_for_build

    users = [f"f{i}" for i in range(1, 8)]
    seed(pg_settings, [row for user in users for row in _world(user)])
    table = table_for(pg_settings)
    policy: dict[str, Any] = {
        "agent_cutoffs": {},
        "default_cutoff": None,
        "protected_categories": (),
        "last_access_column": None,
    }

    def looks() -> tuple[list[str], list[str]]:
        with session_scope(pg_settings) as session:
            both = (
                read_for_build(session, table, [*users, "nobody"], **policy).users,
                sorted(compare_fingerprints(session, table, sorted([*users, "nobody"]))),
            )
        return both

    assert looks() == (users, users)  # rows and no profile yet; no rows and no profile: not changed
    _refresh(pg_settings, users)
    assert looks() == ([], [])
    where = {u: (table.c.user_id == u) & (table.c.key == "home_city") for u in users}
    with session_scope(pg_settings) as session:  # the application's writes, one kind per user
        session.execute(update(table).where(where["f1"]).values(value="Porto"))  # updated_at left alone
        session.execute(update(table).where(where["f2"]).values(access_count=table.c.access_count + 1))
        session.execute(update(table).where(where["f3"]).values(conflicted=True))
        session.execute(delete(table).where(table.c.user_id == "f4"))
        session.execute(update(table).where(where["f5"]).values(updated_at=datetime(2030, 1, 1)))
        session.execute(update(table).where(where["f6"]).values(visibility="self"))
    assert looks() == (users[:6], users[:6])
    # The fingerprint read in the one statement is the one of every row, stale ones too
    # (under a cutoff that makes every unprotected, unrecalled row stale), which are not shown.
    prunes = {**policy, "default_cutoff": datetime(2100, 1, 1)}
    with session_scope(pg_settings) as session:
        read = read_for_build(session, table, users, **prunes)
        every = entries_for_build(session, table, users, **prunes)
    assert read.users == users[:6] and read.rows["f4"] == []
    for user in read.users:
        mine = [row for row in every if row.user_id == user]
        assert read.prints[user] == Fingerprint.of(mine)
        id_at = BUILD_COLUMNS.index("id")
        assert sorted(row[id_at] for row in read.rows[user]) == sorted(row.id for row in mine if not row.stale)
    assert any(row.stale for row in every) and not all(row.stale for row in every)
    # A user known to have changed is built whatever the look says, one with no rows and
    # no profile too (from nothing, as elsewhere).
    with session_scope(pg_settings) as session:
        forced = read_for_build(session, table, ["f7", "ghost"], changed=["f7", "ghost"], **prunes)
    assert forced.users == ["f7", "ghost"] and forced.rows["ghost"] == [] and forced.prints["ghost"] == Fingerprint()
    assert forced.prints["f7"] == Fingerprint.of([row for row in every if row.user_id == "f7"])
    # JIT is off and work_mem larger for the read alone: the caller's transaction gets
    # its own settings back.
    for setting, work_mem in (("on", "1MB"), ("off", "3MB")):
        with session_scope(pg_settings) as session:
            session.execute(sql_text(f"SET LOCAL jit = {setting}"))
            session.execute(sql_text(f"SET LOCAL work_mem = '{work_mem}'"))
            read_for_build(session, table, users, **prunes)
            assert session.execute(sql_text("SELECT current_setting('jit')")).scalar() == setting
            assert session.execute(sql_text("SELECT current_setting('work_mem')")).scalar() == work_mem
    _refresh(pg_settings, users)
    # f4 has no rows left: its agent-less profile holds the empty fingerprint, not changed since.
    assert looks() == ([], [])
    assert _stored(pg_settings, "f4")[""].source_rows == 0


def test_each_agents_policy_decides_which_of_its_entries_are_stale_in_its_profile(pg_settings: Settings) -> None:
    # The read is built once per shape of the policies, the cutoffs bound when it runs:
    # two books of different shapes, and one shape with other cutoffs, each judged right.
    seed(
        pg_settings,
        [
            entry("u1", "a_note", "a-60-days", visibility="group", agent="agent-a", age_days=60),
            entry("u1", "b_note", "b-200-days", visibility="group", agent="agent-b", age_days=200),
            entry("u1", "c_note", "c-60-days", visibility="group", agent="agent-c", age_days=60),
            entry("u1", "shared_note", "global-100-days", visibility="global", agent=None, age_days=100),
        ],
    )

    def shown(configs: dict[str, dict[str, Any]], settings: Settings = pg_settings) -> dict[str, set[str]]:
        with session_scope(settings) as session:
            read = profiles.plan(session, settings, ["u1"], book=book(settings, configs), changed=["u1"])
        composed = profiles.compose(settings, read, book=book(settings, configs))
        values = ("a-60-days", "b-200-days", "c-60-days", "global-100-days")
        return {r["agent_id"]: {v for v in values if v in r["text"]} for r in composed.rows["u1"]}

    # Defaults (90 days) for everyone.
    assert shown({}) == {
        "": set(),
        "agent-a": {"a-60-days"},
        "agent-c": {"c-60-days"},
    }
    # agent-a prunes after 30 days, agent-b never: another shape.
    assert shown({"agent-a": {"pruneStaleAfterDays": 30}, "agent-b": {"pruneStaleAfterDays": 0}}) == {
        "": set(),
        "agent-b": {"b-200-days"},
        "agent-c": {"c-60-days"},
    }
    # The same shape, other cutoffs: agent-a after 90 days, agent-b still never.
    assert shown({"agent-a": {"pruneStaleAfterDays": 90}, "agent-b": {"pruneStaleAfterDays": 0}}) == {
        "": set(),
        "agent-a": {"a-60-days"},
        "agent-b": {"b-200-days"},
        "agent-c": {"c-60-days"},
    }
    # Nobody prunes by default, agent-a after 30 days: the default shape without a cutoff.
    never = pg_settings.model_copy(update={"prune_stale_after_days": 0})
    assert shown({"agent-a": {"pruneStaleAfterDays": 30}}, never) == {
        "": {"global-100-days"},
        "agent-b": {"b-200-days", "global-100-days"},
        "agent-c": {"c-60-days", "global-100-days"},
    }


def test_on_citus_the_build_reads_in_two_statements_with_the_same_result(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Citus cluster takes the two-statement read (its planner does not take the one
    # statement's per-user lookup): both give the same changed users, fingerprints and
    # shown rows, with a host's last-access column and a prune cutoff, and each one
    # agrees with what the other stored.
    from store import profiles as profile_store

    users = [f"c{i}" for i in range(1, 6)]
    rows = [row for user in users for row in _world(user)]
    rows.append(entry("c1", "old_note", "stale-note", visibility="global", agent=None, age_days=200))
    rows.append(entry("c2", "old_but_accessed", "accessed-note", visibility="global", agent=None, age_days=200))
    seed(pg_settings, rows)
    with session_scope(pg_settings) as session:
        session.execute(sql_text("ALTER TABLE usermemories ADD COLUMN last_accessed_at TIMESTAMP"))
        session.execute(
            sql_text("UPDATE usermemories SET last_accessed_at = timezone('utc', now()) WHERE key = 'old_but_accessed'")
        )
    try:
        settings = pg_settings.model_copy(update={"memory_last_access_column": "last_accessed_at"})
        table = table_for(settings)
        policy: dict[str, Any] = {
            "agent_cutoffs": {"agent-b": None},
            "default_cutoff": datetime.now(UTC).replace(tzinfo=None) - timedelta(days=90),
            "protected_categories": ("property",),
            "last_access_column": "last_accessed_at",
        }

        def read(citus: bool) -> profile_store.BuildRead:
            monkeypatch.setattr(profile_store, "_on_citus", lambda session: citus)
            with session_scope(settings) as session:
                return profile_store.read_for_build(session, table, users, **policy)

        one, two = read(False), read(True)
        assert one.ranked and not two.ranked
        assert one.users == two.users == users
        assert one.prints == two.prints
        id_at = profile_store.BUILD_COLUMNS.index("id")
        for user in users:
            assert [r[id_at] for r in one.rows[user]] == [r.id for r in sorted(two.rows[user], key=profiles.rank_key)]
        assert "old_note" not in {r[1] for r in one.rows["c1"]}  # stale: not shown
        assert "old_but_accessed" in {r[1] for r in one.rows["c2"]}  # accessed lately: shown
        for citus, other in ((True, False), (False, True)):
            read(citus)
            monkeypatch.setattr(profile_store, "_on_citus", lambda session, citus=citus: citus)
            with session_scope(settings) as session:
                session.execute(delete(Profile))
                profiles.refresh(session, settings, users, book=book(settings, {}))
            assert read(other).users == [] and read(citus).users == []
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text("ALTER TABLE usermemories DROP COLUMN last_accessed_at"))


def test_a_connection_lost_during_the_build_read_is_a_database_that_went_away(pg_settings: Settings) -> None:
    # The read runs on the driver's own cursor: its errors come out as any statement's
    # do (the connection invalidated, the run told the database went away), and the
    # pool hands out a working connection afterwards.
    from store import profiles as profile_store
    from worker.errors import DatabaseUnavailable

    seed(pg_settings, _world("u1"))
    table = table_for(pg_settings)
    with pytest.raises(DatabaseUnavailable), session_scope(pg_settings) as session:
        profile_store._on_citus(session)  # looked up already, as on a connection in use
        pid = session.execute(sql_text("SELECT pg_backend_pid()")).scalar()
        url = pg_settings.database_url.replace("+psycopg", "")
        with psycopg.connect(url, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        profile_store.read_for_build(
            session,
            table,
            ["u1"],
            agent_cutoffs={},
            default_cutoff=None,
            protected_categories=(),
            last_access_column=None,
        )
    assert _refresh(pg_settings, ["u1"])["u1"]


def test_entries_touched_microseconds_apart_rank_newest_first_as_postgresql_ranks_them() -> None:
    # PostgreSQL compares exact times; so must the Python order (SQLite, Citus).
    start = datetime(2026, 11, 25, 8, 0, 0, 0)

    def row(key: str, when: datetime) -> SimpleNamespace:
        return SimpleNamespace(
            key=key, id=key, updated_at=when, created_at=when, last_recalled_at=None, access_count=0, category="fact"
        )

    for step in range(16):
        older = row("a_older", start + timedelta(microseconds=step))
        newer = row("b_newer", start + timedelta(microseconds=step + 1))
        assert sorted([older, newer], key=profiles.rank_key) == [newer, older]


@pytest.mark.parametrize("name", ["changed", "entries", "current", "built"])
def test_a_host_table_named_like_a_part_of_the_read_holds_each_users_own_rows(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # The read's per-user lookup names the changed users from inside a FROM that holds
    # the host's table: a host table with one of its parts' names must not be taken for
    # it (a table called "changed" once matched every user's rows).
    from store import profiles as profile_store

    settings = pg_settings.model_copy(update={"memory_table": name})
    with session_scope(pg_settings) as session:
        session.execute(sql_text(f"CREATE TABLE {name} (LIKE usermemories INCLUDING ALL)"))
    try:
        seed(
            settings,
            [
                entry("alice", "note", "alice-note", visibility="global", agent=None),
                entry("bob", "diagnosis", "bob-private-diagnosis", visibility="self", agent="agent-b"),
            ],
        )
        table = table_for(settings)
        policy: dict[str, Any] = {
            "agent_cutoffs": {},
            "default_cutoff": None,
            "protected_categories": (),
            "last_access_column": None,
        }
        reads = []
        for citus in (False, True):
            monkeypatch.setattr(profile_store, "_on_citus", lambda session, citus=citus: citus)
            with session_scope(settings) as session:
                reads.append(profile_store.read_for_build(session, table, ["alice"], **policy))
        assert [[row[1] for row in read.rows["alice"]] for read in reads] == [["note"], ["note"]]
        assert reads[0].prints == reads[1].prints
        with session_scope(settings) as session:
            profiles.refresh(session, settings, ["alice"], book=book(settings, {}))
        stored = _stored(settings, "alice")
        assert set(stored) == {""} and "bob" not in stored[""].text
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text(f"DROP TABLE {name}"))


def test_the_build_read_is_compiled_once_not_once_per_refresh(pg_settings: Settings) -> None:
    """Each chunk of a sweep refreshes with its own look up of the memory table: the
    build's statement (compiled once per shape of the policies) must be found again, not
    compiled for every chunk."""
    from store import profiles as profile_store

    seed(pg_settings, _world("u1") + _world("u2") + _world("u3"))
    _refresh(pg_settings, ["u1"])
    before = profile_store._pg_build_sql.cache_info()
    _refresh(pg_settings, ["u2"])
    _refresh(pg_settings, ["u3"])
    after = profile_store._pg_build_sql.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 0)
    assert table_for(pg_settings) is table_for(pg_settings.model_copy())


def test_a_profile_whose_whole_text_fits_keeps_every_entry_and_a_reader_cuts_as_a_build_does(
    store_settings: Settings,
) -> None:
    # Ten long words (values of 250 letters, shown cut at 200): the text spans counting
    # windows whose edges cut words, so the estimate a cut is made with is far above the
    # count. The whole text fits 500 by its count: a build at 500 keeps every entry, and
    # a reader cutting a larger build to 500 gives the same profile.
    rows = [
        entry("w1", f"note_{i}", "a" * 250, visibility="global", agent=None, age_days=1 + i / 10) for i in range(10)
    ]
    at_500 = store_settings.model_copy(update={"profile_token_budget": 500})
    seed(store_settings, rows)
    _refresh(at_500, ["w1"])
    built = get_for_prompt("w1", settings=at_500)
    assert built.entries_included == 10 and built.entries_left_out == 0
    assert built.tokens == profiles.counter(store_settings)(built.text) <= 500
    _refresh(store_settings, ["w1"])  # rebuilt at 2,000 (another budget)
    read = get_for_prompt("w1", token_budget=500, settings=store_settings)
    assert (read.text, read.tokens, read.entries_included) == (built.text, built.tokens, built.entries_included)
    # A budget below the whole text's count cuts, and the reader's cut of the larger
    # build is again what a build at that budget keeps.
    tight = built.tokens - 1
    at_tight = store_settings.model_copy(update={"profile_token_budget": tight})
    read = get_for_prompt("w1", token_budget=tight, settings=store_settings)
    _refresh(at_tight, ["w1"])
    rebuilt = get_for_prompt("w1", settings=at_tight)
    assert read.entries_included == rebuilt.entries_included < 10
    assert read.text == rebuilt.text and read.tokens >= rebuilt.tokens
    # And one cut to a larger budget, read at a budget between its count and its own.
    read = get_for_prompt("w1", token_budget=rebuilt.tokens, settings=at_tight)
    assert (read.text, read.entries_included) == (rebuilt.text, rebuilt.entries_included)


def test_a_budget_of_any_size_reads_the_whole_profile(store_settings: Settings) -> None:
    # "At most this many tokens": a budget past any integer the database binds is no cut.
    seed(store_settings, _world("u1"))
    _refresh(store_settings, ["u1"])
    whole = get_for_prompt("u1", "agent-a", settings=store_settings)
    for budget in (2**31, 2**63, 10**40):
        read = get_for_prompt("u1", "agent-a", budget, settings=store_settings)
        assert (read.text, read.tokens, read.entries_included) == (whole.text, whole.tokens, whole.entries_included)
    from tests.test_cli import run

    shown = run(
        ["profile", "u1", "--agent", "agent-a", "--budget", str(2**63)],
        env={"REVERIE_DATABASE_URL": store_settings.database_url},
    )
    assert shown.returncode == 0 and shown.stdout == whole.text, shown.stderr


def test_a_read_on_its_own_sends_one_statement_and_no_transaction(pg_settings: Settings, tmp_path: Any) -> None:
    """On a prompt's path every round trip counts: a read without the caller's session
    sends its SELECT alone (autocommit): no BEGIN before it and no COMMIT after, and no
    liveness check of the pooled connection either (traced from the connection's start,
    so a pool's pre-ping, sent before the pool's checkout event, would show)."""
    from sqlalchemy import event

    from store.db import get_engine, get_read_engine

    seed(pg_settings, _world("u1"))
    _refresh(pg_settings, ["u1"])
    trace = tmp_path / "trace.txt"
    engine = get_read_engine(pg_settings)

    def traced(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.pgconn.trace(out.fileno())

    with trace.open("w") as out:
        event.listen(engine, "connect", traced)
        try:
            get_for_prompt("u1", "agent-a", settings=pg_settings)  # the pool's connection, made and set up
            out.flush()
            made = trace.stat().st_size
            profile = get_for_prompt("u1", "agent-a", settings=pg_settings)
        finally:
            event.remove(engine, "connect", traced)
    with trace.open() as read_back:
        read_back.seek(made)
        lines = read_back.read().splitlines()
    sent = [line for line in lines if "\tF\t" in line and ("Query" in line or "Parse" in line)]
    assert "vim" in profile.text
    assert len(sent) == 1 and "dream_profiles" in sent[0], sent

    # The dream's own sessions are transactions, on connections the pool checks first.
    with session_scope(pg_settings) as session:
        first = session.execute(sql_text("SELECT now()")).scalar()
        second = session.execute(sql_text("SELECT now()")).scalar()
    assert first == second  # one transaction: one now()
    assert get_engine(pg_settings).pool._pre_ping  # type: ignore[attr-defined]


def test_a_read_on_its_own_is_made_again_where_the_server_dropped_the_pooled_connection(
    pg_settings: Settings,
) -> None:
    """The read pool hands out connections unchecked: one the server ended while it
    sat in the pool (a restart, an idle timeout, an operator) costs the reader one more
    try on a new connection, never an error."""
    import psycopg as driver
    from sqlalchemy import event

    from store.db import get_read_engine

    seed(pg_settings, _world("u1"))
    _refresh(pg_settings, ["u1"])
    pids: list[int] = []
    engine = get_read_engine(pg_settings)

    def made(dbapi_connection: Any, _record: Any) -> None:
        pids.append(dbapi_connection.info.backend_pid)

    event.listen(engine, "connect", made)
    try:
        assert "vim" in get_for_prompt("u1", "agent-a", settings=pg_settings).text
        # The engine's pool may hold connections made before the listener: end them all.
        with driver.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True) as admin:
            ended = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'idle'"
            ).fetchone()
        assert ended is not None and ended[0] >= 1
        assert "vim" in get_for_prompt("u1", "agent-a", settings=pg_settings).text
        assert len(pids) >= 2, pids  # a new connection was made for the second read
    finally:
        event.remove(engine, "connect", made)


def _lines_of(settings: Settings, user: str) -> list[str]:
    return [line for line in _stored(settings, user)[""].text.splitlines() if line.startswith("- ")]


def test_a_change_that_only_reorders_or_moves_a_mark_rebuilds_the_profile(store_settings: Settings) -> None:
    # Every change below leaves the user's row count, latest update, recall sum and
    # number of contradicted rows as they were: only the per-row fingerprint sees them
    # (m2's two keys have the same length and the same first letter).
    settings = store_settings
    seed(
        settings,
        [
            entry("m1", "alpha_note", "A", visibility="global", agent=None, age_days=1),
            entry("m1", "beta_note", "B", visibility="global", agent=None, age_days=3),
            entry("m1", "gamma_note", "C", visibility="global", agent=None, age_days=6),
            entry("m2", "favorite_food", "F", visibility="global", agent=None, age_days=2, access_count=3),
            entry("m2", "favorite_book", "S", visibility="global", agent=None, age_days=2, access_count=10),
        ],
    )
    with session_scope(settings) as session:
        session.execute(sql_text("ALTER TABLE usermemories ADD COLUMN last_accessed_at TIMESTAMP"))
    try:
        settings = settings.model_copy(update={"memory_last_access_column": "last_accessed_at"})
        table = table_for(settings)
        assert set(_refresh(settings, ["m1", "m2"])) == {"m1", "m2"}
        assert _lines_of(settings, "m1") == ["- alpha note: A", "- beta note: B", "- gamma note: C"]
        assert _lines_of(settings, "m2") == ["- favorite book: S", "- favorite food: F"]

        def changed(user: str, where: Any, **values: Any) -> list[str]:
            with session_scope(settings) as session:
                session.execute(update(table).where(table.c.user_id == user, where).values(**values))
            assert set(_refresh(settings, ["m1", "m2"])) == {user}
            return _lines_of(settings, user)

        nine_days_ago = datetime.now(UTC).replace(tzinfo=None) - timedelta(days=9)
        # An older row's time moved further back (the latest update is another row's).
        moved = changed("m1", table.c.key == "beta_note", updated_at=nine_days_ago, created_at=nine_days_ago)
        assert moved == ["- alpha note: A", "- gamma note: C", "- beta note: B"]
        # A recall recorded in the host's own last-access column.
        accessed = changed("m1", table.c.key == "gamma_note", last_accessed_at=datetime.now(UTC).replace(tzinfo=None))
        assert accessed == ["- gamma note: C", "- alpha note: A", "- beta note: B"]
        # Two rows' recalls swapped (the same sum).
        first, both = table.c.key == "favorite_food", table.c.key.in_(["favorite_food", "favorite_book"])
        swapped = changed("m2", both, access_count=case((first, 10), else_=3))
        assert swapped == ["- favorite food: F", "- favorite book: S"]
        # The contradicted mark moved from one row to another (the same count).
        changed("m2", first, conflicted=True)
        marked = changed("m2", both, conflicted=~first)
        assert marked == ["- favorite food: F", "- favorite book: S (contradicted)"]
        assert _refresh(settings, ["m1", "m2"]) == {}  # and nothing more
        if settings.database_url.startswith("postgresql"):
            # The fingerprint does not follow the session's own time zone or date style.
            with session_scope(settings) as session:
                session.execute(sql_text("SET LOCAL TimeZone = 'Asia/Kathmandu'"))
                session.execute(sql_text("SET LOCAL DateStyle = 'German'"))
                assert profiles.refresh(session, settings, ["m1", "m2"], book=book(settings, {})) == {}
    finally:
        with session_scope(store_settings) as session:
            session.execute(sql_text("ALTER TABLE usermemories DROP COLUMN last_accessed_at"))


def test_profiles_built_with_another_budget_or_tokenizer_are_built_again(store_settings: Settings) -> None:
    seed(store_settings, _world("s1") + _world("s2"))
    assert set(_refresh(store_settings, ["s1", "s2"])) == {"s1", "s2"}
    assert _refresh(store_settings, ["s1", "s2"]) == {}
    smaller = store_settings.model_copy(update={"profile_token_budget": 12})
    assert set(_refresh(smaller, ["s1", "s2"])) == {"s1", "s2"}
    stored = _stored(smaller, "s1")["agent-a"]
    assert stored.budget == 12 and stored.tokens <= 12 and stored.entries_left_out > 0
    assert _refresh(smaller, ["s1", "s2"]) == {}
    # Another model, another tokenizer: built again, and counted with it.
    other = smaller.model_copy(update={"llm_model": "offline/drift"})
    assert llm.model_name(other) != llm.model_name(smaller)
    assert set(_refresh(other, ["s1", "s2"])) == {"s1", "s2"}
    assert {p.tokenizer for p in _stored(other, "s2").values()} == {llm.model_name(other)}
    assert _refresh(other, ["s1", "s2"]) == {}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("👨\u200d👩\u200d👧", "👨\u200d👩\u200d👧"),  # one family, not three people
        ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",) * 2,  # a Persian spelling (I want)
        ("paid\u202e evil", "paid evil"),  # a bidirectional override
        ("ok\U000e0069\U000e0067\U000e006e\U000e006f\U000e0072\U000e0065", "ok"),  # hidden tag characters
        ("a\x00b\x1bc\nd", "abc d"),
    ],
)
def test_a_line_keeps_the_joiners_and_drops_other_invisible_characters(value: str, shown: str) -> None:
    from worker.profile_text import value_text

    assert value_text(value) == shown


@pytest.mark.parametrize("chunked", [False, True])
def test_profiles_a_transient_error_kept_from_being_built_are_built_at_the_next_pass(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    from store.models import UserState
    from tasks.dream import dream_user
    from worker.errors import TransientError

    seed(pg_settings, _world("t1"))
    real_plan = profiles.plan

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise TransientError("the database is busy")

    monkeypatch.setattr(profiles, "plan", failing)
    outcome = dream_users(pg_settings, ["t1"])[0] if chunked else dream_user(pg_settings, "t1")
    assert outcome.status == "succeeded" and outcome.profiles_built == 0
    with session_scope(pg_settings) as session:
        state = session.get(UserState, "t1")
        assert state is not None and state.dirty_since is not None  # due again after the dirty delay
    monkeypatch.setattr(profiles, "plan", real_plan)
    again = dream_users(pg_settings, ["t1"])[0] if chunked else dream_user(pg_settings, "t1")
    assert again.profiles_built == 3


def test_a_host_time_of_infinity_is_fingerprinted_and_costs_no_other_user_a_profile(pg_settings: Settings) -> None:
    # '-infinity' is a host's usual "never accessed": no number of microseconds, yet a
    # fingerprint like any other, and the chunk's other users are built as ever.
    seed(pg_settings, _world("i1") + _world("i2"))
    with session_scope(pg_settings) as session:
        session.execute(
            sql_text("ALTER TABLE usermemories ADD COLUMN last_accessed_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity'")
        )
        session.execute(sql_text("UPDATE usermemories SET last_accessed_at = 'infinity' WHERE user_id = 'i2'"))
    try:
        settings = pg_settings.model_copy(update={"memory_last_access_column": "last_accessed_at"})
        assert set(_refresh(settings, ["i1", "i2"])) == {"i1", "i2"}
        assert _refresh(settings, ["i1", "i2"]) == {}
        with session_scope(settings) as session:
            session.execute(sql_text("UPDATE usermemories SET last_accessed_at = now() WHERE user_id = 'i2'"))
        assert set(_refresh(settings, ["i1", "i2"])) == {"i2"}
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text("ALTER TABLE usermemories DROP COLUMN last_accessed_at"))


@pytest.mark.parametrize("zone", ["UTC", "Pacific/Kiritimati", "America/New_York"])
def test_a_host_timestamptz_column_ranks_on_the_python_path_as_in_sql(
    pg_settings: Settings, monkeypatch: Any, zone: str
) -> None:
    # Where the rows are ranked in Python (a Citus cluster; any database but PostgreSQL),
    # a host's last-access column with a time zone ranks as the one statement ranks it,
    # and both rank in UTC whatever zone the server was set up in: not a comparison of
    # aware and naive times that fails the build, nor a day cut at local midnight.
    import store.profiles as profile_store
    from store.db import dispose_engines

    settings = pg_settings.model_copy(update={"memory_last_access_column": "last_accessed_at"})
    seed(settings, [entry("z1", k, v, visibility="global", agent=None) for k, v in (("alpha", "A"), ("beta", "B"))])
    # The same UTC day: alpha updated at noon; beta, older, recalled by the host at 05:00.
    day = (now() - timedelta(days=3)).replace(hour=0, minute=0, second=0, microsecond=0)
    database = settings.database_url.rsplit("/", 1)[1].split("?")[0]
    with session_scope(settings) as session:
        # '-infinity' is a host's usual "never accessed".
        session.execute(
            sql_text("ALTER TABLE usermemories ADD COLUMN last_accessed_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity'")
        )
        session.execute(
            sql_text("UPDATE usermemories SET created_at = :t, updated_at = :t WHERE key = 'alpha'"),
            {"t": day + timedelta(hours=12)},
        )
        session.execute(
            sql_text(
                "UPDATE usermemories SET created_at = :t, updated_at = :t,"
                " last_accessed_at = CAST(:a AS timestamptz) WHERE key = 'beta'"
            ),
            {"t": day - timedelta(days=30), "a": (day + timedelta(hours=5)).isoformat() + "+00"},
        )
        session.execute(sql_text(f"ALTER DATABASE \"{database}\" SET timezone = '{zone}'"))
    dispose_engines()  # new sessions start in the database's zone
    try:
        with session_scope(settings) as session:  # Reverie's own sessions set theirs
            assert session.execute(sql_text("SHOW TimeZone")).scalar() == "UTC"
        assert set(_refresh(settings, ["z1"])) == {"z1"}
        in_sql = _stored(settings, "z1")[""].text
        assert in_sql.index("alpha") < in_sql.index("beta"), in_sql  # the same day: alpha is newer
        with session_scope(settings) as session:
            session.execute(sql_text("DELETE FROM dream_profiles WHERE user_id = 'z1'"))
        monkeypatch.setattr(profile_store, "_on_citus", lambda session: True)
        assert set(_refresh(settings, ["z1"])) == {"z1"}
        assert _stored(settings, "z1")[""].text == in_sql
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql_text(f'ALTER DATABASE "{database}" RESET timezone'))
            session.execute(sql_text("ALTER TABLE usermemories DROP COLUMN last_accessed_at"))
        dispose_engines()


def test_a_value_nested_deeper_than_python_reads_costs_no_other_user_their_profile(pg_settings: Settings) -> None:
    # One user's value, written by the application, nested 3,000 deep: JSON that
    # Python's reader gives up on. The users of the same chunk still get their profiles.
    seed(
        pg_settings,
        [
            entry("u1", "home_city", "Lisbon", visibility="global", agent=None),
            entry("u2", "nested", "x", visibility="global", agent=None),
        ],
    )
    with session_scope(pg_settings) as session:
        session.execute(
            sql_text(
                f"UPDATE {table_for(pg_settings).name} "
                "SET value = CAST(repeat('[', 3000) || repeat(']', 3000) AS jsonb) WHERE user_id = 'u2'"
            )
        )
    dream_users(pg_settings, ["u1", "u2"])
    assert "- home city: Lisbon" in get_for_prompt("u1", settings=pg_settings).text
    assert fmt_value_text(json.loads("[" * 500 + "]" * 500)).startswith("[[[")


def test_turning_the_model_writer_off_rebuilds_its_profiles_at_the_next_pass(pg_settings: Settings) -> None:
    """No memory changed: the model's profiles go the moment its policy is off, not at
    the user's next change (an operator turns it off for a reason)."""
    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(settings, _about("u1"))
    dream_users(settings, ["u1"])
    assert _stored(settings, "u1")[""].layout["writer"] == "model"
    dream_users(settings, ["u1"])  # still on: nothing changed, nothing rebuilt
    assert dream_users(settings, ["u1"])[0].profiles_built == 0

    off = settings.model_copy(update={"profile_writer": "deterministic"})
    assert dream_users(off, ["u1"])[0].profiles_built == 1
    assert _stored(off, "u1")[""].layout["writer"] == "deterministic"
    assert dream_users(off, ["u1"])[0].profiles_built == 0


def test_turning_one_agents_model_writer_off_leaves_the_others_model_profiles_alone(
    store_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the withdrawn agent's profile is built again: another agent's, still the
    model's to write, is neither written again (a model call, for no change of its own)
    nor lost to the deterministic one when no call fits. A user whose memory changed
    meanwhile has every profile built again, as any change does."""
    from store import policies as policy_store

    settings = store_settings
    with session_scope(settings) as session:
        policy_store.merge_config(session, "agent-a", {"profileWriter": "model"})
        policy_store.merge_config(session, "agent-b", {"profileWriter": "model"})
    for user in ("u1", "u2"):
        seed(
            settings,
            [
                entry(user, "pet", "cat", agent="agent-a"),
                entry(user, "team", "blue", agent="agent-b"),
                entry(user, "home_city", "Lisbon", visibility="global", agent=None),
            ],
        )
    dream_users(settings, ["u1", "u2"])
    before = {u: _stored(settings, u) for u in ("u1", "u2")}
    for user in ("u1", "u2"):
        assert {a: p.layout["writer"] for a, p in before[user].items()} == {
            "": "deterministic",
            "agent-a": "model",
            "agent-b": "model",
        }

    calls: list[str | None] = []
    real = llm.complete

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("user_id"))
        return real(*args, **kwargs)

    monkeypatch.setattr(llm, "complete", spy)
    with session_scope(settings) as session:
        policy_store.merge_config(session, "agent-b", {"profileWriter": "deterministic"})
    seed(settings, [entry("u2", "boat", "sloop", agent="agent-a")])  # the application writes for u2
    # The day's budget is spent: no model call fits.
    spent = settings.model_copy(update={"max_cost_per_day": 0.0})
    built = {o.user_id: o.profiles_built for o in dream_users(spent, ["u1", "u2"])}

    after = {u: _stored(settings, u) for u in ("u1", "u2")}
    assert built["u1"] == 1 and "u1" not in calls
    assert after["u1"]["agent-a"].layout["writer"] == "model"
    assert (after["u1"]["agent-a"].text, after["u1"]["agent-a"].built_at) == (
        before["u1"]["agent-a"].text,
        before["u1"]["agent-a"].built_at,
    )
    assert after["u1"][""].built_at == before["u1"][""].built_at
    assert after["u1"]["agent-b"].layout["writer"] == "deterministic"
    assert after["u1"]["agent-b"].built_at > before["u1"]["agent-b"].built_at
    # u2 changed: all three built again, the model's kept out by the spent budget.
    assert built["u2"] == 3
    assert {a: p.layout["writer"] for a, p in after["u2"].items()} == dict.fromkeys(
        ("", "agent-a", "agent-b"), "deterministic"
    )
    assert "- boat: sloop" in after["u2"]["agent-a"].text
    # And nothing is left to do: a second pass builds nothing.
    assert [o.profiles_built for o in dream_users(spent, ["u1", "u2"])] == [0, 0]


def test_a_self_entry_no_agent_owns_is_in_every_profile_and_a_group_one_in_none(store_settings: Settings) -> None:
    rows = [
        entry("u1", "diet", "vegan", visibility="self", agent=None),
        entry("u1", "salary", "95k-hr-only", visibility="group", agent=None),
        entry("u1", "pet", "cat", visibility="self", agent="marketing-bot"),
    ]
    rows[1]["group_ids"] = ["hr"]
    seed(store_settings, rows)
    (outcome,) = dream_users(store_settings, ["u1"])
    assert outcome.status == "succeeded", outcome.error
    for agent in (None, "marketing-bot", "no-such-agent"):
        shown = get_for_prompt("u1", agent, settings=store_settings).text
        assert "- diet: vegan" in shown, (agent, shown)
        assert "95k-hr-only" not in shown, (agent, shown)
        assert ("- pet: cat" in shown) == (agent == "marketing-bot"), (agent, shown)
