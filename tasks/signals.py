"""Processing a signal: claim it, apply it once, record the outcome.

The steps, each in a transaction of its own, so none is held open across a model call:

1. claim: ``pending``/``failed`` (due) or ``processing`` with an expired lease becomes
   ``processing`` with one more attempt and a fresh claim token (a signal processed by
   id reads its payload in the same statement);
2. load and re-validate the payload (rows INSERTed by foreign producers were never
   validated), then prepare (for ``session_end`` and ``feedback``: the model call);
3. apply: mark the signal ``done`` if the claim token is still ours and the row still
   exists (``erase-user`` may have removed it), which locks the row, then write the
   memory effects, all in one transaction. A crash anywhere leaves either nothing or
   everything: the effect happens exactly once.

Outcomes: ``done``; ``rejected`` (invalid input, the reason names the field, never
retried); ``failed`` (transient, retried after a backoff); ``dead`` (out of attempts,
or a permanent model error an operator must fix; ``reverie signals retry`` puts it
back); ``skipped`` (the claim was lost: another worker or an erasure got there first).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from store import schedule
from store import signals as signal_store
from store.db import (
    committing,
    get_engine,
    give_back,
    lost_connection,
    retrying_conflicts,
    safe_url,
    session_scope,
    translate_errors,
)
from store.signals import Claimed
from tasks import activity, feedback, session_end
from tasks.decisions import Decision, Effect, SignalInput
from worker import budget, metrics
from worker.errors import (
    BudgetExhausted,
    DatabaseUnavailable,
    InvalidSignal,
    PermanentError,
    ReverieError,
    SchemaMissing,
    TransientError,
    describe,
    raised_at,
)
from worker.logs import get_logger, user_ref
from worker.payloads import KINDS, validate_signal
from worker.settings import Settings

log = get_logger(__name__)

CLAIM_BATCH = 20
LOST_CLAIM = "the claim was lost (erased, or taken over after the lease expired)"
MAX_BACKOFF_SECONDS = 6 * 3600
#: How long a wake-up tries to give back a claim whose reply was lost (it is retried anyway).
CLAIM_GIVE_BACK_SECONDS = 10.0


@dataclass(frozen=True)
class Handler:
    prepare: Callable[[Settings, SignalInput], Any]
    apply: Callable[[Session, Settings, SignalInput, Any], Effect]
    #: ``apply`` for many signals of the kind at once (fewer statements), if it has one.
    apply_many: Callable[[Session, Settings, list[tuple[SignalInput, Any]]], list[Effect]] | None = None


HANDLERS: dict[str, Handler] = {
    "session_end": Handler(session_end.prepare, session_end.apply),
    "feedback": Handler(feedback.prepare, feedback.apply),
    "activity": Handler(activity.prepare, activity.apply, activity.apply_many),
}


@dataclass
class SignalResult:
    """One signal's outcome, with the candidate memories accepted and refused."""

    signal_id: int
    kind: str
    user_id: str
    outcome: str
    reason: str | None = None
    decisions: list[Decision] = field(default_factory=list)

    @property
    def accepted(self) -> list[Decision]:
        return [d for d in self.decisions if d.accepted]

    @property
    def refused(self) -> list[Decision]:
        return [d for d in self.decisions if not d.accepted]


@dataclass
class SignalPassReport:
    """What one pass over the pending signals did (``processed`` counts ``done``)."""

    processed: int = 0
    rejected: int = 0
    failed: int = 0
    dead: int = 0
    skipped: int = 0
    results: list[SignalResult] = field(default_factory=list)

    def add(self, result: SignalResult) -> None:
        self.results.append(result)
        if result.outcome == "done":
            self.processed += 1
        elif result.outcome in ("rejected", "failed", "dead", "skipped"):
            setattr(self, result.outcome, getattr(self, result.outcome) + 1)


def process_pending(settings: Settings, *, limit: int | None = None) -> SignalPassReport:
    """Process every signal that is due now (at most ``limit``), each at most once.

    Raises :class:`~worker.errors.DatabaseUnavailable` or ``SchemaMissing`` when the
    database cannot be used; a bad signal never stops the pass.
    """
    report = SignalPassReport()
    cursor = 0
    while limit is None or len(report.results) < limit:
        batch = CLAIM_BATCH if limit is None else min(CLAIM_BATCH, limit - len(report.results))
        token = signal_store.new_claim_token()
        with committing(settings, partial(signal_store.unclaim, token=token)) as session:
            buried = signal_store.bury_exhausted(session, max_attempts=settings.signal_max_attempts)
            claimed = signal_store.claim_signals(
                session,
                lease_seconds=settings.signal_lease_seconds,
                limit=batch,
                after_id=cursor,
                max_attempts=settings.signal_max_attempts,
                with_payload=True,
                token=token,
            )
        report.dead += _report_buried(buried)
        if not claimed:
            break
        for result in process_claims(settings, claimed):
            report.add(result)
        cursor = claimed[-1].signal_id
    _refresh_pending_gauge(settings)
    return report


