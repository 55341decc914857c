"""Erasure while the user's work is in flight (real PostgreSQL, worker threads).

Afterwards nothing of the user remains in the memory table or any ``dream_`` table; a
signal enqueued before the erasure never brings a memory back, however late it is
processed; a signal enqueued after it is processed as usual (docs/reference.md, Signals). The
interleavings are pinned with events where the order matters (a worker blocked inside
its model call, a dream run blocked inside summarization); a randomized version runs
many rounds of workers, erasures and new signals at once.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select

from store.db import dispose_engines, session_scope
from store.erase import rows_about
from store.memories import table_for
from store.models import Signal
from store.types import now
from tasks import activity
from tasks.activity import detect_routines
from tasks.dream import dream_user
from tasks.erase import erase_user
from tasks.signals import process_pending
from worker import offline_model
from worker.errors import UserBusy
from worker.producer import enqueue_signal
from worker.settings import Settings

ROUNDS = 12
#: Generous: the first model call of a process imports the gateway, slow on a busy machine.
WAIT = 120
SLOW_ROUNDS = 150


def said(text: str, conversation: str = "c1") -> dict[str, Any]:
    return {"conversation_id": conversation, "agent_id": "a", "messages": [{"role": "user", "content": text}]}


class ModelGate:
    """Blocks the offline model's answer for chosen purposes until released."""

    def __init__(self, purposes: tuple[str, ...], jitter: float = 0.0) -> None:
        self.purposes = purposes
        self.jitter = jitter
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self._answer = offline_model.answer

    def __call__(self, purpose: str, task: Any) -> str:
        if purpose in self.purposes:
            self.calls += 1
            self.entered.set()
            if self.jitter:
                time.sleep(random.uniform(0, self.jitter))
            else:
                assert self.release.wait(WAIT), "never released"
        return self._answer(purpose, task)


@pytest.fixture()
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ModelGate]]:
    made: list[ModelGate] = []

    def install(*purposes: str, jitter: float = 0.0) -> ModelGate:
        g = ModelGate(purposes, jitter)
        monkeypatch.setattr(offline_model, "answer", g)
        made.append(g)
        return g

    yield install
    for g in made:
        g.release.set()


def nothing_left(settings: Settings, user: str) -> None:
    with session_scope(settings) as session:
        left = {table: n for table, n in rows_about(session, settings, user).items() if n}
    assert left == {}


def values_of(settings: Settings, user: str) -> set[str]:
    table = table_for(settings)
    with session_scope(settings) as session:
        return {str(r.value) for r in session.execute(select(table.c.value).where(table.c.user_id == user))}


def start(target: Callable[..., Any], *args: Any, **kwargs: Any) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target(*args, **kwargs)
        except BaseException as exc:  # surfaced by join()
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def join(thread: threading.Thread) -> None:
    thread.join(WAIT)
    assert not thread.is_alive(), "thread did not finish"
    errors: list[BaseException] = thread.errors  # type: ignore[attr-defined]
    if errors:
        raise errors[0]


def test_erasure_mid_model_call_writes_nothing_and_late_signals_stay_dropped(
    pg_settings: Settings, gate: Callable[..., ModelGate]
) -> None:
    g = gate("extract_facts")
    enqueue_signal("session_end", "ann", said("My favorite color is blue"), settings=pg_settings)
    enqueue_signal("session_end", "ben", said("My favorite color is teal"), settings=pg_settings)
    worker = start(process_pending, pg_settings, limit=1)  # claims ann's signal, blocks in the model
    assert g.entered.wait(WAIT)
    # Enqueued before the erasure, still pending: must never take effect.
    enqueue_signal("session_end", "ann", said("My dog is Rex", "c2"), settings=pg_settings)
    erase_user(pg_settings, "ann", wait_seconds=5)
    nothing_left(pg_settings, "ann")
    # Enqueued after the erasure: processed as usual.
    enqueue_signal("session_end", "ann", said("My favorite color is green", "c3"), settings=pg_settings)
    g.release.set()
    join(worker)
    report = process_pending(pg_settings)
    assert report.processed == 2  # ben's and ann's new one
    assert values_of(pg_settings, "ann") == {"green"}
    assert values_of(pg_settings, "ben") == {"teal"}
    with session_scope(pg_settings) as session:
        statuses = [s.status for s in session.scalars(select(Signal).where(Signal.user_id == "ann"))]
    assert statuses == ["done"]


