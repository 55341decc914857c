"""Claiming, applying and recording signal outcomes: exactly-once effects (real PostgreSQL)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import delete, select, update

from store import schedule
from store import signals as signal_store
from store.db import session_scope
from store.memories import table_for
from store.models import Event, Signal
from store.types import now
from tasks import session_end
from tasks.signals import HANDLERS, Handler, process_claimed, process_pending, process_signal
from worker import llm
from worker.errors import BudgetExhausted, PermanentError, TransientError
from worker.producer import enqueue_signal
from worker.settings import Settings


def said(text: str, conversation: str = "c1") -> dict[str, Any]:
    return {"conversation_id": conversation, "agent_id": "agent-a", "messages": [{"role": "user", "content": text}]}


def signal_row(settings: Settings, signal_id: int) -> Signal:
    with session_scope(settings) as session:
        row = session.get(Signal, signal_id)
        assert row is not None
        return row


def memory_count(settings: Settings) -> int:
    with session_scope(settings) as session:
        return len(session.execute(select(table_for(settings).c.id)).all())


def event_count(settings: Settings) -> int:
    with session_scope(settings) as session:
        return len(session.scalars(select(Event.id)).all())


def counter(kind: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("dream_signals_processed_total", {"kind": kind, "outcome": outcome}) or 0.0


def test_done_sets_processed_at_and_counts(pg_settings: Settings) -> None:
    before = counter("session_end", "done")
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    assert process_signal(pg_settings, sid) == "done"
    row = signal_row(pg_settings, sid)
    assert (row.status, row.attempts, row.claim_token, row.last_error) == ("done", 1, None, None)
    assert row.processed_at is not None
    assert counter("session_end", "done") == before + 1
    # Redelivery of a finished signal does nothing.
    assert process_signal(pg_settings, sid) == "skipped"
    assert (memory_count(pg_settings), event_count(pg_settings)) == (1, 1)


def test_invalid_row_is_rejected_with_the_field_named_and_never_retried(pg_settings: Settings) -> None:
    with session_scope(pg_settings) as session:
        sid = signal_store.insert_signal(
            session,
            kind="session_end",
            user_id="u1",
            payload={"conversation_id": "c", "messages": [{"role": "robot", "content": "hi"}]},
            agent_id=None,
            idempotency_key=None,
            fallback_key="x",
        ).signal_id
    report = process_pending(pg_settings)
    assert report.rejected == 1
    row = signal_row(pg_settings, sid)
    assert row.status == "rejected"
    assert row.last_error is not None and row.last_error.startswith("payload.messages[0].role:")
    assert process_pending(pg_settings).results == []


def test_transient_error_fails_with_backoff_then_dies(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = make_settings(signal_max_attempts=2, signal_backoff_seconds=60)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise TransientError("RateLimitError: slow down")

    monkeypatch.setattr(llm, "complete", boom)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=settings).signal_id
    started = now()
    assert process_pending(settings).failed == 1
    row = signal_row(settings, sid)
    assert (row.status, row.attempts) == ("failed", 1)
    assert row.available_at >= started + timedelta(seconds=59)
    assert "RateLimitError" in (row.last_error or "")
    # Not due yet: nothing happens.
    assert process_pending(settings).results == []
    with session_scope(settings) as session:
        session.execute(update(Signal).where(Signal.id == sid).values(available_at=now() - timedelta(seconds=1)))
    assert process_pending(settings).dead == 1
    row = signal_row(settings, sid)
    assert (row.status, row.attempts) == ("dead", 2)
    assert memory_count(settings) == 0
    # `reverie signals retry` puts it back; with the model healthy again it is applied.
    monkeypatch.undo()
    with session_scope(settings) as session:
        assert signal_store.retry_signals(session, signal_id=sid) == [sid]
    assert process_pending(settings).processed == 1
    assert memory_count(settings) == 1


def _killed_mid_statement(url: str) -> BaseException:
    """What SQLAlchemy raises for a statement on a session the server ended
    (``pg_terminate_backend``, as an administrator or a failover does): the real one."""
    import psycopg
    from sqlalchemy import create_engine

    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as connection:
            pid = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", (pid,))
            try:
                connection.exec_driver_sql("SELECT 1")
            except Exception as exc:
                return exc
    finally:
        engine.dispose()
    raise AssertionError("the statement on a terminated session did not fail")


def test_a_connection_the_server_ended_mid_signal_is_not_the_signals_error(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed session, wherever its error is raised from, stops the pass as a lost
    database does; the signal is not recorded as failed by an internal error (a backoff
    meant for bugs), and is done once taken again."""
    from worker.errors import DatabaseUnavailable

    ended = _killed_mid_statement(pg_settings.database_url)

    def killed(*args: Any, **kwargs: Any) -> Any:
        raise ended

    monkeypatch.setattr(llm, "complete", killed)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    with pytest.raises(DatabaseUnavailable):
        process_pending(pg_settings)
    row = signal_row(pg_settings, sid)
    assert row.status == "processing" and "internal error" not in (row.last_error or "")
    monkeypatch.undo()
    with session_scope(pg_settings) as session:
        session.execute(update(Signal).where(Signal.id == sid).values(claimed_until=now() - timedelta(seconds=1)))
    assert process_pending(pg_settings).processed == 1
    assert signal_row(pg_settings, sid).status == "done"