def batch_kinds(settings: Settings) -> tuple[str, ...]:
    """The kinds a wake-up may claim beside its own signal (see :func:`process_signal`).

    Kinds whose preparation calls a remote model are left to their own wake-ups, so a
    batch never holds its claims (and its first results) across many slow calls.
    """
    return tuple(KINDS) if settings.llm_model == "offline" else ("activity",)


def process_signal(settings: Settings, signal_id: int) -> str:
    """Claim and process one signal by id; its outcome, or ``skipped`` if it was not
    claimable (already finished, held by another worker, or gone).

    The same claim takes up to ``signal_wakeup_batch - 1`` other due signals of
    :func:`batch_kinds` (those available longest first), processed with it and committed
    together: under a backlog one wake-up does the work of many, and the wake-ups of
    signals already done cost one claim that finds nothing. The price: a worker killed
    mid-batch leaves every signal of the batch to its lease (each has used an
    attempt), where it would have left one.
    """
    buried: list[tuple[int, str]] = []
    token = signal_store.new_claim_token()
    connected = False
    try:
        with _statement_scope(settings) as session:
            connected = True  # from here on, the claim may commit whatever the client hears
            # One statement before the work: the claim reads the payloads, and buries the
            # signal if it is out of attempts with an expired lease (the sweeper's wake-up
            # for such a row lands here, so burying on this path finds every one in time).
            claimed = signal_store.claim_signals(
                session,
                lease_seconds=settings.signal_lease_seconds,
                limit=settings.signal_wakeup_batch,
                signal_id=signal_id,
                also_kinds=batch_kinds(settings),
                max_attempts=settings.signal_max_attempts,
                with_payload=True,
                bury_own=True,
                buried_rows=buried,
                token=token,
            )
    except DatabaseUnavailable:
        # The claim commits as it runs: one whose reply was lost would hold its signals
        # until their lease runs out, an attempt used for nothing (the last one buries
        # a signal never applied). Given back at once; where nothing was claimed, the
        # token matches nothing. Briefly: the wake-up is retried anyway. Not where the
        # connection could not be made: nothing was sent, and the retry's backoff waits.
        if connected:
            give_back(settings, partial(signal_store.unclaim, token=token), within=CLAIM_GIVE_BACK_SECONDS)
        raise
    _report_buried(buried)
    outcome = "skipped"
    for result in process_claims(settings, claimed):
        if result.signal_id == signal_id:
            outcome = result.outcome
    return outcome


@contextmanager
def _statement_scope(settings: Settings) -> Iterator[Session]:
    """A session whose every statement commits on its own (autocommit).

    For work that is one statement, or several that need not be atomic together: it
    spares the BEGIN and COMMIT round trips of a transaction. A wake-up's claim and
    the burial of its own signal run here.
    """
    with translate_errors(settings), get_engine(settings).connect() as connection:
        autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
        with Session(bind=autocommit, expire_on_commit=False) as session:
            yield session


def _report_buried(buried: list[tuple[int, str]]) -> int:
    for signal_id, kind in buried:
        _count(kind, "dead")
        log.warning("signal_dead", signal_id=signal_id, kind=_kind_label(kind), reason="lease expired")
    return len(buried)


def process_claimed(settings: Settings, claim: Claimed) -> SignalResult:
    """Prepare, apply and record one claimed signal. Never raises for a bad signal."""
    return process_claims(settings, [claim])[0]


@dataclass
class _Ready:
    claim: Claimed
    signal: SignalInput
    prepared: Any
    result: SignalResult


def process_claims(settings: Settings, claims: list[Claimed]) -> list[SignalResult]:
    """Prepare, apply and record claimed signals, in order. Never raises for a bad signal.

    Each signal is prepared on its own (a bad one is recorded and left out); the
    prepared ones are applied in one transaction. Should that transaction fail, each
    is applied again in a transaction of its own, so one bad signal costs the batch
    nothing but time.
    """
    results = [SignalResult(c.signal_id, c.kind, c.user_id, outcome="skipped") for c in claims]
    ready: list[_Ready] = []
    for claim, result in zip(claims, results, strict=True):
        item = _guarded(settings, claim, result, partial(_prepare, settings, claim, result))
        if isinstance(item, _Ready):
            ready.append(item)
    if len(ready) > 1 and _apply_together(settings, ready):
        return results
    for item in ready:
        _guarded(settings, item.claim, item.result, partial(_apply, settings, item))
    return results


