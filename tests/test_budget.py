"""The hard cost cap: spend never passes a run's or a day's cap, whatever the prices,
prompts and caps, and however many processes share one day budget."""

from __future__ import annotations

import itertools
import multiprocessing
import random

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from store.db import dispose_engines, session_scope
from store.memories import table_for, user_entries
from store.models import Spend
from store.types import NANO, usd_to_nano
from tasks.dream import dream_user
from tasks.summarize import build_messages, groups_of, min_output_tokens
from tests.dream_seed import entry, seed
from worker import budget, llm
from worker.errors import BudgetExhausted
from worker.policy import book
from worker.settings import Settings

_run_ids = itertools.count(1_000_000)


def _reset_spend(settings: Settings) -> None:
    with session_scope(settings) as session:
        session.execute(delete(Spend))


def test_reservation_is_worst_case_and_rounds_up() -> None:
    assert budget.reservation_nano(100, 50, 1e-6, 2e-6) == 100_000 + 100_000
    assert budget.price_nano(1, 1e-12) == 1  # a fraction of a nano-dollar still reserves one


@hsettings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    in_price=st.floats(min_value=1e-9, max_value=1e-4),
    out_price=st.floats(min_value=1e-9, max_value=1e-4),
    prompt_words=st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=12),
    max_tokens=st.integers(min_value=16, max_value=2000),
    min_fraction=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0)),
    run_cap=st.floats(min_value=0.0, max_value=0.05),
    day_cap=st.floats(min_value=0.0, max_value=0.08),
)
def test_spend_never_over_the_caps(
    pg_settings: Settings,
    in_price: float,
    out_price: float,
    prompt_words: list[int],
    max_tokens: int,
    min_fraction: float | None,
    run_cap: float,
    day_cap: float,
) -> None:
    settings = pg_settings.model_copy(
        update={
            "llm_input_cost_per_token": in_price,
            "llm_output_cost_per_token": out_price,
            "max_cost_per_run": run_cap,
            "max_cost_per_day": day_cap,
        }
    )
    _reset_spend(settings)
    run_id = next(_run_ids)
    budget.open_run(settings, run_id, run_cap)
    made = refused = 0
    # None: the whole ceiling or nothing; else a smaller ceiling down to this one.
    min_tokens = None if min_fraction is None else max(1, round(max_tokens * min_fraction))
    for words in prompt_words:
        messages = [
            {"role": "system", "content": "[reverie:summarize]"},
            {
                "role": "user",
                "content": "INPUT:\n"
                + '{"entries": ['
                + ",".join(['{"key": "k", "value": "word"}'] * words)
                + '], "target": 1}',
            },
        ]
        try:
            llm.complete(
                settings,
                purpose="summarize",
                messages=messages,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                run_id=run_id,
            )
            made += 1
        except BudgetExhausted:
            refused += 1
        except llm.MalformedReply:
            made += 1  # cut off at a lowered ceiling: made, paid for, not used
    assert budget.run_spent_nano(settings, run_id) <= usd_to_nano(run_cap)
    assert budget.day_spent_nano(settings) <= usd_to_nano(day_cap)
    assert made + refused == len(prompt_words)
    with session_scope(settings) as session:
        assert all(row.reserved_nano == 0 for row in session.scalars(select(Spend)))  # every call settled


def _hammer(url: str, seed_value: int, calls: int) -> int:
    settings = Settings(_env_file=None, database_url=url, max_cost_per_day=0.01)  # type: ignore[call-arg]
    rng = random.Random(seed_value)
    spent = 0
    for _ in range(calls):
        lines = budget.lines_for(settings, None, None)
        amount = rng.randint(1, usd_to_nano(0.001))
        try:
            reservation = budget.reserve(settings, lines, amount)
        except BudgetExhausted:
            continue
        # Actual cost anywhere from nothing to more than reserved (it is capped).
        spent += budget.settle(settings, reservation, rng.randint(0, amount * 2))
    dispose_engines()
    return spent


def test_concurrent_processes_never_pass_the_day_cap(pg_settings: Settings) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        results = pool.starmap(_hammer, [(pg_settings.database_url, n, 40) for n in range(3)])
    day = budget.day_spent_nano(pg_settings)
    assert day == sum(results)
    assert 0 < day <= usd_to_nano(0.01)
    with session_scope(pg_settings) as session:
        row = session.get(Spend, ("day", budget.day_key()))
        assert row is not None and row.reserved_nano == 0


