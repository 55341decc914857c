"""A whole dream run: ledger, per-user exclusion, schedule, and ``reverie run --json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from store import locks, schedule
from store.db import session_scope
from store.models import Run, UserState
from store.types import now
from tasks.dream import dream_user
from tests.dream_seed import entry, seed
from worker.settings import Settings

REVERIE = str(Path(sys.executable).with_name("reverie"))
CONTRACT_KEYS = {
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
        schedule.mark_dirty(session, "touched")
        due = schedule.due_user_ids(session, at + timedelta(seconds=1), limit=10, settings=store_settings)
    assert due == ["fresh-host-user", "late", "touched"]


def test_reverie_run_json_has_the_contract_keys(pg_settings: Settings) -> None:
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
    assert set(data) >= CONTRACT_KEYS
    assert (data["users_processed"], data["entries_pruned"]) == (2, 1)
    with session_scope(pg_settings) as session:
        assert sorted(data["run_ids"]) == sorted(session.scalars(select(Run.id)))


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
