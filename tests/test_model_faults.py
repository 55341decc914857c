"""Model faults behind the real gateway: bounded retries, the cost cap, dead signals
brought back by ``reverie signals retry``, and no partial memory (real PostgreSQL).

The fault model (:mod:`tests.fault_model`) is a litellm custom provider, so every call
runs the gateway's real path; it counts the calls it receives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import func, select, update

from store.db import session_scope
from store.models import ArchivedEntry, Event, Observation, Run, Signal, Spend
from store.types import NANO, now, usd_to_nano
from tasks.dream import dream_user
from tasks.signals import process_pending
from tasks.summarize import build_messages
from tests import fault_model
from tests.dream_seed import entries_of, entry, seed
from tests.fault_model import FAULTS, MALFORMED, SCRIPT, TRANSIENT
from worker import budget, llm
from worker.errors import BudgetExhausted, PermanentError, TransientError
from worker.producer import enqueue_signal
from worker.settings import Settings

MESSAGES = [
    {"role": "system", "content": "[reverie:summarize]\nbe brief"},
    {"role": "user", "content": 'INPUT:\n{"category": "fact", "target": 1, "entries": [{"key": "a", "value": "b"}]}'},
]
LONG = (
    "Thank you for your question about the quarterly report. The numbers are in and overall they look good. "
    "Revenue grew in most regions, with the north leading. Costs were flat. We expect the trend to continue "
    "next quarter, although there is some uncertainty around the supply chain and currency effects."
)
PAYLOADS: dict[str, dict[str, Any]] = {
    "session_end": {
        "conversation_id": "c1",
        "agent_id": "agent-a",
        # Two facts: a reply cut in half still holds the first one whole.
        "messages": [{"role": "user", "content": "My favorite color is blue. My home city is Paris."}],
    },
    "feedback": {"deliverable_id": "d1", "agent_id": "writer", "original": LONG, "edited": "The numbers look good."},
}


@pytest.fixture(autouse=True)
def _fresh_script() -> None:
    SCRIPT.reset()


def _requests(outcome: str) -> float:
    labels = {"model": fault_model.MODEL, "outcome": outcome}
    return REGISTRY.get_sample_value("dream_llm_requests_total", labels) or 0.0


def _reserved_total(settings: Settings) -> int:
    with session_scope(settings) as session:
        return int(session.scalar(select(func.coalesce(func.sum(Spend.reserved_nano), 0))) or 0)


def _full_reservation(settings: Settings, messages: list[dict[str, str]], max_tokens: int) -> int:
    # The prompt as reserved: litellm's count plus the provider family's margin.
    return llm.reservation_floor_nano(settings, messages, max_tokens)


# -- the gateway ---------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_one_call_typed_and_paid_within_its_reservation(pg_settings: Settings, fault: str) -> None:
    settings = fault_model.settings_for(pg_settings)
    SCRIPT.reset(then=fault)
    reservation = _full_reservation(settings, MESSAGES, 100)
    over_before = _requests("over_ceiling")
    expected: type[Exception] = (
        llm.MalformedReply if fault in MALFORMED else TransientError if fault in TRANSIENT else PermanentError
    )
    with pytest.raises(expected) as raised:
        llm.complete(settings, purpose="summarize", messages=MESSAGES, max_tokens=100)
    if fault in TRANSIENT:
        assert not isinstance(raised.value, llm.MalformedReply)
    assert SCRIPT.calls == 1  # litellm made no retries of its own
    spent = budget.day_spent_nano(settings)
    assert 0 <= spent <= reservation and _reserved_total(settings) == 0
    if fault in ("over_usage", "long_text"):
        # Over the ceiling: the reservation is recorded in full, never more, and counted.
        assert spent == reservation
        assert _requests("over_ceiling") == over_before + 1
    if fault == "timeout":
        assert spent == reservation  # a timed-out request may have been billed
    if fault in ("auth", "rate_limit", "server_error", "overloaded"):
        assert spent == 0


@pytest.mark.parametrize("fault", ["over_usage", "long_text"])
def test_replies_over_the_ceiling_never_pass_the_day_cap(pg_settings: Settings, fault: str) -> None:
    base = fault_model.settings_for(pg_settings)
    reservation = _full_reservation(base, MESSAGES, 100)
    settings = base.model_copy(update={"max_cost_per_day": 3.5 * reservation / NANO})
    SCRIPT.reset(then=fault)
    for _ in range(10):
        try:
            llm.complete(settings, purpose="summarize", messages=MESSAGES, max_tokens=100)
        except llm.MalformedReply:
            continue
        except BudgetExhausted as exhausted:
            assert exhausted.scope == "day"
            break
    assert SCRIPT.calls == 3
    assert budget.day_spent_nano(settings) == 3 * reservation <= usd_to_nano(settings.max_cost_per_day)


# -- signals -------------------------------------------------------------------------


def _signal(settings: Settings, signal_id: int) -> Signal:
    with session_scope(settings) as session:
        row = session.get(Signal, signal_id)
        assert row is not None
        return row


def _make_due(settings: Settings) -> None:
    # Stands in for the backoff's wait: the next pass finds the signal due.
    with session_scope(settings) as session:
        session.execute(update(Signal).values(available_at=now() - timedelta(seconds=1)))


def _written(settings: Settings) -> tuple[int, int, int]:
    """Memory rows, events and feedback observations: anything a signal wrote."""
    from store.memories import table_for

    table = table_for(settings)
    with session_scope(settings) as session:
        memories = session.scalar(select(func.count()).select_from(table))
        events = session.scalar(select(func.count()).select_from(Event))
        observations = session.scalar(select(func.count()).select_from(Observation))
    return int(memories or 0), int(events or 0), int(observations or 0)


@pytest.mark.parametrize("fault", [*TRANSIENT, *MALFORMED])
@pytest.mark.parametrize("kind", ["session_end", "feedback"])
def test_signal_retries_are_bounded_with_backoff_then_dead_with_the_reason(
    pg_settings: Settings, kind: str, fault: str
) -> None:
    settings = fault_model.settings_for(pg_settings, signal_max_attempts=3, signal_backoff_seconds=30)
    SCRIPT.reset(then=fault)
    sid = enqueue_signal(kind, "u1", PAYLOADS[kind], settings=settings).signal_id
    delays = []
    for _ in range(4):  # one pass more than attempts: it must not call the model
        process_pending(settings)
        row = _signal(settings, sid)
        if row.status == "failed":
            delays.append((row.available_at - now()).total_seconds())
        _make_due(settings)
    row = _signal(settings, sid)
    assert (row.status, row.attempts, SCRIPT.calls) == ("dead", 3, 3)
    assert row.last_error is not None and row.last_error.startswith("transient error:")
    reason = "malformed model reply" if fault in MALFORMED else "Timeout" if fault == "timeout" else "Error"
    assert reason in row.last_error
    # Backoff doubles: about 30 s after the first attempt, 60 s after the second.
    assert len(delays) == 2 and 25 < delays[0] <= 30 and 55 < delays[1] <= 60
    assert _written(settings) == (0, 0, 0)  # nothing partial from a bad reply
    assert budget.day_spent_nano(settings) <= usd_to_nano(settings.max_cost_per_day)
    assert _reserved_total(settings) == 0


@pytest.mark.parametrize("kind", ["session_end", "feedback"])
def test_permanent_model_error_is_one_call_then_dead(pg_settings: Settings, kind: str) -> None:
    settings = fault_model.settings_for(pg_settings, signal_max_attempts=5)
    SCRIPT.reset(then="auth")
    sid = enqueue_signal(kind, "u1", PAYLOADS[kind], settings=settings).signal_id
    process_pending(settings)
    _make_due(settings)
    process_pending(settings)
    row = _signal(settings, sid)
    assert (row.status, row.attempts, SCRIPT.calls) == ("dead", 1, 1)
    assert row.last_error is not None and "AuthenticationError" in row.last_error
    assert _written(settings) == (0, 0, 0)


def test_budget_refusals_do_not_use_up_attempts(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings, signal_max_attempts=2, max_cost_per_day=0.0)
    sid = enqueue_signal("session_end", "u1", PAYLOADS["session_end"], settings=settings).signal_id
    for _ in range(4):
        process_pending(settings)
        _make_due(settings)
    row = _signal(settings, sid)
    assert (row.status, row.attempts, SCRIPT.calls) == ("failed", 0, 0)
    assert row.last_error is not None and "day budget exhausted" in row.last_error


def _cli(args: list[str], settings: Settings) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    # The healthy model now: the built-in offline one.
    env.update(
        {"REVERIE_DATABASE_URL": settings.database_url, "REVERIE_BROKER_URL": "", "REVERIE_LLM_MODEL": "offline"}
    )
    return subprocess.run(
        [sys.executable, "-c", "from worker.cli import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )


def test_dead_signals_come_back_with_the_cli_once_the_model_is_healthy(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings, signal_max_attempts=2, signal_backoff_seconds=0)
    SCRIPT.reset(then="server_error")
    ids = {kind: enqueue_signal(kind, "u1", PAYLOADS[kind], settings=settings).signal_id for kind in PAYLOADS}
    for _ in range(3):
        process_pending(settings)
        _make_due(settings)
    assert {_signal(settings, sid).status for sid in ids.values()} == {"dead"}
    assert SCRIPT.calls == 4

    retried = _cli(["signals", "retry", "--all-dead"], settings)
    assert retried.returncode == 0, retried.stderr
    assert {_signal(settings, sid).status for sid in ids.values()} == {"pending"}
    ran = _cli(["run", "--json"], settings)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["signals_processed"] == 2
    for sid in ids.values():
        row = _signal(settings, sid)
        assert (row.status, row.attempts) == ("done", 1)
    assert {(r["key"], r["value"]) for r in entries_of(settings, "u1").values()} == {
        ("favorite_color", "blue"),
        ("home_city", "Paris"),
    }
    with session_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(Observation)) == 1
    assert SCRIPT.calls == 4  # the faulty model was not called again


# -- dream summarization -------------------------------------------------------------


def _groups(user: str, groups: int) -> list[dict[str, Any]]:
    return [
        entry(user, f"note_{g}_{i}", f"fact {g}.{i}", category="context", agent=f"agent-{g}")
        for g in range(groups)
        for i in range(6)
    ]


def _ledger(settings: Settings) -> Run:
    with session_scope(settings) as session:
        return session.scalars(select(Run).order_by(Run.id.desc())).first()  # type: ignore[return-value]


@pytest.mark.parametrize("fault", [*TRANSIENT, *MALFORMED])
def test_a_misbehaving_model_leaves_the_originals_and_the_ledger_says_so(pg_settings: Settings, fault: str) -> None:
    settings = fault_model.settings_for(pg_settings)
    originals = {r["id"]: r["value"] for r in seed(settings, _groups("u1", 2))}
    SCRIPT.reset(then=fault)
    outcome = dream_user(settings, "u1")
    assert (outcome.status, outcome.entries_summarized, outcome.groups_deferred) == ("succeeded", 0, 2)
    assert SCRIPT.calls == 2  # one call per group, no retry inside the run
    assert {i: r["value"] for i, r in entries_of(settings, "u1").items()} == originals
    with session_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(ArchivedEntry)) == 0
    run = _ledger(settings)
    assert (run.status, run.groups_deferred, run.entries_summarized, run.entries_written) == ("succeeded", 2, 0, 0)
    assert run.error is not None and run.error.startswith("summarize: 2 group(s) deferred: 2 x ")
    assert ("unusable reply" if fault in MALFORMED else f"scripted {fault}") in run.error
    assert run.cost_nano <= usd_to_nano(settings.max_cost_per_run) and _reserved_total(settings) == 0

    SCRIPT.reset()  # healthy again: the deferred groups are summarized by the next run
    assert dream_user(settings, "u1").entries_summarized == 12


def test_a_permanent_model_error_fails_the_run_and_replaces_nothing(pg_settings: Settings) -> None:
    settings = fault_model.settings_for(pg_settings)
    originals = {r["id"] for r in seed(settings, _groups("u1", 2))}
    SCRIPT.reset(then="auth")
    outcome = dream_user(settings, "u1")
    assert outcome.status == "failed" and SCRIPT.calls == 1
    assert set(entries_of(settings, "u1")) == originals
    run = _ledger(settings)
    assert run.status == "failed" and "AuthenticationError" in (run.error or "")


@pytest.mark.parametrize("fault", ["over_usage", "long_text", "timeout"])
def test_replies_over_the_ceiling_never_pass_the_run_cap(pg_settings: Settings, fault: str) -> None:
    base = fault_model.settings_for(pg_settings, llm_max_output_tokens=200)
    seed(base, _groups("u1", 6))
    # Room for two and a half full reservations of one group.
    rows = [SimpleNamespace(**r) for r in _groups("u1", 1)]
    full = _full_reservation(base, build_messages(rows, 2), 200)
    settings = base.model_copy(update={"max_cost_per_run": 2.5 * full / NANO})
    SCRIPT.reset(then=fault)
    outcome = dream_user(settings, "u1")
    run = _ledger(settings)
    assert run.cost_nano <= usd_to_nano(settings.max_cost_per_run)
    assert outcome.entries_summarized == 0 and run.groups_deferred == 6
    # Each call paid up to its reservation; a call with a lowered ceiling may follow.
    assert 2 <= SCRIPT.calls <= 4
    assert _reserved_total(settings) == 0
