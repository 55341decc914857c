"""A whole dream run: ledger, per-user exclusion, schedule, and ``reverie run --json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import tasks.dream
from store import locks, schedule
from store.db import dispose_engines, session_scope
from store.models import Profile, Run, UserState
from store.types import now
from tasks.dream import dream_user, dream_users
from tests.dream_seed import entry, keys_of, seed
from worker.errors import DatabaseUnavailable
from worker.settings import Settings

REVERIE = str(Path(sys.executable).with_name("reverie"))
RUN_JSON_KEYS = {
    "users_processed",
    "entries_pruned",
    "contradictions_found",
    "entries_summarized",
    "signals_processed",
    "signals_rejected",
    "signals_failed",
    "cost_usd",
    "run_ids",
}


def test_ledger_records_the_run(pg_settings: Settings) -> None:
    seed(
        pg_settings,
        [
            entry("u1", "old", "x", age_days=200),
            entry("u1", "lang", "en", agent="a"),
            entry("u1", "lang", "de", agent="b"),
        ]
        + [entry("u1", f"n{i}", "note", category="context") for i in range(5)],
    )
    outcome = dream_user(pg_settings, "u1", trigger="manual")
    with session_scope(pg_settings) as session:
        run = session.get(Run, outcome.run_id)
        assert run is not None
        assert (run.user_id, run.scope, run.status, run.error) == ("u1", "user", "succeeded", None)
        assert (run.entries_pruned, run.contradictions_found, run.entries_summarized) == (1, 1, 5)
        assert run.finished_at is not None and run.finished_at >= run.started_at
        assert run.cost_nano > 0 and abs(run.cost_nano / 1e9 - outcome.cost_usd) < 1e-9
        state = session.get(UserState, "u1")
        assert state is not None and state.lock_token is None and state.next_dream_at > now()


def test_a_held_lease_skips_the_user(pg_settings: Settings) -> None:
    seed(pg_settings, [entry("u1", "old", "x", age_days=200)])
    with session_scope(pg_settings) as session:
        assert locks.acquire(session, "u1", "other-worker", timedelta(minutes=5))
    outcome = dream_user(pg_settings, "u1")
    assert outcome.status == "skipped" and outcome.run_id is None
    with session_scope(pg_settings) as session:
        assert not locks.acquire(session, "u1", "third-worker", timedelta(minutes=5))
        locks.release(session, "u1", "other-worker")
    assert dream_user(pg_settings, "u1").entries_pruned == 1


def test_an_expired_lease_is_taken_over(pg_settings: Settings) -> None:
    with session_scope(pg_settings) as session:
        assert locks.acquire(session, "u1", "crashed", timedelta(seconds=-1))
        assert locks.acquire(session, "u1", "next", timedelta(minutes=5))
        assert not locks.renew(session, "u1", "crashed", timedelta(minutes=5))


def test_schedule_due_dirty_and_unseen_users(store_settings: Settings) -> None:
    seed(store_settings, [entry("fresh-host-user", "k", "v")])
    at = now()
    with session_scope(store_settings) as session:
        schedule.mark_dreamed(session, "done", at, at + timedelta(hours=24))
        schedule.mark_dreamed(session, "late", at - timedelta(days=2), at - timedelta(days=1))
        schedule.mark_dreamed(session, "touched", at, at + timedelta(hours=24))
        schedule.mark_dirty(session, store_settings, "touched")
        due = schedule.due_user_ids(session, at + timedelta(seconds=1), limit=10, settings=store_settings)
    assert due == ["fresh-host-user", "late", "touched"]


def test_reverie_run_json_has_the_documented_keys(pg_settings: Settings) -> None:
    seed(pg_settings, [entry("u1", "old", "x", age_days=200), entry("u2", "new", "y")])
    env = {**os.environ, "REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_SUMMARIZE_INTERACTIONS": "false"}
    done = subprocess.run(
        [REVERIE, "run", "--all", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert set(data) >= RUN_JSON_KEYS
    assert (data["users_processed"], data["entries_pruned"]) == (2, 1)
    with session_scope(pg_settings) as session:
        assert sorted(data["run_ids"]) == sorted(session.scalars(select(Run.id)))
        assert data["profiles_built"] == session.scalar(select(func.count()).select_from(Profile)) > 0
    # Again, as a person reads it: nobody's memory changed since, so no profile is rebuilt.
    again = subprocess.run([REVERIE, "run", "--all"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert again.returncode == 0, again.stderr
    assert "2 dreamed" in again.stdout and "; 0 profiles built" in again.stdout, again.stdout


def test_reverie_run_rejects_user_and_all_together(pg_settings: Settings) -> None:
    env = {**os.environ, "REVERIE_DATABASE_URL": pg_settings.database_url}
    done = subprocess.run(
        [REVERIE, "run", "--all", "--user", "u1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "exclude" in done.stderr and "Traceback" not in done.stderr


# -- a chunk of users (the dispatcher's dream.run_users and reverie run) --------------------


def _chunk_world(settings: Settings, users: list[str]) -> None:
    rows = []
    for user_id in users:
        rows += [entry(user_id, "old", "x", age_days=200), entry(user_id, "fresh", "y")]
        rows += [entry(user_id, f"n{i}", "note", category="context") for i in range(5)]
    seed(settings, rows)


def _ledger(settings: Settings, users: list[str]) -> dict[str, tuple[str, int]]:
    with session_scope(settings) as session:
        found = session.scalars(select(Run).where(Run.user_id.in_(users))).all()
        return {run.user_id: (run.status, run.entries_pruned) for run in found}


def _dirty_and_unlocked(settings: Settings, users: list[str]) -> dict[str, tuple[bool, bool]]:
    with session_scope(settings) as session:
        states = session.scalars(select(UserState).where(UserState.user_id.in_(users))).all()
        return {s.user_id: (s.dirty_since is not None, s.lock_token is None) for s in states}


def _break_detection_for(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """Contradiction detection fails on ``bad``'s data: the chunk's (so each user is
    tried on their own) and ``bad``'s own."""

    def broken_for_one(session: Any, settings: Settings, user_id: str, **kwargs: Any) -> Any:
        if user_id == bad:
            raise ValueError("this user's data breaks detection")
        return real_detect(session, settings, user_id, **kwargs)

    def broken_chunk(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the chunk's detection fails on one user's data")

    real_detect = tasks.dream.detect
    monkeypatch.setattr(tasks.dream, "detect", broken_for_one)
    monkeypatch.setattr(tasks.dream, "detect_many", broken_chunk)


def test_a_pass_counts_a_failed_users_run_as_failed_not_processed(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``users_processed`` means what ``dream_users_processed_total`` means: runs that
    # finished without failing; a failed one is counted in ``users_failed`` only.
    from schedules.cron import run_once

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    users = ["p1", "p2-bad", "p3"]
    _chunk_world(settings, users)

    _break_detection_for(monkeypatch, "p2-bad")
    report = run_once(settings, users=users)
    assert (report.users_processed, report.users_failed, report.users_skipped) == (2, 1, 0)
    assert len(report.errors) == 1 and len(report.run_ids) == 3


def test_one_users_failure_in_a_chunk_costs_the_others_nothing(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    users = ["c1", "c2-bad", "c3"]
    _chunk_world(settings, users)

    _break_detection_for(monkeypatch, "c2-bad")

    outcomes = {o.user_id: o.status for o in dream_users(settings, users)}

    assert outcomes == {"c1": "succeeded", "c2-bad": "failed", "c3": "succeeded"}
    assert _ledger(settings, users) == {"c1": ("succeeded", 1), "c2-bad": ("failed", 0), "c3": ("succeeded", 1)}
    # The failing user's work rolled back whole: the stale entry is still there, unarchived.
    assert "old" in keys_of(settings, "c2-bad") and "old" not in keys_of(settings, "c1")
    assert all(unlocked for _, unlocked in _dirty_and_unlocked(settings, users).values())


def test_a_chunk_out_of_time_carries_summarization_to_the_next_pass(pg_settings: Settings) -> None:
    users = ["t1", "t2", "t3"]
    _chunk_world(pg_settings, users)

    outcomes = dream_users(pg_settings, users, budget_seconds=0.0)

    # Everyone was pruned and checked; only the first was summarized, the rest wait.
    assert [o.status for o in outcomes] == ["succeeded"] * 3
    assert [o.entries_pruned for o in outcomes] == [1, 1, 1]
    assert [o.entries_summarized for o in outcomes] == [5, 0, 0]
    assert _dirty_and_unlocked(pg_settings, users) == {"t1": (False, True), "t2": (True, True), "t3": (True, True)}
    assert [o.error for o in outcomes] == [None, tasks.dream.CARRIED, tasks.dream.CARRIED]
    # No model call is needed for them: their profiles are built all the same, the
    # summarized user's from its summaries.
    with session_scope(pg_settings) as session:
        built = session.execute(select(Profile.user_id, Profile.text).where(Profile.agent_id == "agent-a")).all()
    assert sorted(user for user, _ in built) == users
    assert [o.profiles_built > 0 for o in outcomes] == [True, True, True]


def test_the_soft_time_limit_fails_the_current_run_and_carries_the_rest(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Limit(Exception):
        pass

    users = ["s1", "s2", "s3"]
    _chunk_world(pg_settings, users)
    real_summarize = tasks.dream.summarize_user

    def limited(settings: Settings, user_id: str, **kwargs: Any) -> Any:
        if user_id == "s2":
            raise Limit
        return real_summarize(settings, user_id, **kwargs)

    monkeypatch.setattr(tasks.dream, "summarize_user", limited)

    outcomes = {o.user_id: o for o in dream_users(pg_settings, users, interrupts=(Limit,))}

    assert {u: o.status for u, o in outcomes.items()} == {"s1": "succeeded", "s2": "failed", "s3": "succeeded"}
    assert "interrupted" in (outcomes["s2"].error or "")
    assert _ledger(pg_settings, users)["s2"] == ("failed", 1)
    # The interrupted user and those after it are picked up again by the next pass, and
    # so is the one summarized before: the chunk stopped before building its profiles.
    dirty = _dirty_and_unlocked(pg_settings, users)
    assert (dirty["s1"], dirty["s2"], dirty["s3"]) == ((True, True), (True, True), (True, True))
    with session_scope(pg_settings) as session:
        assert session.scalar(select(func.count()).select_from(Profile)) == 0


def test_a_run_that_loses_the_database_is_tried_again_soon_and_a_bug_is_not(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    users = ["d1-gone", "d2-bug", "d3"]
    _chunk_world(pg_settings, users)
    real_summarize = tasks.dream.summarize_user

    def failing(settings: Settings, user_id: str, **kwargs: Any) -> Any:
        if user_id == "d1-gone":
            raise DatabaseUnavailable("postgresql://db/app", "server closed the connection unexpectedly")
        if user_id == "d2-bug":
            raise KeyError("a bug")
        return real_summarize(settings, user_id, **kwargs)

    monkeypatch.setattr(tasks.dream, "summarize_user", failing)

    outcomes = {o.user_id: o.status for o in dream_users(pg_settings, users)}

    assert outcomes == {"d1-gone": "failed", "d2-bug": "failed", "d3": "succeeded"}
    assert _dirty_and_unlocked(pg_settings, users) == {
        "d1-gone": (True, True),
        "d2-bug": (False, True),
        "d3": (False, True),
    }


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_cron_pass_stops_at_its_time_limit_and_leaves_the_rest_due(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, concurrency: int
) -> None:
    from schedules.cron import run_once
    from worker import offline_model

    settings = pg_settings.model_copy(
        update={"cron_time_limit_seconds": 1.0, "dispatch_chunk_size": 1, "cron_concurrency": concurrency}
    )
    users = ["l1", "l2", "l3", "l4"]
    _chunk_world(settings, users)
    real = offline_model.answer

    def slow(purpose: str, task: Any) -> str:
        if purpose == "summarize":
            time.sleep(1.5)
        return real(purpose, task)

    monkeypatch.setattr(offline_model, "answer", slow)

    report = run_once(settings, users=users)

    # The first chunks' summaries (one per thread) outlast the limit: the users after
    # them are left for the next pass.
    assert (report.users_processed, report.users_deferred) == (concurrency, 4 - concurrency)
    assert set(_ledger(settings, users)) == set(users[:concurrency])


def test_a_cron_pass_works_on_several_chunks_at_once_and_dreams_each_user_once(pg_settings: Settings) -> None:
    from schedules.cron import run_once

    settings = pg_settings.model_copy(
        update={"summarize_interactions": False, "dispatch_chunk_size": 2, "cron_concurrency": 3}
    )
    users = [f"k{i:02d}" for i in range(13)]
    _chunk_world(settings, users)
    progress: list[tuple[int, int]] = []

    report = run_once(settings, users=users, on_user=lambda done, total: progress.append((done, total)))

    assert (report.users_processed, report.users_failed, report.users_deferred) == (13, 0, 0)
    assert report.entries_pruned == 13
    with session_scope(settings) as session:
        stored = session.scalar(select(func.count()).select_from(Profile).where(Profile.user_id.in_(users)))
    assert report.profiles_built == stored and stored >= 13  # each user's agent-less one at least
    assert progress == [(n, 13) for n in range(1, 14)]
    assert _ledger(settings, users) == dict.fromkeys(users, ("succeeded", 1))
    with session_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(Run).where(Run.user_id.in_(users))) == 13
    assert set(_dirty_and_unlocked(settings, users).values()) == {(False, True)}


@pytest.mark.parametrize("chunked", [False, True])
def test_the_run_that_takes_a_user_over_closes_the_ledger_row_a_stopped_worker_left_open(
    pg_settings: Settings, chunked: bool
) -> None:
    from store import runs as run_store

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    _chunk_world(settings, ["o1"])
    with session_scope(settings) as session:
        # A worker killed mid-run: its row says running, and its lease ran out.
        left_open = run_store.start_run(session, "o1", trigger="schedule")
    outcome = dream_users(settings, ["o1"])[0] if chunked else dream_user(settings, "o1")
    assert outcome.status == "succeeded"
    with session_scope(settings) as session:
        old, new = session.scalars(select(Run).where(Run.user_id == "o1").order_by(Run.id)).all()
        assert (old.id, old.status, old.error) == (left_open, "failed", run_store.ABANDONED)
        assert old.finished_at is not None and old.finished_at <= new.started_at
        assert new.status == "succeeded"


def test_a_run_killed_outright_is_closed_by_the_next_pass_once_its_lease_lapses(pg_settings: Settings) -> None:
    """A ``reverie run`` SIGKILLed after its prune committed leaves its ledger row
    ``running``; once the lease lapses, the next pass, even one for other users, closes
    it as failed with the rows it archived and what it spent. A live run is left alone."""
    import psycopg

    from store import runs as run_store
    from store.models import ArchivedEntry

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    _chunk_world(settings, ["dead", "other", "live"])
    env = {**os.environ, "REVERIE_DATABASE_URL": settings.database_url, "REVERIE_SUMMARIZE_INTERACTIONS": "false"}
    plain_url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(plain_url) as blocker:
        # The profile step waits on this lock, after the prune has committed: the pass is
        # killed there, with rows archived under a run it never closes.
        blocker.execute("LOCK TABLE dream_profiles IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen([REVERIE, "run", "--user", "dead"], env=env, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            archived = 0
            while not archived and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
                with session_scope(settings) as session:
                    archived = session.scalar(
                        select(func.count()).select_from(ArchivedEntry).where(ArchivedEntry.user_id == "dead")
                    )
            assert archived == 1 and proc.poll() is None
            proc.kill()
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        blocker.rollback()
    with session_scope(settings) as session:
        assert _ledger(settings, ["dead"]) == {"dead": ("running", 0)}
        live_token = "f" * 36
        assert locks.acquire(session, "live", live_token, timedelta(minutes=10))
        live_run = run_store.start_run(session, "live", trigger="cron")
    # Time passes: the killed pass's lease lapses (it renewed it while it lived).
    with session_scope(settings) as session:
        session.execute(
            UserState.__table__.update()
            .where(UserState.user_id == "dead")
            .values(locked_until=now() - timedelta(seconds=1))
        )

    done = subprocess.run(
        [REVERIE, "run", "--user", "other"], capture_output=True, text=True, env=env, timeout=120, check=False
    )

    assert done.returncode == 0, done.stderr
    with session_scope(settings) as session:
        dead = session.scalars(select(Run).where(Run.user_id == "dead")).one()
        assert (dead.status, dead.error, dead.entries_pruned) == ("failed", run_store.LAPSED, 1)
        assert dead.finished_at is not None
        assert session.get(Run, live_run).status == "running"
    assert _ledger(settings, ["other"]) == {"other": ("succeeded", 1)}


def test_the_sweep_closes_runs_whose_lease_lapsed_with_their_spend_and_leaves_held_ones(
    store_settings: Settings,
) -> None:
    from schedules.sweeper import sweep
    from store import runs as run_store
    from store import spend as spend_store
    from store.models import Spend

    settings = store_settings
    _chunk_world(settings, ["gone", "freed", "held"])
    with session_scope(settings) as session:
        assert locks.acquire(session, "gone", "a" * 36, timedelta(minutes=10))
        assert locks.acquire(session, "held", "b" * 36, timedelta(minutes=10))
        gone, freed, held = (run_store.start_run(session, u, trigger="schedule") for u in ("gone", "freed", "held"))
        spend_store.ensure_lines(session, [spend_store.BudgetLine("run", str(gone), 10**9)])
        session.execute(
            Spend.__table__.update()
            .where(Spend.scope == "run", Spend.scope_key == str(gone))
            # Spent, and a reservation its process died in (the reaper later settles it as spent).
            .values(spent_nano=4_600_000, reserved_nano=1_000_000)
        )
        # "gone"'s worker died long enough ago for its lease to lapse; "freed" holds none.
        session.execute(
            UserState.__table__.update()
            .where(UserState.user_id == "gone")
            .values(locked_until=now() - timedelta(seconds=5))
        )

    assert sweep(settings, lambda ids: 0, lambda ids, seconds: ids) == 0

    with session_scope(settings) as session:
        closed = {run.id: run for run in session.scalars(select(Run))}
        assert (closed[gone].status, closed[gone].error, closed[gone].cost_nano) == (
            "failed",
            run_store.LAPSED,
            5_600_000,
        )
        assert (closed[freed].status, closed[freed].cost_nano) == ("failed", 0)
        assert closed[held].status == "running" and closed[held].finished_at is None


def test_sigterm_ends_a_pass_as_ctrl_c_does_closing_its_runs_and_counting_them(
    pg_settings: Settings, tmp_path: Path
) -> None:
    """``timeout``, systemd and Kubernetes end an overrunning pass with SIGTERM: the
    chunks under way finish and close their runs, none starts after, every lease is
    given back, the pass says so and exits 143, and its metrics file counts what it did."""
    import signal

    import psycopg

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    users = [f"t{i}" for i in range(8)]
    _chunk_world(settings, users)
    textfile = tmp_path / "reverie.prom"
    env = {
        **os.environ,
        "REVERIE_DATABASE_URL": settings.database_url,
        "REVERIE_SUMMARIZE_INTERACTIONS": "false",
        "REVERIE_DISPATCH_CHUNK_SIZE": "2",
        "REVERIE_CRON_CONCURRENCY": "2",
    }
    plain_url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(plain_url) as blocker:
        # Both chunks under way wait at their profile step, their prune committed.
        blocker.execute("LOCK TABLE dream_profiles IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen(
            [REVERIE, "run", "--all", "--metrics-textfile", str(textfile)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait_for_runs_under_way(settings, proc, 4)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            # A second one (a supervisor's impatience) does not cut the closing short.
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        finally:
            blocker.rollback()
        try:
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()

    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1].startswith("reverie: error: terminated (SIGTERM)")
    ledger = _ledger(settings, users)
    assert sorted(status for status, _ in ledger.values()) == ["succeeded"] * 4, ledger
    assert set(_dirty_and_unlocked(settings, users).values()) <= {(False, True)}
    with session_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(UserState).where(UserState.lock_token.is_not(None))) == 0
    counted = [line for line in textfile.read_text().splitlines() if line.startswith("dream_users_processed_total ")]
    assert counted == ["dream_users_processed_total 4.0"]


@pytest.mark.parametrize(
    ("chunked", "held_key"), [(False, "old"), (True, "old"), (True, "n0")], ids=["one", "chunk", "chunk-summary"]
)
def test_a_row_the_application_holds_past_lock_timeout_leaves_the_user_to_the_next_pass(
    pg_settings: Settings, chunked: bool, held_key: str
) -> None:
    """With a ``lock_timeout`` set on the database, a user whose row the application
    holds fails its run; they are tried again after the dirty delay, not at their next
    dream a day later, and the chunk's other users are dreamed."""
    import psycopg

    # "old" is pruned (the prune waits on it); "n0" is summarized (the summary's write does).
    settings = pg_settings.model_copy(update={"summarize_interactions": held_key == "n0"})
    _chunk_world(settings, ["held", "free"])
    plain_url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    database = plain_url.rsplit("/", 1)[1]
    with psycopg.connect(plain_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE \"{database}\" SET lock_timeout = '300ms'")
    dispose_engines()
    try:
        with psycopg.connect(plain_url) as application:
            application.execute(
                "SELECT * FROM usermemories WHERE user_id = 'held' AND key = %s FOR UPDATE", (held_key,)
            )
            if chunked:
                outcomes = {o.user_id: o for o in dream_users(settings, ["held", "free"])}
            else:
                outcomes = {"held": dream_user(settings, "held", raise_failure=False)}
            application.rollback()
    finally:
        with psycopg.connect(plain_url, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{database}" RESET lock_timeout')
        dispose_engines()

    assert outcomes["held"].status == "failed" and "LockNotAvailable" in (outcomes["held"].error or "")
    assert _dirty_and_unlocked(settings, ["held"]) == {"held": (True, True)}
    if chunked:
        assert outcomes["free"].status == "succeeded"
        assert _dirty_and_unlocked(settings, ["free"]) == {"free": (False, True)}


def test_sigterm_on_a_pass_working_in_its_own_thread_leaves_every_user_to_the_next_pass(
    pg_settings: Settings,
) -> None:
    """One chunk runs in the pass's own thread, where SIGTERM lands: the work it stopped
    is rolled back, its runs close as failed, and its users are due again after the
    dirty delay, not a day later."""
    import signal

    import psycopg

    settings = pg_settings.model_copy(update={"summarize_interactions": False})
    users = ["m1", "m2", "m3"]
    _chunk_world(settings, users)
    env = {**os.environ, "REVERIE_DATABASE_URL": settings.database_url, "REVERIE_SUMMARIZE_INTERACTIONS": "false"}
    plain_url = settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(plain_url) as blocker:
        # The chunk's prune waits on this lock (it records events) when SIGTERM comes.
        blocker.execute("LOCK TABLE dream_events IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen(
            [REVERIE, "run", "--all"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _wait_for_runs_under_way(settings, proc, 3)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        finally:
            blocker.rollback()
        try:
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()

    assert proc.returncode == 143, stderr
    assert {status for status, _ in _ledger(settings, users).values()} == {"failed"}
    assert _dirty_and_unlocked(settings, users) == dict.fromkeys(users, (True, True))


def _wait_for_runs_under_way(settings: Settings, proc: subprocess.Popen[str], count: int) -> None:
    """Until ``count`` runs are ``running`` while the pass ``proc`` still lives (60 s at most)."""
    deadline = time.monotonic() + 60
    running = 0
    while running < count and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        with session_scope(settings) as session:
            running = session.scalar(select(func.count()).select_from(Run).where(Run.status == "running"))
    assert running == count and proc.poll() is None
