"""Where the cost cap is enforced: budget lines, reservations, settlement.

Every model call reserves its worst-case price before it is made, against the day's
budget (``REVERIE_MAX_COST_PER_DAY``, shared by every worker) and, inside a dream run,
against the run's budget and the owning agent's ``maxCostPerRun``. The reservation is
one short transaction; the call runs outside any transaction; settlement records the
actual cost (never more than was reserved) and releases the rest. So the recorded
spend of a run or a day can never pass its cap, however many workers run at once.

Near the end of a budget a full reservation (prompt + the whole output ceiling) may no
longer fit although a real reply is much smaller: :func:`reserve_call` then lowers
the call's ceiling to what the budget left can pay for, down to the caller's minimum,
inside the same locked transaction, so the reservation still covers the worst case of
the call actually made.

The day's line, and a signal's own lines (its user's day, and the signal itself over
all its attempts), take their limits from the settings at every reservation: a cap
lowered or raised applies to the next call. A reservation lives in PostgreSQL until it
is settled; one whose call deadline has passed belongs to a process that died in the
call, and :func:`reap_expired` settles it as spent (the request may have been billed),
so nothing stays reserved for the rest of the day.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from store import policies as policy_store
from store import spend as spend_store
from store.db import session_scope
from store.spend import BudgetLine, Refused
from store.types import NANO, db_now, now, usd_to_nano
from worker import metrics
from worker.errors import BudgetExhausted
from worker.logs import get_logger
from worker.policy import effective
from worker.settings import Settings

log = get_logger(__name__)

#: How long after its call's own timeout a reservation may stay unsettled before the
#: reaper takes it for a dead process's (settling and a slow database take seconds).
RESERVATION_GRACE_SECONDS = 120.0
#: Expired reservations settled per reaper pass (each in a transaction of its own).
REAP_BATCH = 500


@dataclass(frozen=True)
class Reservation:
    """What was taken from which budgets for one model call (``output_tokens``: the
    ceiling it pays for, 0 when the reservation was taken as a plain amount)."""

    lines: tuple[BudgetLine, ...]
    amount_nano: int
    output_tokens: int = 0
    reservation_id: int = 0


def price_nano(tokens: int, usd_per_token: float) -> int:
    """The price of ``tokens`` in nano-USD, rounded up (a reservation never undershoots)."""
    return math.ceil(tokens * usd_per_token * NANO - 1e-6) if tokens and usd_per_token else 0


def reservation_nano(prompt_tokens: int, max_tokens: int, input_price: float, output_price: float) -> int:
    """Worst case of a call: its prompt plus its whole output ceiling."""
    return price_nano(prompt_tokens, input_price) + price_nano(max_tokens, output_price)


def affordable_tokens(budget_nano: int, output_price: float, max_tokens: int) -> int:
    """The largest output ceiling (at most ``max_tokens``) whose price fits ``budget_nano``."""
    if budget_nano < 0:
        return 0
    if price_nano(max_tokens, output_price) <= budget_nano:
        return max_tokens
    tokens = min(max_tokens, int(budget_nano / (output_price * NANO)))
    # Float division can land one token either side of the rounded-up price.
    while tokens > 0 and price_nano(tokens, output_price) > budget_nano:
        tokens -= 1
    while tokens < max_tokens and price_nano(tokens + 1, output_price) <= budget_nano:
        tokens += 1
    return tokens


def day_key(at: datetime | None = None) -> str:
    return (at or now()).date().isoformat()


def next_day_start(at: datetime | None = None) -> datetime:
    """When the day after ``at`` (UTC) begins: the day's budget lines are new then."""
    day = (at or now()).date() + timedelta(days=1)
    return datetime(day.year, day.month, day.day)


def user_day_key(user_id: str, at: datetime | None = None) -> str:
    return spend_store.user_day_key(day_key(at), user_id)


def signal_key(signal_id: int) -> str:
    return str(signal_id)


def run_key(run_id: int) -> str:
    return str(run_id)


def agent_key(run_id: int, agent_id: str | None) -> str:
    # Agent ids are up to 255 characters; the key column holds 64.
    digest = hashlib.sha256((agent_id or "").encode("utf-8")).hexdigest()[:24]
    return f"{run_id}/{digest if agent_id is not None else '-'}"


def open_run(settings: Settings, run_id: int, limit_usd: float) -> None:
    """Create the run's total budget (the largest ``maxCostPerRun`` among its policies)."""
    with session_scope(settings) as session:
        spend_store.ensure_lines(session, [BudgetLine("run", run_key(run_id), usd_to_nano(limit_usd))])


