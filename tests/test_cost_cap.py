"""The cost cap's promises under pressure (real PostgreSQL, the real LLM gateway): a
provider that bills more prompt than counted, a cap changed mid-day, a process killed
in a call, a call that got no answer, one producer against everyone's budget, a group
too long for the model, and signals that wait for budget without spinning."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import func, select, update
from structlog.testing import capture_logs

from schedules import sweeper
from schedules.cron import run_once
from store.db import dispose_engines, session_scope
from store.erase import erase_user
from store.models import Reservation, Run, Signal, Spend
from store.types import NANO, now, usd_to_nano
from tasks.dream import dream_user
from tasks.session_end import ASSISTANT_CONTEXT_CHARS, extractor_messages
from tasks.signals import process_pending
from tasks.summarize import build_messages
from tests import fault_model
from tests.dream_seed import entries_of, entry, seed
from tests.fault_model import SCRIPT, UNANSWERED
from worker import budget, llm, token_margin
from worker.errors import BudgetExhausted, Interrupted, TransientError
from worker.producer import enqueue_signal
from worker.settings import Settings

#: A prompt of about a thousand tokens whose reply is short (no fact in it: ``[]``),
#: so the prompt is most of a call's cost.
LONG_PROMPT = [
    {"role": "system", "content": "[reverie:extract_facts]\nlist facts"},
    {
        "role": "user",
        "content": "INPUT:\n"
        + json.dumps({"messages": [{"role": "user", "content": "We talked about the weather again. " * 150}]}),
    },
]


@pytest.fixture(autouse=True)
def _fresh_script() -> None:
    SCRIPT.reset()


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _reserved_total(settings: Settings) -> int:
    with session_scope(settings) as session:
        return int(session.scalar(select(func.coalesce(func.sum(Spend.reserved_nano), 0))) or 0)


def _signal(settings: Settings, signal_id: int) -> Signal:
    with session_scope(settings) as session:
        row = session.get(Signal, signal_id)
        assert row is not None
        return row


def _said(text: str, conversation: str) -> dict[str, Any]:
    return {"conversation_id": conversation, "messages": [{"role": "user", "content": text}]}


# -- prompt tokens the tokenizer under-counts ---------------------------------------------


def test_each_provider_family_has_its_margin_and_the_setting_replaces_it(pg_settings: Settings) -> None:
    margins = {
        model: token_margin.margin(pg_settings.model_copy(update={"llm_model": model}))
        for model in ("gpt-4o", "azure/gpt-4o", "anthropic/claude-3-5-sonnet", "gemini/gemini-1.5-pro", "mistral/large")
    }
    assert margins == {
        "gpt-4o": 0.05,
        "azure/gpt-4o": 0.05,
        "anthropic/claude-3-5-sonnet": 0.40,
        "gemini/gemini-1.5-pro": 0.25,
        "mistral/large": token_margin.OTHER_MARGIN,
    }
    assert token_margin.family("offline") == "offline" and token_margin.margin(pg_settings) == 0.0
    fixed = pg_settings.model_copy(update={"llm_model": "anthropic/claude-3-5-sonnet", "llm_prompt_token_margin": 0.1})
    assert token_margin.margin(fixed) == 0.1
    assert token_margin.reserved_prompt_tokens(fixed, 1000) == 1100


def test_prompt_billed_over_the_count_never_passes_the_cap_and_is_counted_and_logged(pg_settings: Settings) -> None:
    # No margin: the provider bills 30 % more prompt than was counted and reserved.
    base = fault_model.settings_for(pg_settings, llm_prompt_token_margin=0.0)
    reservation = llm.reservation_floor_nano(base, LONG_PROMPT, 40)
    settings = base.model_copy(update={"max_cost_per_day": 3.5 * reservation / NANO})
    SCRIPT.reset(overbill=0.3)
    over_before = _sample("dream_llm_usage_over_reservation_total", model=fault_model.MODEL, direction="input")
    unrecorded_before = _sample("dream_llm_unrecorded_cost_usd_total", model=fault_model.MODEL)
    made = 0
    with capture_logs() as logs:
        for _ in range(6):
            try:
                llm.complete(settings, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
            except BudgetExhausted as exhausted:
                assert exhausted.scope == "day"
                break
            made += 1
    assert made == 3 and SCRIPT.calls == 3
    in_price, _ = llm.prices(settings)
    billed_prompt = math.ceil(SCRIPT.prompts[0] * 1.3)
    # The prompt alone, as billed, costs more than the whole reservation: what the
    # budget records stops at the reservation, and the day stays within its cap.
    assert budget.price_nano(billed_prompt, in_price) > reservation
    assert budget.day_spent_nano(settings) == 3 * reservation <= usd_to_nano(settings.max_cost_per_day)
    assert _reserved_total(settings) == 0
    after = _sample("dream_llm_usage_over_reservation_total", model=fault_model.MODEL, direction="input")
    assert after == over_before + 3
    unrecorded = _sample("dream_llm_unrecorded_cost_usd_total", model=fault_model.MODEL) - unrecorded_before
    assert unrecorded > 0
    overruns = [line for line in logs if line["event"] == "llm_usage_over_reservation"]
    assert len(overruns) == 3
    assert all(o["direction"] == "input" and o["used_tokens"] == billed_prompt for o in overruns)
    assert all(o["reserved_tokens"] == SCRIPT.prompts[0] and o["unrecorded_nano"] > 0 for o in overruns)


def test_the_family_margin_covers_a_provider_that_bills_more_prompt(pg_settings: Settings) -> None:
    # The fault model is no known family: its prompt is reserved with the wide margin.
    settings = fault_model.settings_for(pg_settings)
    SCRIPT.reset(overbill=0.3)
    over_before = _sample("dream_llm_usage_over_reservation_total", model=fault_model.MODEL, direction="input")
    reply = llm.complete(settings, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
    in_price, out_price = llm.prices(settings)
    billed_prompt = math.ceil(SCRIPT.prompts[0] * 1.3)
    assert reply.input_tokens == billed_prompt
    exact = budget.price_nano(billed_prompt, in_price) + budget.price_nano(reply.output_tokens, out_price)
    assert budget.day_spent_nano(settings) == exact  # recorded in full: nothing was absorbed
    assert _sample("dream_llm_usage_over_reservation_total", model=fault_model.MODEL, direction="input") == over_before


# -- a changed day cap --------------------------------------------------------------------


def test_a_changed_day_cap_applies_at_once_in_both_directions(pg_settings: Settings) -> None:
    big = fault_model.settings_for(pg_settings, max_cost_per_day=5.0)
    llm.complete(big, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
    spent = budget.day_spent_nano(big)
    assert spent > 0 and SCRIPT.calls == 1

    tiny = big.model_copy(update={"max_cost_per_day": 0.00001})
    for _ in range(3):
        with pytest.raises(BudgetExhausted) as refused:
            llm.complete(tiny, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
        assert refused.value.scope == "day"
    assert SCRIPT.calls == 1 and budget.day_spent_nano(tiny) == spent

    llm.complete(big, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
    assert SCRIPT.calls == 2 and budget.day_spent_nano(big) > spent
    with session_scope(big) as session:
        line = session.get(Spend, ("day", budget.day_key()))
        assert line is not None and line.limit_nano == usd_to_nano(5.0)


def test_a_lowered_cap_is_honoured_on_both_backends(store_settings: Settings) -> None:
    lines = budget.lines_for(store_settings.model_copy(update={"max_cost_per_day": 1.0}), None, None)
    first = budget.reserve(store_settings, lines, usd_to_nano(0.3))
    budget.settle(store_settings, first, usd_to_nano(0.3))
    lowered = budget.lines_for(store_settings.model_copy(update={"max_cost_per_day": 0.2}), None, None)
    with pytest.raises(BudgetExhausted):
        budget.reserve(store_settings, lowered, 1)
    raised = budget.lines_for(store_settings.model_copy(update={"max_cost_per_day": 0.5}), None, None)
    budget.settle(store_settings, budget.reserve(store_settings, raised, usd_to_nano(0.2)), usd_to_nano(0.2))
    assert budget.day_spent_nano(store_settings) == usd_to_nano(0.5)


# -- reservations of killed calls ---------------------------------------------------------


def _call_and_hang(url: str, entered: Any) -> None:
    """A worker stand-in whose model call never returns (the test kills it)."""
    settings = fault_model.settings_for(Settings(_env_file=None, database_url=url, broker_url=""))  # type: ignore[call-arg]
    SCRIPT.reset(then="hang")
    SCRIPT.on_hang = entered.set
    llm.complete(settings, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)


def _reservations(settings: Settings) -> list[Reservation]:
    with session_scope(settings) as session:
        return list(session.scalars(select(Reservation)))


def test_the_reservation_of_a_process_killed_mid_call_is_settled_by_the_reaper(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings)
    context = multiprocessing.get_context("spawn")
    entered = context.Event()
    child = context.Process(target=_call_and_hang, args=(settings.database_url, entered))
    child.start()
    try:
        assert entered.wait(120), "the child never reached the model"
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)  # in the model call, its reservation taken
    finally:
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    [held] = _reservations(settings)
    assert _reserved_total(settings) == held.amount_nano > 0
    with session_scope(settings) as session:
        assert session.get(Spend, ("day", budget.day_key())).reserved_nano == held.amount_nano  # type: ignore[union-attr]

    # Before its call deadline the call may still be running: the reaper leaves it.
    assert budget.reap_expired(settings) == (0, 0)
    assert _reserved_total(settings) == held.amount_nano
    # Past it, the process is taken for dead; the request may have been billed.
    reaped = budget.reap_expired(settings, at=held.deadline + timedelta(seconds=1))
    assert reaped == (1, held.amount_nano)
    assert _reserved_total(settings) == 0 and not _reservations(settings)
    assert budget.day_spent_nano(settings) == held.amount_nano


def test_the_sweeper_reaps_expired_reservations(pg_settings: Settings) -> None:
    stale = budget.reserve(pg_settings, budget.lines_for(pg_settings, None, None), 5_000)
    with session_scope(pg_settings) as session:
        session.execute(update(Reservation).values(deadline=now() - timedelta(seconds=1)))
    assert sweeper.sweep(pg_settings, len, lambda ids, window: ids) == 0
    assert not _reservations(pg_settings) and _reserved_total(pg_settings) == 0
    assert budget.day_spent_nano(pg_settings) == stale.amount_nano


def test_the_cron_pass_reaps_and_a_late_settle_counts_nothing_twice(pg_settings: Settings) -> None:
    lines = budget.lines_for(pg_settings, None, None)
    stale = budget.reserve(pg_settings, lines, 5_000)
    live = budget.reserve(pg_settings, lines, 7_000)
    with session_scope(pg_settings) as session:
        # Stands in for the call deadline passing while the process is gone.
        session.execute(
            update(Reservation)
            .where(Reservation.id == stale.reservation_id)
            .values(deadline=now() - timedelta(seconds=1))
        )
    run_once(pg_settings)
    assert [r.id for r in _reservations(pg_settings)] == [live.reservation_id]
    assert _reserved_total(pg_settings) == 7_000 and budget.day_spent_nano(pg_settings) == 5_000
    # The "dead" call returns after all: its settlement finds the reaper's and adds nothing.
    assert budget.settle(pg_settings, stale, 1_000) == 5_000
    assert budget.settle(pg_settings, live, 2_000) == 2_000
    assert _reserved_total(pg_settings) == 0 and budget.day_spent_nano(pg_settings) == 7_000


# -- calls that got no answer -------------------------------------------------------------


@pytest.mark.parametrize("fault", UNANSWERED)
def test_a_call_without_an_answer_is_recorded_as_spent(pg_settings: Settings, fault: str) -> None:
    settings = fault_model.settings_for(pg_settings)
    reservation = llm.reservation_floor_nano(settings, LONG_PROMPT, 40)
    SCRIPT.reset(then=fault)
    cost = {"model": settings.llm_model, "purpose": "summarize"}
    before = REGISTRY.get_sample_value("dream_llm_cost_usd_total", cost) or 0.0
    # The soft time limit in the call reaches the caller as such (a transient error of
    # its own, which stops the work that makes calls one after another).
    with pytest.raises(Interrupted if fault == "interrupted" else TransientError):
        llm.complete(settings, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
    assert SCRIPT.calls == 1
    assert budget.day_spent_nano(settings) == reservation and _reserved_total(settings) == 0
    # The cost metric records what the budget records.
    after = REGISTRY.get_sample_value("dream_llm_cost_usd_total", cost) or 0.0
    assert after - before == pytest.approx(reservation / NANO)


# -- one producer, everyone's budget ------------------------------------------------------


def _big_transcript() -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": "SYSTEM-PROMPT " + "rules " * 4000}]
    for turn in range(12):
        messages.append({"role": "tool", "content": f"TOOL-OUTPUT-{turn} " + "row,value,other " * 3500})
        messages.append(
            {"role": "assistant", "content": "ASSISTANT-PREAMBLE " + "context " * 2500 + "Where do you live?"}
        )
        messages.append({"role": "user", "content": f"My home city is Paris. Turn {turn}."})
    return {"conversation_id": "big", "agent_id": "agent-a", "messages": messages}


def test_the_extractor_sees_user_messages_and_the_question_before_each(pg_settings: Settings) -> None:
    shown = extractor_messages(_big_transcript())
    assert [m["role"] for m in shown] == ["assistant", "user"] * 12
    assert all("TOOL-OUTPUT" not in m["content"] and "SYSTEM-PROMPT" not in m["content"] for m in shown)
    questions = [m["content"] for m in shown if m["role"] == "assistant"]
    assert all(q.endswith("Where do you live?") and len(q) <= ASSISTANT_CONTEXT_CHARS + 1 for q in questions)
    assert extractor_messages({"messages": [{"role": "user", "content": "hi"}]}) == [{"role": "user", "content": "hi"}]


def test_a_one_megabyte_transcript_costs_a_small_prompt(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings)
    payload = _big_transcript()
    size = len(json.dumps(payload).encode("utf-8"))
    assert 900_000 < size <= settings.max_payload_bytes
    sid = enqueue_signal("session_end", "u1", payload, settings=settings).signal_id
    assert process_pending(settings).processed == 1
    whole = llm.count_text_tokens(settings, json.dumps(payload["messages"]))
    [prompt] = SCRIPT.prompts
    assert prompt * 50 < whole  # a few thousand tokens, not a few hundred thousand
    assert _signal(settings, sid).status == "done"
    assert {r["key"]: r["value"] for r in entries_of(settings, "u1").values()} == {"home_city": "Paris"}


def _chatty(number: int, conversation: str) -> dict[str, Any]:
    # A long message: the prompt is most of what a signal costs.
    return _said(f"My favorite number is {number}. " + "I like to talk about many things. " * 250, conversation)


def test_a_users_signals_stop_at_their_own_ceiling_while_others_still_run(pg_settings: Settings) -> None:
    base = fault_model.settings_for(pg_settings, llm_prompt_token_margin=0.0)
    # About one signal's reservation: its message, and the whole output ceiling.
    one = llm.reservation_floor_nano(base, _chatty(0, "x")["messages"], base.llm_max_output_tokens)
    cap = 2 * one / NANO
    settings = base.model_copy(update={"max_cost_per_user_per_day": cap})
    alice = [enqueue_signal("session_end", "alice", _chatty(n, f"a{n}"), settings=settings) for n in range(8)]
    process_pending(settings)
    alice_rows = [_signal(settings, s.signal_id) for s in alice]
    done = len([row for row in alice_rows if row.status == "done"])
    waiting = [row for row in alice_rows if row.status == "failed"]
    assert 1 <= done <= 4 and len(waiting) == 8 - done
    assert all(row.attempts == 0 and "user budget exhausted" in (row.last_error or "") for row in waiting)
    assert all(row.available_at == budget.next_day_start() for row in waiting)
    # Alice's day is spent; Bob's signals still run, as many as hers did.
    bob = [enqueue_signal("session_end", "bob", _chatty(n, f"b{n}"), settings=settings) for n in range(done)]
    assert process_pending(settings).processed == done
    assert {_signal(settings, s.signal_id).status for s in bob} == {"done"}
    assert [_signal(settings, row.id).status for row in waiting] == ["failed"] * len(waiting)
    with session_scope(settings) as session:
        line = session.get(Spend, ("user", budget.user_day_key("alice")))
        assert line is not None and line.reserved_nano == 0 and 0 < line.spent_nano <= usd_to_nano(cap)


def test_a_signal_stops_at_its_own_ceiling_across_attempts(pg_settings: Settings) -> None:
    base = fault_model.settings_for(pg_settings)
    payload = _said("My favorite color is blue.", "c1")
    sid = enqueue_signal("session_end", "u1", payload, settings=base).signal_id
    SCRIPT.reset("disconnect")  # the first attempt is billed in full, then retried
    ceiling = 1.5 * llm.reservation_floor_nano(
        base, [{"role": "user", "content": json.dumps(payload)}], base.llm_max_output_tokens
    )
    settings = base.model_copy(update={"max_cost_per_signal": ceiling / NANO})
    process_pending(settings)
    assert _signal(settings, sid).status == "failed"
    with session_scope(settings) as session:
        session.execute(update(Signal).values(available_at=now() - timedelta(seconds=1)))
    process_pending(settings)
    row = _signal(settings, sid)
    assert (row.status, SCRIPT.calls) == ("dead", 1)
    assert "signal budget exhausted" in (row.last_error or "") and "REVERIE_MAX_COST_PER_SIGNAL" in (
        row.last_error or ""
    )


def test_a_signal_refused_by_the_day_budget_waits_for_the_next_day(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings, max_cost_per_day=0.0)
    sid = enqueue_signal("session_end", "u1", _said("My favorite color is blue.", "c1"), settings=settings).signal_id
    with capture_logs() as logs:
        report = process_pending(settings)
    assert report.failed == 1 and SCRIPT.calls == 0
    row = _signal(settings, sid)
    assert (row.status, row.attempts) == ("failed", 0)
    # The log line says the attempts the row says.
    said = [e for e in logs if e["event"] == "signal_failed" and e["signal_id"] == sid]
    assert [(e["attempts"], e["budget"]) for e in said] == [(0, "day")], said
    assert row.available_at == budget.next_day_start()
    assert "day budget exhausted" in (row.last_error or "") and "next UTC day" in (row.last_error or "")
    # Nothing to do until then: the next passes do not touch it.
    assert process_pending(settings).failed == 0 and _signal(settings, sid).attempts == 0


# -- a group too long for the model -------------------------------------------------------


def _group(agent: str, count: int, words: int) -> list[dict[str, Any]]:
    return [
        entry("u1", f"{agent}_note_{i}", f"detail {i} " + "word " * words, category="context", agent=agent)
        for i in range(count)
    ]


def _prompt_tokens(settings: Settings, rows: list[dict[str, Any]]) -> int:
    return llm.count_prompt_tokens(settings, build_messages([SimpleNamespace(**r) for r in rows], 2))


def _last_run(settings: Settings) -> Run:
    with session_scope(settings) as session:
        return session.scalars(select(Run).order_by(Run.id.desc())).first()  # type: ignore[return-value]


def test_a_group_too_long_for_the_context_window_is_split_and_the_rest_summarized(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings, llm_max_output_tokens=4000)
    big, small = _group("agent-big", 12, 30), _group("agent-small", 6, 2)
    seed(settings, big + small)
    limit = max(_prompt_tokens(settings, big[:6]), _prompt_tokens(settings, big[6:]))
    assert _prompt_tokens(settings, big) > limit >= _prompt_tokens(settings, small)
    SCRIPT.reset(context_limit=limit)
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded" and outcome.entries_summarized == 18
    assert SCRIPT.calls == 4  # the whole group refused, then its halves, then the small group
    assert not any(r["key"].startswith("agent-big_note_") for r in entries_of(settings, "u1").values())


def test_a_group_too_long_to_split_is_skipped_with_the_reason_in_the_ledger(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings, llm_max_output_tokens=4000)
    big, small = _group("agent-big", 6, 60), _group("agent-small", 6, 2)
    seed(settings, big + small)
    limit = _prompt_tokens(settings, small) + 5
    assert _prompt_tokens(settings, big) > limit
    SCRIPT.reset(context_limit=limit)
    outcome = dream_user(settings, "u1")
    assert outcome.status == "succeeded" and outcome.entries_summarized == 6 and outcome.groups_deferred == 1
    keys = {r["key"] for r in entries_of(settings, "u1").values()}
    assert {r["key"] for r in big} <= keys  # left whole
    run = _last_run(settings)
    assert run.status == "succeeded" and "context window" in (run.error or "")
    assert _reserved_total(settings) == 0 and budget.day_spent_nano(settings) <= usd_to_nano(settings.max_cost_per_day)
    dispose_engines()


def test_erasure_removes_the_users_own_budget_lines(pg_settings: Settings) -> None:
    for user in ("alice", "bob"):
        lines = budget.lines_for(pg_settings, None, None, user_id=user)
        budget.settle(pg_settings, budget.reserve(pg_settings, lines, 1_000), 500)
    with session_scope(pg_settings) as session:
        counts = erase_user(session, pg_settings, "alice")
    assert counts["dream_spend"] == 1
    with session_scope(pg_settings) as session:
        users = {row.scope_key for row in session.scalars(select(Spend).where(Spend.scope == "user"))}
    assert users == {budget.user_day_key("bob")}


def _on_loopback(settings: Settings, server: ThreadingHTTPServer, model: str) -> Settings:
    """``settings`` calling ``model`` on the loopback ``server``, priced."""
    return settings.model_copy(
        update={
            "llm_model": model,
            "llm_api_base": f"http://127.0.0.1:{server.server_address[1]}/v1",
            "llm_input_cost_per_token": 1e-6,
            "llm_output_cost_per_token": 2e-6,
        }
    )


class _BusyEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint on loopback that answers 503, and counts requests."""

    requests: ClassVar[int] = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).requests += 1
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return None