def _two_groups(settings: Settings) -> list[list[object]]:
    seed(
        settings,
        [entry("u1", f"a{i}", "note", category="context") for i in range(6)]
        + [entry("u1", f"b{i}", "note", category="fact") for i in range(6)],
    )
    with session_scope(settings) as session:
        rows = user_entries(session, table_for(settings), "u1")
    return groups_of(rows, settings, book(settings, {}), None)


def test_the_cap_stops_summarization_and_carries_work_over(pg_settings: Settings) -> None:
    groups = _two_groups(pg_settings)
    # A ceiling no larger than what a group needs: no smaller ceiling is worth a call.
    ceiling = max(min_output_tokens(pg_settings, g) for g in groups)
    settings = pg_settings.model_copy(update={"llm_max_output_tokens": ceiling})
    in_price, out_price = llm.prices(settings)
    reservations = [
        budget.reservation_nano(llm.count_prompt_tokens(settings, build_messages(g, 2)), ceiling, in_price, out_price)
        for g in groups
    ]
    # The run's cap fits one call's reservation; once that call is settled, the
    # second group's reservation no longer fits.
    capped = settings.model_copy(update={"max_cost_per_run": max(reservations) / NANO})
    outcome = dream_user(capped, "u1")
    assert (outcome.entries_summarized, outcome.groups_deferred) == (6, 1)
    assert 0 < usd_to_nano(outcome.cost_usd) <= usd_to_nano(capped.max_cost_per_run)
    follow_up = dream_user(capped, "u1")
    assert (follow_up.entries_summarized, follow_up.groups_deferred) == (6, 0)


def test_a_smaller_ceiling_is_used_when_the_full_one_does_not_fit(pg_settings: Settings) -> None:
    groups = _two_groups(pg_settings)
    settings = pg_settings.model_copy(update={"llm_max_output_tokens": 4000})
    out_price = llm.prices(settings)[1]
    floors = [
        llm.reservation_floor_nano(settings, build_messages(g, 2), min_output_tokens(settings, g)) for g in groups
    ]
    # Room for both groups' least reservations, far from two full 4,000-token ones.
    cap = sum(floors) + budget.price_nano(10, out_price)
    assert cap < budget.price_nano(4000, out_price)
    capped = settings.model_copy(update={"max_cost_per_run": cap / NANO})
    outcome = dream_user(capped, "u1")
    assert (outcome.entries_summarized, outcome.groups_deferred) == (12, 0)
    assert 0 < usd_to_nano(outcome.cost_usd) <= cap


def test_reserve_call_lowers_the_ceiling_to_what_is_left(pg_settings: Settings) -> None:
    lines = budget.lines_for(pg_settings, None, None)
    _reset_spend(pg_settings)
    cap = usd_to_nano(pg_settings.max_cost_per_day)
    taken = budget.reserve(pg_settings, lines, cap - 1_000_000)  # 0.001 USD left
    reservation = budget.reserve_call(
        pg_settings, lines, prompt_nano=200_000, output_price=2e-6, max_tokens=1024, min_tokens=100
    )
    assert reservation.output_tokens == 400 and reservation.amount_nano == 1_000_000
    with pytest.raises(BudgetExhausted) as refused:
        budget.reserve_call(pg_settings, lines, prompt_nano=0, output_price=2e-6, max_tokens=1024, min_tokens=1)
    assert refused.value.scope == "day" and refused.value.remaining == 0
    budget.settle(pg_settings, reservation, 300_000)
    budget.settle(pg_settings, taken, taken.amount_nano)
    assert budget.day_spent_nano(pg_settings) == cap - 700_000
    assert budget.affordable_tokens(699_999, 2e-6, 1024) == 349
    assert budget.affordable_tokens(10**12, 2e-6, 1024) == 1024
    assert budget.affordable_tokens(-5, 2e-6, 1024) == 0


def test_day_cap_refuses_before_the_call(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"max_cost_per_day": 0.0})
    with pytest.raises(BudgetExhausted) as raised:
        llm.complete(
            settings,
            purpose="summarize",
            messages=[{"role": "system", "content": "[reverie:summarize]"}, {"role": "user", "content": "INPUT:\n{}"}],
            max_tokens=20,
        )
    assert raised.value.scope == "day"