def test_what_counts_as_a_lost_connection(pg_settings: Settings) -> None:
    """By the connection, not the error's class: a remote server dblink or postgres_fdw
    cannot reach raises SQLSTATE 08001 on a healthy session (the signal's own error)."""
    import psycopg
    from sqlalchemy import create_engine, text

    from store.db import lost_connection

    assert lost_connection(_killed_mid_statement(pg_settings.database_url))
    url = pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as raw, psycopg.connect(url, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (raw.info.backend_pid,))
        with pytest.raises(psycopg.Error) as raised:
            raw.execute("SELECT 1")
    assert lost_connection(raised.value)  # a raw cursor's (the COPY's): by its SQLSTATE, 57P01
    engine = create_engine(pg_settings.database_url)
    try:
        for statement in (
            "DO $$ BEGIN RAISE EXCEPTION 'remote ledger unreachable' USING ERRCODE = '08001'; END $$",
            "SET statement_timeout = 1; SELECT pg_sleep(1)",
            "SELECT 1/0",
        ):
            with engine.connect() as connection, pytest.raises(Exception) as healthy:
                connection.execute(text(statement))
            assert not lost_connection(healthy.value), statement
    finally:
        engine.dispose()


def test_a_remote_server_a_host_trigger_cannot_reach_fails_that_signal_alone(pg_settings: Settings) -> None:
    """SQLSTATE 08001 raised on a healthy session (a host trigger's dblink to a remote
    server that is down) is that signal's error: the others claimed with it are done."""
    from sqlalchemy import text

    with session_scope(pg_settings) as session:
        session.execute(
            text(
                "CREATE FUNCTION remote_ledger() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.user_id = 'poison' THEN RAISE EXCEPTION 'remote ledger unreachable' USING ERRCODE = '08001'; "
                "END IF; RETURN NEW; END $$"
            )
        )
        session.execute(
            text(
                "CREATE TRIGGER remote_ledger BEFORE INSERT ON usermemories "
                "FOR EACH ROW EXECUTE FUNCTION remote_ledger()"
            )
        )
    try:
        ids = {
            user: enqueue_signal("session_end", user, said("My favorite color is blue"), settings=pg_settings).signal_id
            for user in ("alice", "poison", "bob")
        }
        report = process_pending(pg_settings)
        assert (report.processed, report.failed) == (2, 1)
        assert signal_row(pg_settings, ids["poison"]).status == "failed"
        assert {signal_row(pg_settings, ids[u]).status for u in ("alice", "bob")} == {"done"}
    finally:
        with session_scope(pg_settings) as session:
            session.execute(text("DROP TRIGGER remote_ledger ON usermemories"))
            session.execute(text("DROP FUNCTION remote_ledger()"))