def test_erasure_between_two_workers_in_flight(pg_settings: Settings, gate: Callable[..., ModelGate]) -> None:
    g = gate("extract_facts", "feedback")
    long = "Thanks for asking. " + "The report covers revenue, costs and the outlook for every region. " * 4
    enqueue_signal("session_end", "ann", said("My name is Ann"), settings=pg_settings)
    feedback = {"deliverable_id": "d", "original": long, "edited": "Short."}
    enqueue_signal("feedback", "ann", feedback, settings=pg_settings)
    enqueue_signal("activity", "ann", {"events": [{"action": "x", "at": "2024-05-06T09:00:00Z"}]}, settings=pg_settings)
    workers = [start(process_pending, pg_settings, limit=1) for _ in range(2)]
    assert g.entered.wait(WAIT)
    time.sleep(0.2)  # let the second worker claim the other signal
    erase_user(pg_settings, "ann", wait_seconds=5)
    g.release.set()
    for w in workers:
        join(w)
    process_pending(pg_settings)
    nothing_left(pg_settings, "ann")


def _worker_process(settings: Settings, entered: Any, release: Any) -> None:
    """A worker in a process of its own: claims one signal, blocks inside the model call."""

    real = offline_model.answer

    def gated(purpose: str, task: Any) -> str:
        entered.set()
        release.wait(WAIT)
        return real(purpose, task)

    offline_model.answer = gated  # type: ignore[assignment]  # this process only
    process_pending(settings, limit=1)


def test_erasure_while_worker_processes_hold_the_users_signals(pg_settings: Settings) -> None:
    # Forked, not spawned: the children start with the model gateway already imported
    # (seconds of imports each otherwise) and with no database connection of ours.
    offline_model.build_handler()
    dispose_engines()
    context = multiprocessing.get_context("fork")
    for i in range(2):
        enqueue_signal("session_end", "ann", said(f"My code {i} is before{i}", f"c{i}"), settings=pg_settings)
    release = context.Event()
    entered = [context.Event() for _ in range(2)]
    workers = [context.Process(target=_worker_process, args=(pg_settings, e, release)) for e in entered]
    for w in workers:
        w.start()
    try:
        assert all(e.wait(WAIT) for e in entered)  # both signals claimed, both mid-model-call
        erase_user(pg_settings, "ann", wait_seconds=5)
        nothing_left(pg_settings, "ann")
        enqueue_signal("session_end", "ann", said("My code word is after", "c9"), settings=pg_settings)
    finally:
        release.set()
        for w in workers:
            w.join(WAIT)
    assert [w.exitcode for w in workers] == [0, 0]
    assert process_pending(pg_settings).processed == 1
    assert values_of(pg_settings, "ann") == {"after"}


def seed_group(settings: Settings, user: str, n: int = 6) -> None:
    table = table_for(settings)
    with session_scope(settings) as session:
        for i in range(n):
            session.execute(
                table.insert().values(
                    id=f"{user}-note-{i}",
                    user_id=user,
                    key=f"trip_note_{i}",
                    value=f"note {i}",
                    category="fact",
                    source_agent_id="a",
                )
            )


def test_erasure_waits_for_a_dream_run_in_progress_and_nothing_survives_it(
    pg_settings: Settings, gate: Callable[..., ModelGate]
) -> None:
    g = gate("summarize")
    seed_group(pg_settings, "ann")
    seed_group(pg_settings, "ben")
    run = start(dream_user, pg_settings, "ann")
    assert g.entered.wait(WAIT)  # the run holds ann's lease and is inside the model call
    eraser = start(erase_user, pg_settings, "ann", wait_seconds=30)
    time.sleep(0.5)
    assert eraser.is_alive()  # waits for the run rather than erasing under it
    g.release.set()
    join(run)
    join(eraser)
    nothing_left(pg_settings, "ann")
    with session_scope(pg_settings) as session:
        assert sum(rows_about(session, pg_settings, "ben").values()) == 6


