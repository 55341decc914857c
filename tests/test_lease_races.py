"""Dream leases under a compressed lease length (real PostgreSQL, threads and processes).

A run renews every lease it holds while it works, so a user of a chunk is never
taken over, or erased, under it. A run whose process froze past its lease (here:
SIGSTOP) finds the leases it lost when it wakes up and writes nothing more for those
users: an erased user never comes back, and a run that took a user over never has
another run's writes land inside it. An erasure's own lease holds while the erasing
transaction waits.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

from store.db import dispose_engines, session_scope
from store.erase import rows_about
from store.memories import table_for
from store.models import ArchivedEntry, Run, Signal, UserState
from tasks import dream, erase
from tasks.dream import dream_user, dream_users
from tasks.erase import erase_user
from tasks.leases import LeaseKeeper
from tests.lost_replies import lose_the_reply_of
from worker import offline_model
from worker.errors import UserBusy
from worker.producer import enqueue_signal
from worker.settings import Settings

WAIT = 120
TTL = timedelta(seconds=1)
USERS = ["u1", "u2", "u3"]


@pytest.fixture()
def short_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dream, "lease_ttl", lambda settings: TTL)


def seed_group(settings: Settings, user: str, n: int = 6) -> None:
    """A group the summarizer compresses (one agent, one category, enough entries)."""
    table = table_for(settings)
    with session_scope(settings) as session:
        session.execute(
            table.insert(),
            [
                {
                    "id": f"{user}-note-{i}",
                    "user_id": user,
                    "key": f"trip_note_{i}",
                    "value": f"note {i}",
                    "category": "fact",
                    "source_agent_id": "a",
                }
                for i in range(n)
            ],
        )


def nothing_left(settings: Settings, user: str) -> None:
    with session_scope(settings) as session:
        left = {table: n for table, n in rows_about(session, settings, user).items() if n}
    assert left == {}


def runs_of(settings: Settings, user: str) -> list[Run]:
    with session_scope(settings) as session:
        found = list(session.scalars(select(Run).where(Run.user_id == user).order_by(Run.id)))
        session.expunge_all()
    return found


def summarized_by(settings: Settings, run_id: int) -> int:
    with session_scope(settings) as session:
        query = select(ArchivedEntry.id).where(ArchivedEntry.run_id == run_id, ArchivedEntry.reason == "summarize")
        return len(list(session.scalars(query)))


def never_overlap(runs: list[Run]) -> None:
    for before, after in itertools.pairwise(runs):
        assert before.finished_at is not None and before.finished_at <= after.started_at, (before, after)


def leases_expired(settings: Settings, users: list[str]) -> None:
    """Wait, on the database's clock, until every lease of ``users`` has run out."""
    url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    query = (
        "SELECT count(*) FROM dream_user_state WHERE user_id = ANY(%s) "
        "AND locked_until < timezone('utc', statement_timestamp())"
    )
    deadline = time.monotonic() + WAIT
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(query, (users,)).fetchone()
            if row and row[0] == len(users):
                return
            assert time.monotonic() < deadline, "the leases never ran out"
            time.sleep(0.05)