def _guarded(settings: Settings, claim: Claimed, result: SignalResult, step: Callable[[], Any]) -> Any:
    """Run one step of one signal; on an error record the outcome it calls for and
    return None."""
    refund = False
    wait_until: datetime | None = None
    try:
        return step()
    except InvalidSignal as exc:
        result.outcome, result.reason = "rejected", str(exc)
        log_detail: dict[str, Any] = {"field": exc.field}
    except BudgetExhausted as exc:
        result.outcome, result.reason, wait_until = _budget_outcome(exc)
        refund = result.outcome == "failed"
        log_detail = {"budget": exc.scope}
    except TransientError as exc:
        result.outcome = "dead" if claim.attempts >= settings.signal_max_attempts else "failed"
        result.reason = f"transient error: {exc}"
        log_detail = {"error": type(exc).__name__}
    except PermanentError as exc:
        result.outcome, result.reason = "dead", f"permanent model error (fix the setting, then retry): {exc}"
        log_detail = {"error": type(exc).__name__}
    except (DatabaseUnavailable, SchemaMissing):
        raise
    except Exception as exc:
        if lost_connection(exc):
            # The connection went (killed, the server restarting), wherever it was raised
            # from: not this signal's fault. Its claim runs out and it is taken again.
            raise DatabaseUnavailable(safe_url(settings.database_url), type(exc).__name__) from exc
        # A row the database refuses, a stored value it cannot read, input no check
        # foresaw, or a bug: one signal must never stop the pass, and a bug must not be
        # retried forever.
        result.outcome = "dead" if claim.attempts >= settings.signal_max_attempts else "failed"
        # The database's own words where it refused (class, SQLSTATE, the constraint's
        # name: never the message, which can quote the row); else the type and where.
        # Reverie's own errors (a stored value it cannot read) say what is wrong themselves.
        said = describe(exc)
        result.reason = (said if isinstance(exc, ReverieError) else f"internal error: {said}")[:500]
        log_detail = {"error": type(exc).__name__, "where": raised_at(exc)}
    _finish(settings, claim, result, refund=refund, wait_until=wait_until, **log_detail)
    return None


def _budget_outcome(exc: BudgetExhausted) -> tuple[str, str, datetime | None]:
    """Outcome, reason and retry time for a signal whose model call a budget refused.

    Not the signal's fault when the day's or its user's budget is spent: it waits,
    without using up an attempt, until the next UTC day brings new ones (trying every
    few seconds until then would only be refused again). Its own ceiling spent, no
    retry can pay: it is dead until an operator raises the ceiling and retries it.
    """
    if exc.scope in ("day", "user"):
        return "failed", f"{exc}; waiting for the next UTC day's budget", budget.next_day_start()
    if exc.scope == "signal":
        return "dead", f"{exc}: the signal's own cost ceiling (REVERIE_MAX_COST_PER_SIGNAL) is spent", None
    return "failed", str(exc), None


def _prepare(settings: Settings, claim: Claimed, result: SignalResult) -> _Ready | None:
    signal = _load(settings, claim)
    if signal is None:
        result.reason = "the signal was removed while it was processed"
        _finish(settings, claim, result)
        return None
    return _Ready(claim, signal, HANDLERS[signal.kind].prepare(settings, signal), result)


def _load(settings: Settings, claim: Claimed) -> SignalInput | None:
    if claim.has_payload:
        text = claim.payload_text
    else:
        with session_scope(settings) as session:
            exists, text = signal_store.load_payload_text(session, claim.signal_id)
        if not exists:
            return None
    payload = _parse(text)
    validate_signal(claim.kind, claim.user_id, payload, settings, agent_id=claim.agent_id)
    return SignalInput(claim.signal_id, claim.kind, claim.user_id, claim.agent_id, payload, claim.enqueued_at)