def test_erasure_gives_up_when_a_run_holds_the_user_too_long(
    pg_settings: Settings, gate: Callable[..., ModelGate]
) -> None:
    g = gate("summarize")
    seed_group(pg_settings, "ann")
    run = start(dream_user, pg_settings, "ann")
    assert g.entered.wait(WAIT)
    with pytest.raises(UserBusy):
        erase_user(pg_settings, "ann", wait_seconds=0.3)
    g.release.set()
    join(run)
    assert values_of(pg_settings, "ann") != set()  # nothing was erased: the caller retries
    erase_user(pg_settings, "ann", wait_seconds=5)
    nothing_left(pg_settings, "ann")


def test_erasure_during_routine_detection_leaves_no_routine_behind(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = now().replace(hour=9, minute=0, second=0, microsecond=0)
    weekly = [{"action": "digest", "at": (base - timedelta(days=7 * w)).isoformat()} for w in range(1, 6)]
    enqueue_signal("activity", "ann", {"events": weekly}, settings=pg_settings)
    enqueue_signal("activity", "ben", {"events": weekly}, settings=pg_settings)
    process_pending(pg_settings)
    entered, release = threading.Event(), threading.Event()
    real = activity.routines_for

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(activity, "routines_for", held)
    detector = start(detect_routines, pg_settings)  # has read ann's events, not yet written
    assert entered.wait(WAIT)
    # Nothing of ann is being written yet: the erasure need not wait for the detection.
    erase_user(pg_settings, "ann", wait_seconds=5)
    release.set()
    join(detector)
    nothing_left(pg_settings, "ann")
    assert values_of(pg_settings, "ben") != set()  # ben's routine was written


def test_erasure_waiting_for_routine_detection_never_holds_up_other_users_activity(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = now().replace(hour=9, minute=0, second=0, microsecond=0)
    weekly = [{"action": "digest", "at": (base - timedelta(days=7 * w)).isoformat()} for w in range(1, 6)]
    enqueue_signal("activity", "ann", {"events": weekly}, settings=pg_settings)
    enqueue_signal("activity", "ben", {"events": weekly}, settings=pg_settings)
    process_pending(pg_settings)
    entered, release = threading.Event(), threading.Event()
    real = activity.schedule.mark_dirty

    class HeldSchedule:
        """The detection's last step: every routine written, its transaction still open."""

        @staticmethod
        def mark_dirty(session: Any, settings: Settings, user_id: str) -> None:
            entered.set()
            assert release.wait(WAIT)
            real(session, settings, user_id)

    monkeypatch.setattr(activity, "schedule", HeldSchedule)
    detector = start(detect_routines, pg_settings)
    assert entered.wait(WAIT)
    eraser = start(erase_user, pg_settings, "ann", wait_seconds=WAIT)
    waiting_on_a_lock(pg_settings)  # the erasure waits for the detection writing ann's routine
    url = pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url) as producer:
        producer.execute("SET statement_timeout = '3s'")
        producer.execute(
            "INSERT INTO dream_activity (user_id, agent_id, action, at) "
            "VALUES ('ben', 'a', 'digest', timezone('utc', now()))"
        )
        producer.commit()
    assert eraser.is_alive()
    release.set()
    join(detector)
    join(eraser)
    nothing_left(pg_settings, "ann")
    assert values_of(pg_settings, "ben") != set()
    with session_scope(pg_settings) as session:
        assert rows_about(session, pg_settings, "ben")["dream_activity"] == 6


def waiting_on_a_lock(settings: Settings) -> None:
    url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    deadline = time.monotonic() + WAIT
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(query).fetchone()
            if row and row[0]:
                return
            assert time.monotonic() < deadline, "the erasure never waited"
            time.sleep(0.02)


def one_round(settings: Settings, rng: random.Random, round_no: int) -> None:
    victim, other = f"victim-{round_no}", f"other-{round_no}"
    before = [f"before{round_no}x{i}" for i in range(rng.randint(1, 6))]
    for i, word in enumerate(before):
        enqueue_signal("session_end", victim, said(f"My code {i} is {word}", f"b{i}"), settings=settings)
        enqueue_signal("session_end", other, said(f"My code {i} is {word}", f"b{i}"), settings=settings)
    if rng.random() < 0.5:
        seed_group(settings, victim)
    workers = [start(process_pending, settings, limit=rng.randint(1, 8)) for _ in range(rng.randint(1, 3))]
    dream = start(dream_user, settings, victim) if rng.random() < 0.4 else None
    time.sleep(rng.uniform(0, 0.15))
    erase_user(settings, victim, wait_seconds=30)
    if dream is not None:
        join(dream)  # started before the erasure: the erasure waited for it or it found the user gone
    nothing_left_but_runs = {}
    with session_scope(settings) as session:
        nothing_left_but_runs = {t: n for t, n in rows_about(session, settings, victim).items() if n}
    # A dream run the thread started only after the erasure may leave its own ledger
    # and schedule rows (a run after the erasure is a new run); never any memory.
    assert set(nothing_left_but_runs) <= {"dream_runs", "dream_user_state"}, nothing_left_but_runs
    after = f"after{round_no}"
    enqueue_signal("session_end", victim, said(f"My code word is {after}", "after"), settings=settings)
    for w in workers:
        join(w)
    process_pending(settings)
    assert values_of(settings, victim) == {after}
    assert values_of(settings, other) == set(before)
    with session_scope(settings) as session:
        left = rows_about(session, settings, victim)
        statuses = [s.status for s in session.scalars(select(Signal).where(Signal.user_id == victim))]
    assert statuses == ["done"]
    assert left["dream_archive"] == 0 and left["dream_observations"] == 0 and left["dream_contradictions"] == 0


def run_rounds(settings: Settings, rounds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(20261123)
    real = offline_model.answer

    def jittery(purpose: str, task: Any) -> str:
        time.sleep(rng.uniform(0, 0.03))
        return real(purpose, task)

    monkeypatch.setattr(offline_model, "answer", jittery)
    for round_no in range(rounds):
        one_round(settings, rng, round_no)


def test_randomized_erasures_among_workers(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    run_rounds(pg_settings, ROUNDS, monkeypatch)


@pytest.mark.slow
def test_randomized_erasures_among_workers_long(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    run_rounds(pg_settings, SLOW_ROUNDS, monkeypatch)


def test_an_erasure_during_a_restores_profile_rebuild_leaves_no_profile(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `reverie restore` rebuilds the profiles of the users it restored, outside any
    # dream: an erasure landing while that rebuild builds the text waits for it, and
    # then removes what it wrote (it wrote the erased user's profile back).
    from store.models import Profile
    from tasks import profiles
    from tasks.dream import rebuild_profiles
    from tests.dream_seed import entry, seed

    seed(pg_settings, [entry("u1", "home_city", "Lisbon", visibility="global", agent=None)])
    composing, erased = threading.Event(), threading.Event()
    compose = profiles.compose

    def slow_compose(*args: Any, **kwargs: Any) -> Any:
        composing.set()
        erased.wait(3)  # the erasure may not finish meanwhile: it waits for the lease
        return compose(*args, **kwargs)

    monkeypatch.setattr(profiles, "compose", slow_compose)
    result: dict[str, Any] = {}

    def erase() -> None:
        if composing.wait(WAIT):
            result.update(erase_user(pg_settings, "u1", wait_seconds=WAIT))
        erased.set()

    eraser = threading.Thread(target=erase)
    eraser.start()
    built, left = rebuild_profiles(pg_settings, ["u1"])
    eraser.join(WAIT)
    assert not eraser.is_alive() and erased.is_set()
    assert (built, left) == (1, []) and result["dream_profiles"] == 1
    with session_scope(pg_settings) as session:
        assert session.scalar(select(func.count()).select_from(Profile)) == 0
        assert not {table: n for table, n in rows_about(session, pg_settings, "u1").items() if n}


def test_an_erasure_while_a_restore_writes_erases_what_the_restore_put_back(pg_settings: Settings) -> None:
    # A restore has put a pruned entry back and not yet committed when an erasure of the
    # user starts: the erasure waits for it, then deletes what it put back. (It once
    # deleted around the rows it could not see, and the restore brought the user back.)
    from store.archive import restore_run
    from tests.dream_seed import entry, seed

    seed(
        pg_settings,
        [entry("e2", "old_hobby", "chess", age_days=200), entry("e2", "home_city", "Lisbon", age_days=1)],
    )
    outcome = dream_user(pg_settings, "e2")
    assert outcome.entries_pruned == 1 and outcome.run_id is not None
    restored, commit = threading.Event(), threading.Event()

    def restore() -> None:
        with session_scope(pg_settings) as session:
            assert restore_run(session, table_for(pg_settings), outcome.run_id).restored
            restored.set()
            commit.wait(WAIT)

    restorer = threading.Thread(target=restore)
    restorer.start()
    assert restored.wait(WAIT)
    result: dict[str, Any] = {}
    eraser = threading.Thread(target=lambda: result.update(erase_user(pg_settings, "e2", wait_seconds=WAIT)))
    eraser.start()
    time.sleep(2)  # the erasure is under way, and waits (or, as it once did, deletes around the restore)
    commit.set()
    restorer.join(WAIT)
    eraser.join(WAIT)
    assert not restorer.is_alive() and not eraser.is_alive()
    assert result["usermemories"] == 2
    with session_scope(pg_settings) as session:
        assert not {table: n for table, n in rows_about(session, pg_settings, "e2").items() if n}


def test_a_restores_profile_rebuild_leaves_a_user_a_dream_holds_to_that_dream(pg_settings: Settings) -> None:
    from store import locks, schedule
    from store.types import db_now
    from tasks.dream import lease_ttl, rebuild_profiles
    from tests.dream_seed import entry, seed

    seed(pg_settings, [entry("u1", "home_city", "Lisbon", visibility="global", agent=None)])
    with session_scope(pg_settings) as session:
        started = db_now(session)
        assert locks.acquire(session, "u1", "a-dream", lease_ttl(pg_settings))
    assert rebuild_profiles(pg_settings, ["u1"]) == (0, ["u1"])
    # The dream may have read the rows before the restore: when it ends, the user stays
    # marked, and is due again after the dirty delay (not at the next slot, a day away).
    with session_scope(pg_settings) as session:
        schedule.mark_dreamed_many(session, {"u1": started + timedelta(days=1)}, started)
        locks.release(session, "u1", "a-dream")
    with session_scope(pg_settings) as session:
        later = db_now(session) + timedelta(seconds=pg_settings.dispatch_dirty_delay_seconds + 1)
        assert schedule.due_user_ids(session, later, 10, pg_settings) == ["u1"]


def test_a_restores_profile_rebuild_and_a_dream_past_its_lease_wait_on_each_other_in_one_order(
    pg_settings: Settings,
) -> None:
    # A dream whose lease ran out is inside its prune transaction (a recall recorded, the
    # user's profile marked for a rebuild) when a restore's rebuild takes the expired
    # lease. The rebuild locked the lease's row, then the profile's; the prune the other
    # way round: one of them died of a deadlock (the restore's command with a traceback).
    from store import policies as policy_store
    from store.types import db_now
    from tasks.dream import rebuild_profiles
    from tasks.leases import LeaseKeeper
    from tasks.prune import prune_user
    from tests.dream_seed import entry, seed
    from worker.policy import book

    seed(pg_settings, [entry("u1", f"k{i}", f"v{i}", age_days=1) for i in range(3)])
    assert dream_user(pg_settings, "u1").status == "succeeded"
    url = pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE usermemories SET access_count = 3 WHERE key = 'k1'")  # a recall by the host
        conn.execute(
            "UPDATE dream_user_state SET lock_token = 'a-dream', "
            "locked_until = timezone('utc', now()) - interval '1 second'"
        )
    marked = threading.Event()
    out: dict[str, Any] = {}

    def dreaming() -> None:
        try:
            keeper = LeaseKeeper(pg_settings, "a-dream", timedelta(minutes=10), ["u1"])
            with session_scope(pg_settings) as session:
                policies = book(pg_settings, policy_store.all_configs(session))
                prune_user(session, pg_settings, "u1", book=policies, owners=None, at=db_now(session), run_id=None)
                marked.set()
                time.sleep(1.5)  # the rebuild reaches the profile's row meanwhile
                out["held"] = keeper.hold_many(session, ["u1"])
        except Exception as exc:
            out["dream"] = type(exc).__name__
        finally:
            marked.set()

    def restoring() -> None:
        marked.wait(WAIT)
        try:
            out["rebuilt"] = rebuild_profiles(pg_settings, ["u1"])
        except Exception as exc:
            out["restore"] = type(exc).__name__

    threads = [threading.Thread(target=dreaming), threading.Thread(target=restoring)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert out == {"held": [], "rebuilt": (2, [])}