def test_permanent_model_error_goes_dead_for_an_operator(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bad(*args: Any, **kwargs: Any) -> Any:
        raise PermanentError("model 'x' has no price")

    monkeypatch.setattr(llm, "complete", bad)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    assert process_pending(pg_settings).dead == 1
    assert "permanent model error" in (signal_row(pg_settings, sid).last_error or "")


def test_budget_exhausted_waits_without_using_attempts(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    def broke(*args: Any, **kwargs: Any) -> Any:
        raise BudgetExhausted("day", 0.01, 0.0)

    monkeypatch.setattr(llm, "complete", broke)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    assert process_pending(pg_settings).failed == 1
    row = signal_row(pg_settings, sid)
    assert (row.status, row.attempts) == ("failed", 0)


def test_unexpected_error_is_recorded_not_raised(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(llm, "complete", bug)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    assert process_pending(pg_settings).failed == 1
    assert signal_row(pg_settings, sid).last_error.startswith("internal error: RuntimeError at "), sid


def test_crash_before_done_leaves_nothing_and_the_retry_applies_once(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    real_mark_dirty = schedule.mark_dirty

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # the worker dies after the memory write and the done mark, before commit

    monkeypatch.setattr(schedule, "mark_dirty", crash)
    with pytest.raises(KeyboardInterrupt):
        process_pending(pg_settings)
    monkeypatch.setattr(schedule, "mark_dirty", real_mark_dirty)
    assert memory_count(pg_settings) == 0
    row = signal_row(pg_settings, sid)
    assert row.status == "processing"
    # Its lease expires; the next pass claims it again and applies it once.
    with session_scope(pg_settings) as session:
        session.execute(update(Signal).where(Signal.id == sid).values(claimed_until=now() - timedelta(seconds=1)))
    assert process_pending(pg_settings).processed == 1
    assert (signal_row(pg_settings, sid).attempts, memory_count(pg_settings), event_count(pg_settings)) == (2, 1, 1)


def test_lost_claim_writes_nothing(pg_settings: Settings) -> None:
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    with session_scope(pg_settings) as session:
        [stale] = signal_store.claim_signals(session, lease_seconds=60, limit=1)
        # The first worker stalls past its lease; a second worker takes over and finishes.
        session.execute(update(Signal).where(Signal.id == sid).values(claimed_until=now() - timedelta(seconds=1)))
    assert process_pending(pg_settings).processed == 1
    # The first worker wakes up: its claim token is no longer valid.
    assert process_claimed(pg_settings, stale).outcome == "skipped"
    assert (memory_count(pg_settings), event_count(pg_settings)) == (1, 1)


def test_expired_lease_after_last_attempt_is_dead(make_settings: Any) -> None:
    settings = make_settings(signal_max_attempts=1)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=settings).signal_id
    with session_scope(settings) as session:
        signal_store.claim_signals(session, lease_seconds=60, limit=1)
        session.execute(update(Signal).where(Signal.id == sid).values(claimed_until=now() - timedelta(seconds=1)))
    assert process_pending(settings).dead == 1
    assert signal_row(settings, sid).status == "dead"


def test_two_workers_racing_on_one_signal_apply_it_once(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    outcomes: list[str] = []
    start = threading.Barrier(4)

    def worker() -> None:
        start.wait()
        outcomes.append(process_signal(pg_settings, sid))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == ["done", "skipped", "skipped", "skipped"]
    assert (memory_count(pg_settings), event_count(pg_settings)) == (1, 1)
    assert signal_row(pg_settings, sid).attempts == 1


def test_concurrent_passes_share_the_work_without_duplicates(pg_settings: Settings) -> None:
    for i in range(30):
        enqueue_signal("session_end", f"user-{i}", said(f"My lucky number is {i}", f"c{i}"), settings=pg_settings)
    reports = []

    def worker() -> None:
        reports.append(process_pending(pg_settings))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sum(r.processed for r in reports) == 30
    done_ids = [r.signal_id for report in reports for r in report.results if r.outcome == "done"]
    assert len(done_ids) == len(set(done_ids)) == 30
    assert (memory_count(pg_settings), event_count(pg_settings)) == (30, 30)


def test_apply_checks_the_row_still_exists(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    real_prepare = session_end.prepare

    def prepare_then_vanish(settings: Settings, signal: Any) -> Any:
        prepared = real_prepare(settings, signal)
        with session_scope(settings) as session:
            session.execute(delete(Signal).where(Signal.id == sid))
        return prepared

    monkeypatch.setitem(HANDLERS, "session_end", Handler(prepare_then_vanish, session_end.apply))
    assert process_pending(pg_settings).skipped == 1
    assert memory_count(pg_settings) == 0


def test_sqlite_backend_processes_signals(sqlite_settings: Settings) -> None:
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=sqlite_settings).signal_id
    assert process_pending(sqlite_settings).processed == 1
    assert signal_row(sqlite_settings, sid).status == "done"
    assert memory_count(sqlite_settings) == 1


def test_one_wake_up_processes_a_batch_of_due_signals_each_once(pg_settings: Settings) -> None:
    sids = [
        enqueue_signal(
            "session_end", f"user-{i}", said(f"My lucky number is {i}", f"c{i}"), settings=pg_settings
        ).signal_id
        for i in range(5)
    ]
    assert process_signal(pg_settings, sids[2]) == "done"
    assert {signal_row(pg_settings, sid).status for sid in sids} == {"done"}
    assert (memory_count(pg_settings), event_count(pg_settings)) == (5, 5)
    # The other wake-ups arrive later and find nothing to do.
    assert [process_signal(pg_settings, sid) for sid in sids] == ["skipped"] * 5
    assert [signal_row(pg_settings, sid).attempts for sid in sids] == [1] * 5


def test_a_failing_signal_in_a_batch_costs_the_others_nothing(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    sids = [
        enqueue_signal(
            "session_end", f"user-{i}", said(f"My lucky number is {i}", f"c{i}"), settings=pg_settings
        ).signal_id
        for i in range(4)
    ]

    def apply_or_break(session: Any, settings: Settings, signal: Any, prepared: Any) -> Any:
        if signal.signal_id == sids[1]:
            raise RuntimeError("a row the database refuses")
        return session_end.apply(session, settings, signal, prepared)

    monkeypatch.setitem(HANDLERS, "session_end", Handler(session_end.prepare, apply_or_break))
    assert process_signal(pg_settings, sids[0]) == "done"
    statuses = [signal_row(pg_settings, sid).status for sid in sids]
    assert statuses == ["done", "failed", "done", "done"]
    assert signal_row(pg_settings, sids[1]).last_error.startswith("internal error: RuntimeError at ")
    assert (memory_count(pg_settings), event_count(pg_settings)) == (3, 3)


def test_a_wake_up_for_an_exhausted_signal_buries_it(make_settings: Any) -> None:
    settings = make_settings(signal_max_attempts=1)
    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=settings).signal_id
    with session_scope(settings) as session:
        signal_store.claim_signals(session, lease_seconds=60, limit=1)
        session.execute(update(Signal).where(Signal.id == sid).values(claimed_until=now() - timedelta(seconds=1)))
    before = counter("session_end", "dead")
    assert process_signal(settings, sid) == "skipped"
    assert signal_row(settings, sid).status == "dead"
    assert counter("session_end", "dead") == before + 1


def test_a_wake_up_that_finds_its_signal_done_costs_one_statement(pg_settings: Settings) -> None:
    # Under a backlog most wake-ups find their signal done by an earlier batch: each
    # costs one round trip (the claim, with the burial check in it), no clock reads.
    from sqlalchemy import event

    from store.db import get_engine

    sids = [
        enqueue_signal("activity", f"user-{i}", activity_payload(i), settings=pg_settings).signal_id for i in range(3)
    ]
    assert process_signal(pg_settings, sids[0]) == "done"
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    engine = get_engine(pg_settings)
    event.listen(engine, "before_cursor_execute", seen)
    try:
        assert [process_signal(pg_settings, sid) for sid in sids] == ["skipped"] * 3
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert len(statements) == 3, statements
    assert {signal_row(pg_settings, sid).status for sid in sids} == {"done"}


def test_a_wake_up_buries_its_own_exhausted_signal_and_leaves_the_others_to_their_own(make_settings: Any) -> None:
    settings = make_settings(signal_max_attempts=1)
    exhausted = enqueue_signal("activity", "u1", activity_payload(1), settings=settings).signal_id
    with session_scope(settings) as session:
        signal_store.claim_signals(session, lease_seconds=60, limit=1)
        session.execute(update(Signal).where(Signal.id == exhausted).values(claimed_until=now() - timedelta(seconds=1)))
    other = enqueue_signal("activity", "u2", activity_payload(2), settings=settings).signal_id
    assert process_signal(settings, exhausted) == "skipped"
    assert signal_row(settings, exhausted).status == "dead"
    assert signal_row(settings, exhausted).attempts == 1
    # A signal whose lease expired may be what killed its worker: its wake-up takes no others.
    assert (signal_row(settings, other).status, signal_row(settings, other).attempts) == ("pending", 0)
    assert process_signal(settings, other) == "done"


def activity_payload(n: int) -> dict[str, Any]:
    return {"agent_id": "agent-a", "events": [{"action": f"digest-{n}", "at": "2026-01-05T09:00:00Z"}]}


@pytest.mark.parametrize("path", ["wake-up", "pass"])
def test_signals_claimed_by_a_commit_whose_reply_was_lost_are_given_back_at_once(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # Before: the claims held until their lease ran out (five minutes), the task's
    # retry said "skipped", and an attempt was used for nothing: a signal on its last
    # attempt was buried without ever being applied.
    from tasks import signals as signal_tasks
    from tests.lost_replies import lose_the_reply_of
    from worker.errors import DatabaseUnavailable

    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    lost = lose_the_reply_of(monkeypatch, signal_tasks.signal_store, "claim_signals", autocommit=path == "wake-up")
    with pytest.raises(DatabaseUnavailable):
        if path == "wake-up":
            signal_tasks.process_signal(pg_settings, sid)
        else:
            signal_tasks.process_pending(pg_settings)
    assert [len(claimed) for claimed in lost] == [1]
    with session_scope(pg_settings) as session:
        row = session.get(Signal, sid)
        assert row is not None
        assert (row.status, row.attempts, row.claim_token) == ("pending", 0, None)
    # The task's retry applies it at once, on its first attempt.
    if path == "wake-up":
        assert signal_tasks.process_signal(pg_settings, sid) == "done"
    else:
        assert signal_tasks.process_pending(pg_settings).processed == 1
    with session_scope(pg_settings) as session:
        row = session.get(Signal, sid)
        assert row is not None
        assert (row.status, row.attempts) == ("done", 1)


def test_a_wake_up_that_cannot_reach_the_database_gives_nothing_back_and_fails_at_once(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A connection never made sent no claim: there is nothing to give back, and trying
    # for seconds would only hold the worker's slot (and log a commit that never was)
    # while the database is down, where the task's retry backs off by itself.
    from tasks import signals as signal_tasks
    from tests.processes import free_port
    from worker.errors import DatabaseUnavailable

    sid = enqueue_signal("session_end", "u1", said("My favorite color is blue"), settings=pg_settings).signal_id
    down = pg_settings.model_copy(update={"database_url": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x"})
    tried: list[object] = []
    monkeypatch.setattr(signal_tasks, "give_back", lambda *args, **kwargs: tried.append(args))
    with pytest.raises(DatabaseUnavailable):
        signal_tasks.process_signal(down, sid)
    assert tried == []
    assert signal_row(pg_settings, sid).status == "pending"


def test_a_new_users_conversation_is_dreamed_once_after_the_dirty_delay_not_at_once(pg_settings: Settings) -> None:
    from store import dispatch as dispatch_store
    from store.models import UserState

    interval = pg_settings.dream_interval_hours * 3600

    def claim(at: Any) -> list[str]:
        with session_scope(pg_settings) as session:
            return dispatch_store.claim_due_users(
                session,
                at=at,
                limit=10,
                interval_seconds=interval,
                dirty_delay_seconds=pg_settings.dispatch_dirty_delay_seconds,
                lease_seconds=3600,
            )

    def state(user_id: str) -> tuple[Any, Any]:
        with session_scope(pg_settings) as session:
            found = session.get(UserState, user_id)
            assert found is not None
            return found.dirty_since, found.next_dream_at

    # Two users never seen: one's first signal alone, the other's with another user's
    # in one batch; then the rest of the first one's conversation.
    first = enqueue_signal("session_end", "newcomer", said("My favorite color is blue"), settings=pg_settings)
    assert process_signal(pg_settings, first.signal_id) == "done"
    enqueue_signal("session_end", "other", said("My favorite food is sushi"), settings=pg_settings)
    enqueue_signal("session_end", "newcomer", said("My favorite food is ramen", "c2"), settings=pg_settings)
    assert process_pending(pg_settings).processed == 2
    changed, slot = state("newcomer")
    other_changed, other_slot = state("other")
    assert changed is not None and other_changed is not None and other_changed >= changed
    # Each one's next dream is on its own phase of the interval, not now.
    assert slot == dispatch_store.next_slot("newcomer", changed, interval)
    assert other_slot == dispatch_store.next_slot("other", other_changed, interval)
    assert min(slot - changed, other_slot - other_changed) >= timedelta(seconds=interval / 2)
    assert memory_count(pg_settings) == 3
    assert claim(changed + timedelta(seconds=5)) == []
    delay = timedelta(seconds=pg_settings.dispatch_dirty_delay_seconds)
    settled = max(changed, other_changed) + delay + timedelta(seconds=1)
    assert sorted(claim(settled)) == ["newcomer", "other"]
    assert claim(settled + timedelta(seconds=1)) == []


def test_a_row_the_database_refuses_names_its_constraint_and_never_its_value(pg_settings: Settings) -> None:
    # A host's own rule on its memory table: the signal fails (and is retried), and its
    # last error says which rule, as the database names it, without the row it quoted.
    from sqlalchemy import text

    from store.db import session_scope

    with session_scope(pg_settings) as session:
        session.execute(text("ALTER TABLE usermemories ADD CONSTRAINT host_rule CHECK (key <> 'home_city')"))
    try:
        sid = enqueue_signal("session_end", "u1", said("My home city is Reykjavik"), settings=pg_settings).signal_id
        assert process_pending(pg_settings).failed == 1
        row = signal_row(pg_settings, sid)
    finally:
        with session_scope(pg_settings) as session:
            session.execute(text("ALTER TABLE usermemories DROP CONSTRAINT host_rule"))
    assert row.status == "failed"
    assert "IntegrityError" in row.last_error and "constraint host_rule" in row.last_error, row.last_error
    assert "23514" in row.last_error and "Reykjavik" not in row.last_error