class ThreadGate:
    """Blocks the offline model's summarize answers in one thread until released."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self._answer = offline_model.answer

    def __call__(self, purpose: str, task: Any) -> str:
        if purpose == "summarize" and threading.get_ident() == self.thread:
            self.entered.set()
            assert self.release.wait(WAIT), "never released"
        return self._answer(purpose, task)


@pytest.fixture()
def thread_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadGate]:
    gate = ThreadGate()
    monkeypatch.setattr(offline_model, "answer", gate)
    yield gate
    gate.release.set()


def in_thread(gate: ThreadGate, target: Callable[..., Any], *args: Any) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []

    def run() -> None:
        gate.thread = threading.get_ident()
        try:
            results.append(target(*args))
        except BaseException as exc:  # surfaced by the test
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, results


def finished(thread: threading.Thread, results: list[Any]) -> Any:
    thread.join(WAIT)
    assert not thread.is_alive(), "thread did not finish"
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


def test_a_chunk_keeps_every_lease_while_one_user_waits_for_the_model(
    pg_settings: Settings, short_leases: None, thread_gate: ThreadGate
) -> None:
    for user in USERS:
        seed_group(pg_settings, user)
    chunk, results = in_thread(thread_gate, dream_users, pg_settings, USERS)
    assert thread_gate.entered.wait(WAIT)  # u1's summary call is under way; u2 and u3 wait their turn
    time.sleep(4 * TTL.total_seconds())  # a lease renewed only between model calls would be gone
    assert dream_user(pg_settings, "u3").status == "skipped"
    with pytest.raises(UserBusy):
        erase_user(pg_settings, "u2", wait_seconds=0.5)
    eraser, erased = in_thread(ThreadGate(), lambda: erase_user(pg_settings, "u2", wait_seconds=WAIT))
    thread_gate.release.set()
    outcomes = finished(chunk, results)
    finished(eraser, erased)
    assert [o.status for o in outcomes] == ["succeeded"] * 3
    nothing_left(pg_settings, "u2")
    assert len(runs_of(pg_settings, "u3")) == 1
    assert summarized_by(pg_settings, runs_of(pg_settings, "u1")[0].id) == 6


# -- a run whose process froze past its leases ---------------------------------------


def _frozen_run(settings: Settings, users: list[str], entered: Any, release: Any) -> None:
    """A run in a process of its own that stops inside its first summary call."""
    real = offline_model.answer

    def gated(purpose: str, task: Any) -> str:
        if purpose == "summarize" and not release.is_set():
            entered.set()
            release.wait(WAIT)
        return real(purpose, task)

    offline_model.answer = gated  # type: ignore[assignment]  # this process only
    if len(users) == 1:
        dream_user(settings, users[0])
    else:
        dream_users(settings, users)


class Frozen:
    """A forked run, stopped with SIGSTOP inside its first model call."""

    def __init__(self, settings: Settings, users: list[str]) -> None:
        # Forked with the gateway imported and no database connection of ours.
        offline_model.build_handler()
        dispose_engines()
        context = multiprocessing.get_context("fork")
        self.entered, self.release = context.Event(), context.Event()
        self.process = context.Process(target=_frozen_run, args=(settings, users, self.entered, self.release))
        self.process.start()
        assert self.entered.wait(WAIT)
        self._freeze_outside_a_transaction(settings)
        leases_expired(settings, users)

    def _freeze_outside_a_transaction(self, settings: Settings) -> None:
        # Frozen inside a transaction (its lease heartbeat's), the process would hold row
        # locks that everyone waits for: a different test. Thawed and frozen again then.
        url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state <> 'idle'"
        )
        deadline = time.monotonic() + WAIT
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                os.kill(self.process.pid or 0, signal.SIGSTOP)
                row = conn.execute(query).fetchone()
                if row and row[0] == 0:
                    return
                os.kill(self.process.pid or 0, signal.SIGCONT)
                assert time.monotonic() < deadline, "the run never left its transaction"
                time.sleep(0.01)

    def wake(self) -> None:
        os.kill(self.process.pid or 0, signal.SIGCONT)
        self.release.set()
        self.process.join(WAIT)
        assert self.process.exitcode == 0

    def stop(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid or 0, signal.SIGKILL)
            self.process.join(WAIT)


def test_a_frozen_chunk_writes_nothing_for_the_users_it_lost(pg_settings: Settings, short_leases: None) -> None:
    for user in USERS:
        seed_group(pg_settings, user)
    frozen = Frozen(pg_settings, USERS)
    try:
        erase_user(pg_settings, "u2", wait_seconds=WAIT)
        # Another run takes u3 over: it prunes and checks, and leaves the group as it is.
        taken = dream_user(pg_settings.model_copy(update={"summarize_interactions": False}), "u3")
        assert taken.status == "succeeded"
        frozen.wake()
    finally:
        frozen.stop()
    nothing_left(pg_settings, "u2")
    chunk_run, other_run = runs_of(pg_settings, "u3")
    assert chunk_run.status == "failed" and "lease" in (chunk_run.error or "")
    never_overlap([chunk_run, other_run])
    assert summarized_by(pg_settings, chunk_run.id) == 0
    # u1's lease ran out too, but nobody took it: the chunk kept it and finished u1.
    (u1_run,) = runs_of(pg_settings, "u1")
    assert u1_run.status == "succeeded" and summarized_by(pg_settings, u1_run.id) == 6


@pytest.mark.parametrize("meanwhile", ["erase", "another-run"])
def test_a_frozen_run_writes_nothing_once_its_lease_is_lost(
    pg_settings: Settings, short_leases: None, meanwhile: str
) -> None:
    seed_group(pg_settings, "u3")
    frozen = Frozen(pg_settings, ["u3"])
    try:
        if meanwhile == "erase":
            erase_user(pg_settings, "u3", wait_seconds=WAIT)
        else:
            taken = dream_user(pg_settings.model_copy(update={"summarize_interactions": False}), "u3")
            assert taken.status == "succeeded"
        frozen.wake()
    finally:
        frozen.stop()
    if meanwhile == "erase":
        nothing_left(pg_settings, "u3")
        return
    first, second = runs_of(pg_settings, "u3")
    assert first.status == "failed" and "lease" in (first.error or "")
    never_overlap([first, second])
    assert summarized_by(pg_settings, first.id) == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_a_run_cut_off_before_its_first_renewal_ends_before_the_run_that_took_over(
    pg_settings: Settings, short_leases: None, monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    # The run's host loses the database right after taking its leases, before any
    # renewal or write lands, and comes back after another run took the user over. Its
    # ledger row must end when its lease ran out, not when the host came back, or it
    # would overlap the run that took the user over.
    real_init, real_renew, real_hold = LeaseKeeper.__init__, LeaseKeeper.renew_all, LeaseKeeper.hold_many
    gate, cut = ThreadGate(), set()

    def init(keeper: LeaseKeeper, *args: Any, **kwargs: Any) -> None:
        real_init(keeper, *args, **kwargs)
        if threading.get_ident() == gate.thread:
            cut.add(id(keeper))

    def unreachable(keeper: LeaseKeeper) -> None:
        if id(keeper) in cut and not gate.release.is_set():
            raise OSError("the database is unreachable")
        real_renew(keeper)

    def away(keeper: LeaseKeeper, session: Any, user_ids: Any) -> list[str]:
        if id(keeper) in cut:
            gate.entered.set()
            assert gate.release.wait(WAIT), "never released"
        return real_hold(keeper, session, user_ids)

    monkeypatch.setattr(LeaseKeeper, "__init__", init)
    monkeypatch.setattr(LeaseKeeper, "renew_all", unreachable)
    monkeypatch.setattr(LeaseKeeper, "hold_many", away)
    seed_group(pg_settings, "u3")
    target = (lambda: dream_users(pg_settings, ["u3"])) if chunked else (lambda: dream_user(pg_settings, "u3"))
    cut_off, results = in_thread(gate, target)
    assert gate.entered.wait(WAIT)  # its first write waits for the network
    leases_expired(pg_settings, ["u3"])
    taken = dream_user(pg_settings.model_copy(update={"summarize_interactions": False}), "u3")
    assert taken.status == "succeeded"
    gate.release.set()
    finished(cut_off, results)
    first, second = runs_of(pg_settings, "u3")
    assert first.status == "failed" and "lease" in (first.error or "")
    never_overlap([first, second])
    assert summarized_by(pg_settings, first.id) == 0


# -- the erasure's own lease ----------------------------------------------------------


def _wait_for_blocked(settings: Settings, statement: str) -> None:
    url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE %s"
    )
    deadline = time.monotonic() + WAIT
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(query, (f"%{statement}%",)).fetchone()
            if row and row[0]:
                return
            assert time.monotonic() < deadline, f"nothing waited on {statement}"
            time.sleep(0.02)


def test_an_erasure_keeps_its_lease_while_it_waits(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(erase, "ERASE_LEASE", TTL)
    seed_group(pg_settings, "ann")
    enqueue_signal("activity", "ann", {"events": [{"action": "x", "at": "2024-05-06T09:00:00Z"}]}, settings=pg_settings)
    url = pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url) as worker:
        # A worker holds ann's signal while it applies it: the erasure waits for it.
        worker.execute(f"SELECT id FROM {Signal.__tablename__} WHERE user_id = 'ann' FOR UPDATE")
        gate = ThreadGate()
        eraser, erased = in_thread(gate, lambda: erase_user(pg_settings, "ann", wait_seconds=WAIT))
        _wait_for_blocked(pg_settings, f"FROM {Signal.__tablename__}")
        time.sleep(4 * TTL.total_seconds())  # a lease not renewed while waiting would be gone
        assert dream_user(pg_settings, "ann").status == "skipped"
        worker.commit()
    finished(eraser, erased)
    nothing_left(pg_settings, "ann")


@pytest.mark.parametrize("path", ["chunk", "one user"])
def test_leases_taken_by_a_commit_whose_reply_was_lost_are_given_back_at_once(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # Before: the runs stayed "running" and the leases held until they ran out (ten
    # minutes by default): the task's retry, and every pass meanwhile, skipped the users.
    from worker.errors import DatabaseUnavailable

    users = ["lost-1", "lost-2"] if path == "chunk" else ["lost-1"]
    for user in users:
        seed_group(pg_settings, user)
    lost = lose_the_reply_of(monkeypatch, dream.runs, "start_runs" if path == "chunk" else "start_run")
    with pytest.raises(DatabaseUnavailable):
        dream_users(pg_settings, users) if path == "chunk" else dream_user(pg_settings, users[0])
    assert lost, "the reply was never lost"
    for user in users:
        [run] = runs_of(pg_settings, user)
        assert (run.status, run.error) == ("failed", "the database went away as the run began"), user
    with session_scope(pg_settings) as session:
        held = session.execute(
            select(dream.locks.UserState.user_id).where(
                dream.locks.UserState.user_id.in_(users), dream.locks.UserState.lock_token.is_not(None)
            )
        ).all()
    assert held == []
    # The task's retry dreams them at once.
    again = dream_users(pg_settings, users) if path == "chunk" else [dream_user(pg_settings, users[0])]
    assert [o.status for o in again] == ["succeeded"] * len(users)


def test_an_erasure_whose_lease_commit_lost_its_reply_gives_the_lease_back_and_erases_on_retry(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.errors import DatabaseUnavailable

    seed_group(pg_settings, "lost-erased")
    lost = lose_the_reply_of(monkeypatch, erase.locks, "take")
    with pytest.raises(DatabaseUnavailable):
        erase_user(pg_settings, "lost-erased", wait_seconds=0)
    assert lost
    # The retry does not wait out the first try's lease (five minutes): it erases at
    # once, and counts only the user's rows (not the schedule row that lease made).
    counts = erase_user(pg_settings, "lost-erased", wait_seconds=0)
    nothing_left(pg_settings, "lost-erased")
    seed_group(pg_settings, "never-lost")
    assert counts == erase_user(pg_settings, "never-lost", wait_seconds=0)


def test_an_erasure_whose_lease_commit_lost_its_reply_keeps_the_schedule_row_a_dream_run_made_meanwhile(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user with no schedule row: a dream run takes them (making the row) just as the
    # erasure goes for the lease, and finishes while the erasure waits; the erasure then
    # takes the lease by a commit whose reply is lost. Giving that lease back must not
    # remove the run's row: the erasure failed, and a failed erasure erases nothing.
    from worker.errors import DatabaseUnavailable

    seed_group(pg_settings, "raced")
    with session_scope(pg_settings) as session:
        before = rows_about(session, pg_settings, "raced")
    take = erase.locks.take
    tries: list[bool] = []

    def a_dream_run_meanwhile(session: Any, user_id: str, token: str, ttl: timedelta) -> Any:
        if not tries:
            with session_scope(pg_settings) as other:
                assert take(other, user_id, "a dream run", timedelta(minutes=5)).made_row
        took = take(session, user_id, token, ttl)
        if not tries:
            with session_scope(pg_settings) as other:
                erase.locks.release(other, user_id, "a dream run")
        tries.append(took.taken)
        return took

    monkeypatch.setattr(erase.locks, "take", a_dream_run_meanwhile)
    lost = lose_the_reply_of(monkeypatch, erase.locks, "take", after=1)
    with pytest.raises(DatabaseUnavailable):
        erase_user(pg_settings, "raced", wait_seconds=30)
    assert tries == [False, True] and len(lost) == 1
    with session_scope(pg_settings) as session:
        row = session.get(UserState, "raced")
        assert row is not None, "the give-back removed the schedule row the dream run made"
        assert row.lock_token is None
        after = rows_about(session, pg_settings, "raced")
    # Nothing else was erased either: the memory rows, and the row the run made.
    assert after == {**before, UserState.__tablename__: 1}
