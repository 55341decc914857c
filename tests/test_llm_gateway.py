"""The LLM gateway: offline model through litellm, pricing, failures, metrics."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select

from store.db import session_scope
from store.models import Run
from tasks.dream import dream_user
from tests.dream_seed import entries_of, entry, seed
from worker import budget, llm, offline_model
from worker.errors import PermanentError, TransientError
from worker.settings import Settings

MESSAGES = [
    {"role": "system", "content": "[reverie:summarize]\nbe brief"},
    {"role": "user", "content": 'INPUT:\n{"category": "fact", "target": 1, "entries": [{"key": "a", "value": "b"}]}'},
]


def _raise(exc: Exception) -> Any:
    def answer(purpose: str, task: Any) -> str:
        raise exc

    return answer


def _litellm_error(name: str, **extra: Any) -> Exception:
    litellm = llm._load()
    cls = getattr(litellm.exceptions, name)
    return cls(message="scripted", llm_provider=offline_model.PROVIDER, model="offline", **extra)  # type: ignore[no-any-return]


def test_offline_call_reports_usage_and_settles_its_price(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"llm_input_cost_per_token": 1e-6, "llm_output_cost_per_token": 3e-6})
    before = REGISTRY.get_sample_value("dream_llm_requests_total", {"model": "offline", "outcome": "ok"}) or 0
    reply = llm.complete(settings, purpose="summarize", messages=MESSAGES, max_tokens=200)
    assert reply.text.startswith("[") and reply.input_tokens > 0 and reply.output_tokens > 0
    assert reply.cost_usd == pytest.approx(reply.input_tokens * 1e-6 + reply.output_tokens * 3e-6)
    assert budget.day_spent_nano(settings) == round(reply.cost_usd * 1e9)
    assert REGISTRY.get_sample_value("dream_llm_requests_total", {"model": "offline", "outcome": "ok"}) == before + 1


@pytest.mark.parametrize(
    ("name", "extra"),
    [("Timeout", {}), ("RateLimitError", {}), ("ServiceUnavailableError", {}), ("InternalServerError", {})],
)
def test_transient_failures(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, name: str, extra: Any) -> None:
    monkeypatch.setattr(offline_model, "answer", _raise(_litellm_error(name, **extra)))
    with pytest.raises(TransientError):
        llm.complete(pg_settings, purpose="summarize", messages=MESSAGES, max_tokens=50)


@pytest.mark.parametrize("name", ["AuthenticationError", "NotFoundError"])
def test_permanent_failures(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(offline_model, "answer", _raise(_litellm_error(name)))
    with pytest.raises(PermanentError):
        llm.complete(pg_settings, purpose="summarize", messages=MESSAGES, max_tokens=50)
    assert budget.day_spent_nano(pg_settings) == 0


def test_unpriced_model_is_permanent(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"llm_model": "no-such-provider/unpriced-model"})
    with pytest.raises(PermanentError, match="no price"):
        llm.complete(settings, purpose="summarize", messages=MESSAGES, max_tokens=50)


def test_transient_failure_defers_the_group(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(pg_settings, [entry("u1", f"n{i}", "x", category="context") for i in range(6)])
    monkeypatch.setattr(offline_model, "answer", _raise(_litellm_error("RateLimitError")))
    outcome = dream_user(pg_settings, "u1")
    assert (outcome.status, outcome.groups_deferred, outcome.entries_summarized) == ("succeeded", 1, 0)
    assert len(entries_of(pg_settings, "u1")) == 6
    monkeypatch.undo()
    assert dream_user(pg_settings, "u1").entries_summarized == 6


def test_permanent_failure_fails_the_run_with_reason_and_no_partial_write(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(pg_settings, [entry("u1", f"n{i}", "x", category="context") for i in range(6)])
    monkeypatch.setattr(offline_model, "answer", _raise(_litellm_error("AuthenticationError")))
    outcome = dream_user(pg_settings, "u1")
    assert outcome.status == "failed" and "AuthenticationError" in (outcome.error or "")
    assert len(entries_of(pg_settings, "u1")) == 6
    with session_scope(pg_settings) as session:
        run = session.scalars(select(Run)).one()
    assert run.status == "failed" and "AuthenticationError" in (run.error or "") and run.finished_at is not None


def test_a_reply_cut_at_the_ceiling_is_paid_and_refused(pg_settings: Settings) -> None:
    entries = ", ".join(f'{{"key": "k{i}", "value": "a fairly long value number {i}"}}' for i in range(20))
    task = '{"category": "fact", "target": 1, "entries": [' + entries + "]}"
    messages = [MESSAGES[0], {"role": "user", "content": "INPUT:\n" + task}]
    with pytest.raises(llm.MalformedReply, match="cut off at the output ceiling of 16"):
        llm.complete(pg_settings, purpose="summarize", messages=messages, max_tokens=16)
    assert budget.day_spent_nano(pg_settings) > 0


def test_json_is_found_in_fences_and_prose_but_not_in_a_cut_reply() -> None:
    assert llm.has_json('```json\n[{"key": "a"}]\n```') and llm.has_json('Sure: {"entries": []} done')
    assert llm.has_json("[]")
    for text in (
        "",
        "no json here",
        '[{"key": "a", "value": "b"',
        '[{"key": "a"}, {"key": "b',
        '{"entries": [1, 2',
        "42",
        '"just a string"',
    ):
        assert not llm.has_json(text), text


def test_worker_main_process_preloads_the_gateway_before_its_pool_forks(tmp_path: Any) -> None:
    # A fresh interpreter, as `celery worker` starts: the hook must load litellm and the
    # tokenizer there (so prefork children share the pages) and freeze what it loaded.
    import subprocess
    import sys

    script = (
        "import gc, sys\n"
        "from worker import celery_hooks\n"
        "from worker.settings import get_settings\n"
        "assert 'litellm' not in sys.modules\n"
        "celery_hooks._preload_gateway(get_settings())\n"
        "print('litellm' in sys.modules, gc.get_freeze_count() > 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "REVERIE_LOG_FORMAT": "json"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].split() == ["True", "True"]
    assert "llm gateway preloaded" in done.stderr + done.stdout