def lines_for(
    settings: Settings,
    run_id: int | None,
    agent_id: str | None,
    *,
    user_id: str | None = None,
    signal_id: int | None = None,
) -> list[BudgetLine]:
    """The budgets a call must fit, in locking order: run total, agent share, day, then
    for a signal's call its user's day and the signal itself. Every transaction that
    locks several lines takes them in this order, so two never wait on each other."""
    lines: list[BudgetLine] = []
    if run_id is not None:
        with session_scope(settings) as session:
            config = policy_store.get_config(session, agent_id) if agent_id is not None else None
        cap = usd_to_nano(effective(settings, config).maxCostPerRun)
        lines.append(BudgetLine("run", run_key(run_id), usd_to_nano(settings.max_cost_per_run)))
        lines.append(BudgetLine("run", agent_key(run_id, agent_id), cap))
    with session_scope(settings) as session:
        at = db_now(session)  # the database's calendar, the same on every host
    lines.append(BudgetLine("day", day_key(at), usd_to_nano(settings.max_cost_per_day), follows_settings=True))
    if user_id is not None:
        cap = usd_to_nano(settings.user_day_cost_cap)
        lines.append(BudgetLine("user", user_day_key(user_id, at), cap, follows_settings=True))
    if signal_id is not None:
        cap = usd_to_nano(settings.signal_cost_cap)
        lines.append(BudgetLine("signal", signal_key(signal_id), cap, follows_settings=True))
    return lines


def _deadline(settings: Settings) -> datetime:
    return now() + timedelta(seconds=settings.llm_timeout_seconds + RESERVATION_GRACE_SECONDS)


def reserve(settings: Settings, lines: list[BudgetLine], amount_nano: int) -> Reservation:
    """Take ``amount_nano`` from every line atomically, or raise :class:`BudgetExhausted`."""
    try:
        with session_scope(settings) as session:
            spend_store.ensure_lines(session, lines)
            spend_store.reserve(session, lines, amount_nano)
            reservation_id = spend_store.record_reservation(session, lines, amount_nano, _deadline(settings))
    except Refused as refused:
        metrics.BUDGET_EXHAUSTED.labels(scope=refused.line.scope).inc()
        raise BudgetExhausted(refused.line.scope, amount_nano / NANO, refused.remaining_nano / NANO) from None
    return Reservation(tuple(lines), amount_nano, reservation_id=reservation_id)


def reserve_call(
    settings: Settings,
    lines: list[BudgetLine],
    *,
    prompt_nano: int,
    output_price: float,
    max_tokens: int,
    min_tokens: int | None = None,
) -> Reservation:
    """Reserve a call's prompt plus its output ceiling: ``max_tokens`` if it fits, else
    the largest ceiling of at least ``min_tokens`` (default: ``max_tokens``) that the
    tightest budget can pay for; raise :class:`BudgetExhausted` if not even that fits."""
    floor = max_tokens if min_tokens is None else max(1, min(min_tokens, max_tokens))
    try:
        with session_scope(settings) as session:
            spend_store.ensure_lines(session, lines)
            tightest, headroom = spend_store.lock_headroom(session, lines)
            tokens = affordable_tokens(headroom - prompt_nano, output_price, max_tokens)
            if tokens < floor:
                raise Refused(tightest, headroom)
            amount = prompt_nano + price_nano(tokens, output_price)
            # The conditional update stays the guard (on SQLite nothing is row-locked).
            spend_store.reserve(session, lines, amount)
            reservation_id = spend_store.record_reservation(session, lines, amount, _deadline(settings))
    except Refused as refused:
        metrics.BUDGET_EXHAUSTED.labels(scope=refused.line.scope).inc()
        needed = prompt_nano + price_nano(floor, output_price)
        raise BudgetExhausted(refused.line.scope, needed / NANO, refused.remaining_nano / NANO) from None
    return Reservation(tuple(lines), amount, tokens, reservation_id)


def settle(settings: Settings, reservation: Reservation, actual_nano: int) -> int:
    """Record the call's cost (capped at the reservation); returns what was recorded
    (the whole reservation if the reaper settled it first, taking the call for dead)."""
    recorded = max(0, min(actual_nano, reservation.amount_nano))
    with session_scope(settings) as session:
        settled = spend_store.settle(
            session, reservation.reservation_id, list(reservation.lines), reservation.amount_nano, recorded
        )
    return recorded if settled else reservation.amount_nano


def reap_expired(settings: Settings, at: datetime | None = None) -> tuple[int, int]:
    """Settle, as spent in full, the reservations whose call deadline has passed: their
    process died in the call, which may have been billed. Returns (count, nano)."""
    with session_scope(settings) as session:
        expired = spend_store.expired_reservations(session, at or now(), REAP_BATCH)
    count = total = 0
    for reservation_id in expired:
        # One transaction each: a reservation's lines are locked in their own order.
        with session_scope(settings) as session:
            amount = spend_store.reap(session, reservation_id)
        if amount is not None:
            count, total = count + 1, total + amount
    if count:
        log.warning("budget_reservations_reaped", reservations=count, settled_nano=total)
    return count, total


def run_spent_nano(settings: Settings, run_id: int) -> int:
    with session_scope(settings) as session:
        return spend_store.spent_nano(session, "run", run_key(run_id))


def day_spent_nano(settings: Settings, at: datetime | None = None) -> int:
    with session_scope(settings) as session:
        return spend_store.spent_nano(session, "day", day_key(at or db_now(session)))