def test_the_soft_time_limit_in_an_openai_call_stops_the_caller_and_is_recorded_as_spent(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """litellm's ``openai/`` provider wraps an interruption in the call as a server error
    (``InternalServerError``), which alone would read as a refusal the provider billed
    nothing for, and as a transient error the caller goes on after. The soft limit fires
    once the request has reached the server, before its answer is read (raised by the
    HTTP transport itself, where a signal would land: deterministic, unlike a timer)."""
    import httpx
    from celery.exceptions import SoftTimeLimitExceeded

    monkeypatch.setenv("OPENAI_API_KEY", "not-needed-on-loopback")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BusyEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    send = httpx.HTTPTransport.handle_request

    def sent_then_interrupted(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        send(self, request).close()
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", sent_then_interrupted)
    settings = _on_loopback(pg_settings, server, "openai/busy-model")
    reservation = llm.reservation_floor_nano(settings, LONG_PROMPT, 40)
    _BusyEndpoint.requests = 0
    try:
        with pytest.raises(Interrupted):
            llm.complete(settings, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
    finally:
        server.shutdown()
        server.server_close()
    assert _BusyEndpoint.requests == 1
    assert budget.day_spent_nano(settings) == reservation and _reserved_total(settings) == 0


class _OddEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint on loopback answering with ``status``, ``body`` and
    ``content_type`` (a class's, set by the test)."""

    status: ClassVar[int] = 200
    body: ClassVar[bytes] = b""
    content_type: ClassVar[str] = "application/json"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(type(self).status)
        self.send_header("Content-Type", type(self).content_type)
        self.send_header("Content-Length", str(len(type(self).body)))
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("status", "content_type", "body", "billed"),
    [
        (500, "application/json", b'{"error": {"message": "boom", "type": "server_error"}}', False),
        (503, "text/html", b"<html>upstream unavailable</html>", False),
        (200, "text/html", b"<html>a proxy's page</html>", True),
        (200, "application/json", b'{"id": "chatcmpl-1", "choices": [{"mess', True),
    ],
    ids=["500", "503", "200-html", "200-cut-off"],
)
def test_a_server_error_is_free_and_an_answer_that_could_not_be_read_is_recorded_as_spent(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, status: int, content_type: str, body: bytes, billed: bool
) -> None:
    """Through litellm's real ``openai/`` provider and HTTP client, against a loopback
    server: litellm raises the same ``InternalServerError`` for a 5xx and for a 200 whose
    body it cannot read, but only the 5xx is a refusal the provider billed nothing for."""
    monkeypatch.setenv("OPENAI_API_KEY", "not-needed-on-loopback")
    monkeypatch.setattr(_OddEndpoint, "status", status)
    monkeypatch.setattr(_OddEndpoint, "content_type", content_type)
    monkeypatch.setattr(_OddEndpoint, "body", body)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OddEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = _on_loopback(pg_settings, server, "openai/odd-model")
    reservation = llm.reservation_floor_nano(settings, LONG_PROMPT, 40)
    try:
        with pytest.raises(TransientError):
            llm.complete(settings, purpose="summarize", messages=LONG_PROMPT, max_tokens=40)
    finally:
        server.shutdown()
        server.server_close()
    assert budget.day_spent_nano(settings) == (reservation if billed else 0)
    assert _reserved_total(settings) == 0
