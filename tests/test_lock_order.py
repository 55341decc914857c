"""Pairs of transactions that lock the same rows: they take them in one order, or the
one the database rolls back as a deadlock's victim is run again (real PostgreSQL).

Each test pins one interleaving with a holder connection (or a gate), starts the two
real code paths in threads, waits (pg_stat_activity) until each waits where it should,
then releases: both finish, with what each was to do done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from store.db import session_scope
from store.erase import rows_about
from store.models import Signal
from store.types import now
from tasks.activity import detect_routines
from tasks.erase import erase_user
from tasks.signals import process_pending
from tests.test_erase_races import said, start
from worker import budget
from worker.producer import enqueue_signal
from worker.settings import Settings

WAIT = 60


def outcome(thread: threading.Thread) -> BaseException | None:
    thread.join(WAIT)
    assert not thread.is_alive(), "thread did not finish"
    errors: list[BaseException] = thread.errors  # type: ignore[attr-defined]
    return errors[0] if errors else None


def is_deadlock(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, psycopg.errors.DeadlockDetected) or "deadlock detected" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def both_finish(*threads: threading.Thread) -> None:
    errors = [outcome(t) for t in threads]
    deadlocks = [e for e in errors if is_deadlock(e)]
    assert not deadlocks, f"deadlock: {deadlocks[0]!r}"
    for e in errors:
        if e is not None:
            raise e


def url_of(settings: Settings) -> str:
    return settings.database_url.replace("+psycopg", "")


def waiting(conn: psycopg.Connection[Any], pattern: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE %s",
        (pattern,),
    ).fetchone()
    return int(row[0]) if row else 0


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


# -- 1. routine detection against an erasure -------------------------------------------


def test_routine_detection_and_an_erasure_take_activity_rows_and_the_erasure_lock_in_one_order(
    pg_settings: Settings,
) -> None:
    """Routine detection forgets old events of every user (ann's among them) in a
    transaction of its own, before the one that takes ann's erasure lock to write her
    routines; an erasure takes that lock, then deletes ann's events. Both in one
    transaction, the two waited on each other."""
    base = now().replace(hour=9, minute=0, second=0, microsecond=0)
    weekly = [{"action": "digest", "at": (base - timedelta(days=7 * w)).isoformat()} for w in range(1, 6)]
    enqueue_signal("activity", "ann", {"events": weekly}, settings=pg_settings)
    process_pending(pg_settings)
    old = base - timedelta(weeks=12)
    with psycopg.connect(url_of(pg_settings), autocommit=True) as conn:
        # Past the look-back: the detection deletes them. ann's first, then ben's.
        conn.execute(
            "INSERT INTO dream_activity (user_id, agent_id, action, at) VALUES ('ann', 'a', 'old', %s)", (old,)
        )
        conn.execute(
            "INSERT INTO dream_activity (user_id, agent_id, action, at) VALUES ('ben', 'a', 'old', %s)", (old,)
        )
    with psycopg.connect(url_of(pg_settings), autocommit=True) as watch, psycopg.connect(url_of(pg_settings)) as holder:
        # Someone holds ben's old event for a moment (any row the detection's DELETE
        # reaches after ann's would do): the detection has deleted ann's and waits.
        holder.execute("SELECT 1 FROM dream_activity WHERE user_id = 'ben' FOR UPDATE")
        detecting = start(detect_routines, pg_settings)
        until(lambda: waiting(watch, "DELETE FROM dream_activity WHERE dream_activity.at <%") == 1)
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        # The erasure holds ann's erasure lock and waits for ann's old event.
        until(lambda: waiting(watch, "DELETE FROM dream_activity WHERE dream_activity.user_id =%") == 1)
        holder.rollback()
        both_finish(detecting, erasing)


# -- 2. two session_end signals of one user ------------------------------------------------


def test_two_signals_of_one_user_write_the_same_keys_in_one_order(pg_settings: Settings) -> None:
    """Each signal's facts are upserted in the order the model listed them: two
    transcripts of one user naming the same keys in opposite orders lock the same rows
    in opposite orders. The one the database rolls back is applied again with what was
    prepared (no second model call), and both end done."""
    from tasks.signals import process_signal

    settings = pg_settings.model_copy(update={"signal_wakeup_batch": 1})
    enqueue_signal("session_end", "ann", said("My dog is Rex. My city is Paris.", "c0"), settings=settings)
    process_pending(settings)
    a = enqueue_signal("session_end", "ann", said("My city is Rome. My dog is Max.", "c1"), settings=settings)
    b = enqueue_signal("session_end", "ann", said("My dog is Bo. My city is Oslo.", "c2"), settings=settings)
    with psycopg.connect(url_of(settings), autocommit=True) as watch, psycopg.connect(url_of(settings)) as holder:
        # The host application (or any writer) holds ann's "dog" entry for a moment.
        holder.execute("SELECT 1 FROM usermemories WHERE user_id = 'ann' AND key = 'dog' FOR UPDATE")
        second = start(process_signal, settings, b.signal_id)  # dog first: waits for it
        until(lambda: waiting(watch, "%usermemories%") == 1)
        first = start(process_signal, settings, a.signal_id)  # city first (locked), then dog
        until(lambda: waiting(watch, "%usermemories%") == 2)
        holder.rollback()
        both_finish(first, second)
    with session_scope(settings) as session:
        from sqlalchemy import text

        rows = session.execute(text("SELECT status, last_error FROM dream_signals ORDER BY id")).all()
    assert [r.status for r in rows] == ["done", "done", "done"], rows


# -- 3. a wake-up's batch against an erasure, on the user's signal rows ------------------


def deadlocks(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


def no_new_deadlock(conn: psycopg.Connection[Any], before: int) -> None:
    # Statistics reach pg_stat_database within about a second of a backend going idle.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert deadlocks(conn) == before, "PostgreSQL detected a deadlock"
        time.sleep(0.2)


def test_a_batch_and_an_erasure_lock_one_users_signals_in_one_order(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's finish and an erasure lock the user's signals in id order: the
    finish's own plan walks an index on (status, kind), an activity signal before an
    older session_end one, and an erasure's delete goes in the rows' order."""
    from tasks.signals import process_signal
    from worker import offline_model

    url = url_of(pg_settings)
    with psycopg.connect(url, autocommit=True) as conn:
        # A signals table of some size (finished signals of other users).
        conn.execute(
            "INSERT INTO dream_signals (kind, user_id, payload, status, idempotency_key) "
            "SELECT 'activity', 'u' || (g % 500), '{}'::jsonb, 'done', 'k' || g FROM generate_series(1, 20000) g"
        )
        conn.execute("ANALYZE dream_signals")
    s1 = enqueue_signal("session_end", "ann", said("My dog is Rex.", "c1"), settings=pg_settings).signal_id
    # Of another kind: the index the finish walks orders the batch's rows by kind first.
    events = {"events": [{"action": "digest", "at": "2024-05-06T09:00:00Z"}]}
    s2 = enqueue_signal("activity", "ann", events, settings=pg_settings).signal_id
    entered, release = threading.Event(), threading.Event()
    real = offline_model.answer

    def gated(purpose: str, task: Any) -> str:
        entered.set()
        assert release.wait(WAIT)
        return real(purpose, task)

    monkeypatch.setattr(offline_model, "answer", gated)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as holder:
        before = deadlocks(watch)
        batch = start(process_signal, pg_settings, s1)  # claims s1, and s2 as its fill
        assert entered.wait(WAIT)
        # Something holds s2 for a moment (the timing device of this test).
        holder.execute("SELECT 1 FROM dream_signals WHERE id = %s FOR UPDATE", (s2,))
        release.set()
        # The batch's finish (activity before session_end) waits for s2, holding nothing.
        until(lambda: waiting(watch, "%WITH held AS%") == 1)
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        until(lambda: waiting(watch, "SELECT dream_signals.id%") == 1)
        holder.rollback()
        erased = outcome(erasing)
        batched = outcome(batch)
        assert not is_deadlock(erased), f"deadlock: {erased!r}"
        assert batched is None and erased is None
        no_new_deadlock(watch, before)


# -- 4. the reaper against an erasure, on a run's budget lines -----------------------------


def test_the_reaper_and_an_erasure_take_a_runs_budget_lines_in_one_order(pg_settings: Settings) -> None:
    """The reaper settles an expired reservation's lines in a call's order (the run's
    total ``<run>``, then its agent's share ``<run>/<agent>``, then the day); an erasure
    locks a run's lines in that order too, not in the order its delete's plan reads
    them (a run whose calls were for two agents leaves agent 1's line before the total)."""
    from store.spend import BudgetLine

    url = url_of(pg_settings)
    with psycopg.connect(url, autocommit=True) as conn:
        run_id = conn.execute(
            "INSERT INTO dream_runs (user_id, status) VALUES ('ann', 'failed') RETURNING id"
        ).fetchone()[0]
    big = 10**12
    total = BudgetLine("run", budget.run_key(run_id), big)
    day = BudgetLine("day", budget.day_key(), big, follows_settings=True)
    agent1 = [total, BudgetLine("run", budget.agent_key(run_id, "a1"), big), day]
    agent2 = [total, BudgetLine("run", budget.agent_key(run_id, "a2"), big), day]
    budget.reserve(pg_settings, agent1, 1_000)  # its process dies in the call
    budget.reserve(pg_settings, agent2, 1_000)
    budget.settle(pg_settings, budget.reserve(pg_settings, agent2, 1_000), 10)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as holder:
        before = deadlocks(watch)
        # Another call of the run holds its total for a moment.
        holder.execute("SELECT 1 FROM dream_spend WHERE scope = 'run' AND scope_key = %s FOR UPDATE", (total.key,))
        later = now() + timedelta(days=1)
        reaping = start(budget.reap_expired, pg_settings, later)  # both reservations are past their deadline
        until(lambda: waiting(watch, "UPDATE dream_spend%") == 1)
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        until(lambda: waiting(watch, "SELECT dream_spend.scope_key%") == 1)
        holder.rollback()
        both_finish(reaping, erasing)
        no_new_deadlock(watch, before)


# -- 5. a call's settlement against an erasure, on the user's budget lines --------------------


def test_an_erasure_takes_the_budget_lines_in_the_order_a_calls_settlement_does(pg_settings: Settings) -> None:
    # A signal's call settles its lines in one transaction: the day, the user's day,
    # then the signal's own. An erasure of that user deletes the user's and the
    # signal's lines; taking them in the other order deadlocked with the settlement.
    signal_id = enqueue_signal("session_end", "ann", said("My dog is Rex"), settings=pg_settings).signal_id
    lines = budget.lines_for(pg_settings, None, None, user_id="ann", signal_id=signal_id)
    reservation = budget.reserve(pg_settings, lines, 1_000)
    user_line = next(line for line in lines if line.scope == "user")
    url = pg_settings.database_url.replace("+psycopg", "")
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as holder:
        # Another call of that user holds its day line for a moment.
        holder.execute("SELECT 1 FROM dream_spend WHERE scope = 'user' AND scope_key = %s FOR UPDATE", (user_line.key,))
        settling = start(budget.settle, pg_settings, reservation, 1_000)
        until(lambda: waiting(watch, "UPDATE dream_spend%") == 1)
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        until(lambda: waiting(watch, "DELETE FROM dream_spend%") == 1)
        holder.rollback()
        both_finish(settling, erasing)
    with session_scope(pg_settings) as session:
        assert {table: n for table, n in rows_about(session, pg_settings, "ann").items() if n} == {}


# -- 6. an order Reverie cannot see: an application's own transaction -----------------------


def test_an_erasure_the_database_rolls_back_as_a_deadlocks_victim_is_run_again(pg_settings: Settings) -> None:
    """An application's transaction holds one of ann's memory rows, then reaches for
    ann's pending signal, which the erasure (waiting for that row) already holds. The
    erasure waited first, so the database rolls it back; it is run again and erases."""
    from sqlalchemy import func, select

    enqueue_signal("session_end", "ann", said("My dog is Rex.", "c1"), settings=pg_settings)
    process_pending(pg_settings)
    enqueue_signal("session_end", "ann", said("My city is Rome.", "c2"), settings=pg_settings)
    url = url_of(pg_settings)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as app:
        app.execute("UPDATE usermemories SET access_count = access_count + 1 WHERE user_id = 'ann'")
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        until(lambda: waiting(watch, "DELETE FROM usermemories%") == 1)
        # Waits for the erasure, until the database rolls the erasure back.
        app.execute("SELECT 1 FROM dream_signals WHERE user_id = 'ann' FOR UPDATE")
        app.commit()
        assert outcome(erasing) is None
    with session_scope(pg_settings) as session:
        assert {table: n for table, n in rows_about(session, pg_settings, "ann").items() if n} == {}
        assert session.scalar(select(func.count()).select_from(Signal)) == 0


def test_a_signal_committed_while_the_erasure_waits_for_the_users_signals_is_kept_with_its_budget_line(
    pg_settings: Settings,
) -> None:
    from sqlalchemy import text

    from store.spend import BudgetLine

    def events(action: str) -> dict[str, Any]:
        return {"events": [{"action": action, "at": "2024-05-06T09:00:00Z"}]}

    s1 = enqueue_signal("activity", "ann", events("a"), settings=pg_settings).signal_id
    url = url_of(pg_settings)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as holder:
        holder.execute("SELECT 1 FROM dream_signals WHERE id = %s FOR UPDATE", (s1,))  # a worker applying s1
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        until(lambda: waiting(watch, "SELECT dream_signals.id%") == 1)
        # Meanwhile ann's next signal arrives, and a worker reserves its model call.
        s2 = enqueue_signal("activity", "ann", events("b"), settings=pg_settings).signal_id
        budget.reserve(pg_settings, [BudgetLine("signal", budget.signal_key(s2), 10**12, follows_settings=True)], 1000)
        holder.rollback()
        assert outcome(erasing) is None
    with session_scope(pg_settings) as session:
        left = session.scalar(text("SELECT count(*) FROM dream_signals WHERE id = :i"), {"i": s2})
        line = session.scalar(
            text("SELECT count(*) FROM dream_spend WHERE scope = 'signal' AND scope_key = :k"), {"k": str(s2)}
        )
    # After the erasure began: processed as usual, with its budget line (never erased
    # while its line is kept).
    assert (left, line) == (1, 1)


def test_forgetting_old_events_rolled_back_as_a_deadlocks_victim_is_run_again(pg_settings: Settings) -> None:
    # The forgetting walks an index on (user_id, action, at); an erasure's delete of
    # the user's events may go in the rows' physical order: each can hold a row the
    # other wants next.
    url = url_of(pg_settings)
    old = now() - timedelta(weeks=30)
    with psycopg.connect(url, autocommit=True) as conn:
        for action in ("z", "a", "m"):  # stored z, a, m; indexed a, m, z
            conn.execute(
                "INSERT INTO dream_activity (user_id, agent_id, action, at) VALUES ('ann', 'g', %s, %s)", (action, old)
            )
        conn.execute(
            "INSERT INTO dream_activity (user_id, agent_id, action, at) "
            "SELECT 'u' || (g % 2000), 'g', 'r', now() FROM generate_series(1, 50000) g"
        )
        conn.execute("ANALYZE dream_activity")
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as holder:
        holder.execute("SELECT 1 FROM dream_activity WHERE user_id = 'ann' AND action = 'm' FOR UPDATE")
        detecting = start(detect_routines, pg_settings)
        until(lambda: waiting(watch, "DELETE FROM dream_activity WHERE dream_activity.at <%") == 1)
        erasing = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
        until(lambda: waiting(watch, "DELETE FROM dream_activity WHERE dream_activity.user_id =%") == 1)
        time.sleep(1.5)  # past deadlock_timeout: the erasure's own check found no cycle then
        holder.rollback()  # the forgetting goes on to the row the erasure holds
        both_finish(detecting, erasing)
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM dream_activity WHERE user_id = 'ann'").fetchone() == (0,)