def _parse(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise InvalidSignal("payload", "is nested too deeply to read") from exc
    except ValueError as exc:
        raise InvalidSignal("payload", "is not valid JSON") from exc


def _apply(settings: Settings, item: _Ready) -> SignalResult:
    # Run again, with what was prepared (no second model call), when the database chose
    # it as a deadlock's victim: two signals of one user writing the same keys in
    # another order, or an application's transaction holding them.
    applied = retrying_conflicts(partial(_apply_once, settings, item))
    if applied is None:
        item.result.reason = LOST_CLAIM
        return item.result
    _done(settings, item, *applied)
    return item.result


def _apply_once(settings: Settings, item: _Ready) -> tuple[Effect, datetime] | None:
    """One transaction applying the signal: its effect and the time recorded, or None
    where its claim no longer holds (nothing written)."""
    claim, signal = item.claim, item.signal
    with session_scope(settings) as session:
        # Marking it done first locks the row and checks that our claim still holds, in
        # one statement; the effects follow in the same transaction, so either both
        # commit or neither does.
        finished_at = signal_store.finish_signal(session, claim.signal_id, claim.claim_token, status="done")
        if finished_at is None:
            return None
        effect = HANDLERS[signal.kind].apply(session, settings, signal, item.prepared)
        if effect.wrote:
            schedule.mark_dirty(session, settings, signal.user_id)
    return effect, finished_at


def _apply_together(settings: Settings, ready: list[_Ready]) -> bool:
    """Apply prepared signals in one transaction; False (nothing written) if it failed."""
    effects: list[tuple[_Ready, Effect]] = []
    try:
        with session_scope(settings) as session:
            held, finished_at = signal_store.finish_signals(
                session, [(item.claim.signal_id, item.claim.claim_token) for item in ready], status="done"
            )
            together: dict[str, list[_Ready]] = {}
            for item in ready:
                if item.claim.signal_id not in held:
                    continue
                handler = HANDLERS[item.signal.kind]
                if handler.apply_many is not None:
                    together.setdefault(item.signal.kind, []).append(item)
                    continue
                effects.append((item, handler.apply(session, settings, item.signal, item.prepared)))
            for kind, items in together.items():
                apply_many = HANDLERS[kind].apply_many
                assert apply_many is not None
                batch = [(item.signal, item.prepared) for item in items]
                effects.extend(zip(items, apply_many(session, settings, batch), strict=True))
            # One statement; its rows are locked in one order for every batch.
            wrote = [item.signal.user_id for item, effect in effects if effect.wrote]
            schedule.mark_dirty_many(session, settings, wrote)
    except (DatabaseUnavailable, SchemaMissing):
        raise
    except Exception as exc:
        log.info("signal_batch_split", size=len(ready), error=type(exc).__name__, where=raised_at(exc))
        return False
    for item in ready:
        if item.claim.signal_id not in held:
            item.result.reason = LOST_CLAIM
    for item, effect in effects:
        _done(settings, item, effect, finished_at)
    return True


def _done(settings: Settings, item: _Ready, effect: Effect, finished_at: datetime) -> None:
    claim, signal, result = item.claim, item.signal, item.result
    result.outcome, result.decisions = "done", effect.decisions
    for action, count in effect.writes.items():
        metrics.MEMORY_WRITES.labels(source=effect.source, action=action).inc(count)
    metrics.SIGNAL_LAG.labels(kind=signal.kind).observe(max(0.0, (finished_at - claim.enqueued_at).total_seconds()))
    _count(signal.kind, "done")
    log.info(
        "signal_done",
        signal_id=claim.signal_id,
        kind=signal.kind,
        user=user_ref(signal.user_id, settings.log_hash_key),
        accepted=len(result.accepted),
        refused=len(result.refused),
        writes=sum(effect.writes.values()),
    )


def _finish(
    settings: Settings,
    claim: Claimed,
    result: SignalResult,
    *,
    refund: bool = False,
    wait_until: datetime | None = None,
    **log_detail: Any,
) -> SignalResult:
    status = result.outcome
    if status == "skipped":
        return result
    available_at = wait_until
    retry_after = None
    if status == "failed" and available_at is None:
        attempt = 1 if refund else claim.attempts
        delay = min(settings.signal_backoff_seconds * 2 ** (attempt - 1), MAX_BACKOFF_SECONDS)
        retry_after = timedelta(seconds=delay)
    with session_scope(settings) as session:
        recorded = signal_store.finish_signal(
            session,
            claim.signal_id,
            claim.claim_token,
            status=status,
            error=(result.reason or "")[:2000],
            available_at=available_at,
            retry_after=retry_after,
            refund_attempt=refund,
        )
    if recorded is None:
        result.outcome = "skipped"
        return result
    _count(claim.kind, status)
    emit = log.warning if status in ("failed", "dead") else log.info
    emit(
        "signal_" + status,
        signal_id=claim.signal_id,
        kind=_kind_label(claim.kind),
        user=user_ref(claim.user_id, settings.log_hash_key),
        # As the row has it: an attempt the budget refused is given back.
        attempts=max(claim.attempts - 1, 0) if refund else claim.attempts,
        **log_detail,
    )
    return result


def _kind_label(kind: str) -> str:
    # A foreign producer can put anything in ``kind``: keep the label set bounded.
    return kind if kind in KINDS else "unknown"


def _count(kind: str, outcome: str) -> None:
    metrics.SIGNALS_PROCESSED.labels(kind=_kind_label(kind), outcome=outcome).inc()


def _refresh_pending_gauge(settings: Settings) -> None:
    with session_scope(settings) as session:
        counts = signal_store.pending_counts(session)
    for kind in KINDS:
        metrics.SIGNALS_PENDING.labels(kind=kind).set(counts.get(kind, 0))
