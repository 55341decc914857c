"""Dream races on the real PostgreSQL: runs for one user never overlap, and an entry the
application recalls or updates while a prune is deleting it survives.

The default run takes a few rounds of each; ``-m slow`` runs the long form.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import select, update

from store import entry_state
from store.db import session_scope
from store.memories import table_for
from store.models import ArchivedEntry, EntryState, Run
from store.types import now
from tasks.dream import RunOutcome, dream_user, dream_users
from tests.dream_seed import entry, keys_of, seed
from worker.settings import Settings

STALE_PER_USER = 6
Dream = Callable[[Settings, list[str]], list[RunOutcome]]


def _one_by_one(settings: Settings, users: list[str]) -> list[RunOutcome]:
    return [dream_user(settings, user_id) for user_id in users]


def _chunk(settings: Settings, users: list[str]) -> list[RunOutcome]:
    return dream_users(settings, users, trigger="schedule")


WAYS: dict[str, tuple[Dream, Dream]] = {
    "per-user-vs-per-user": (_one_by_one, _one_by_one),
    "chunk-vs-chunk": (_chunk, _chunk),
    "chunk-vs-per-user": (_chunk, _one_by_one),
}


def _settings(pg_settings: Settings) -> Settings:
    return pg_settings.model_copy(update={"summarize_interactions": False})


def _plain_url(settings: Settings) -> str:
    return settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)


def _seed_users(settings: Settings, users: list[str]) -> set[str]:
    """Each user gets stale entries (to prune), a fresh one and a contradiction; returns
    the ids of the stale entries."""
    rows: list[dict[str, Any]] = []
    for user_id in users:
        rows += [entry(user_id, f"old_{n}", f"v{n}", age_days=200) for n in range(STALE_PER_USER)]
        rows += [entry(user_id, "fresh", "kept"), entry(user_id, "city", "Oslo"), entry(user_id, "City", "Rome")]
    seed(settings, rows)
    return {row["id"] for row in rows if row["key"].startswith("old_")}


def _race_rounds(settings: Settings, first: Dream, second: Dream, rounds: int, users_per_round: int) -> None:
    barrier = threading.Barrier(2)

    def go(dream: Dream, users: list[str]) -> list[RunOutcome]:
        barrier.wait()
        return dream(settings, users)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for round_no in range(rounds):
            users = [f"race-{round_no}-{n}" for n in range(users_per_round)]
            stale = _seed_users(settings, users)
            a = pool.submit(go, first, users)
            b = pool.submit(go, second, list(reversed(users)))
            outcomes = a.result(timeout=120) + b.result(timeout=120)
            assert all(o.status in ("succeeded", "skipped") for o in outcomes), outcomes
            # Every stale entry archived exactly once, by one of the runs, and gone.
            with session_scope(settings) as session:
                archived = Counter(
                    session.scalars(select(ArchivedEntry.entry_id).where(ArchivedEntry.user_id.in_(users)))
                )
                ledger = list(session.scalars(select(Run).where(Run.user_id.in_(users)).order_by(Run.id)))
            assert set(archived) == stale and set(archived.values()) == {1}, archived
            assert sum(o.entries_pruned for o in outcomes) == len(stale)
            assert sum(o.contradictions_found for o in outcomes) == len(users)
            for user_id in users:
                assert keys_of(settings, user_id) == {"fresh", "city", "City"}
                runs = [r for r in ledger if r.user_id == user_id]
                assert 1 <= len(runs) <= 2 and all(r.finished_at is not None for r in runs)
                # Never both at once: a second run starts only after the first finished.
                for before, after in itertools.pairwise(runs):
                    assert before.finished_at is not None and after.started_at >= before.finished_at, runs
                # Exactly one run did the user's work.
                assert sorted(r.entries_pruned for r in runs)[-1] == STALE_PER_USER
                assert sum(r.entries_pruned for r in runs) == STALE_PER_USER


@pytest.mark.parametrize("way", list(WAYS))
def test_two_workers_never_dream_the_same_user_at_once(pg_settings: Settings, way: str) -> None:
    first, second = WAYS[way]
    _race_rounds(_settings(pg_settings), first, second, rounds=6, users_per_round=4)


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
def test_two_workers_never_dream_the_same_user_at_once_long(pg_settings: Settings, way: str) -> None:
    first, second = WAYS[way]
    _race_rounds(_settings(pg_settings), first, second, rounds=50, users_per_round=10)


# -- the application writes an entry while the prune's DELETE waits for its row ------------


@contextmanager
def _app_holds(settings: Settings, entry_id: str, change: str) -> Iterator[psycopg.Connection[Any]]:
    """The application's transaction: it has changed the entry (so holds its row lock)
    and commits when the block ends."""
    statements = {
        "recall": "UPDATE usermemories SET access_count = access_count + 1 WHERE id = %s",
        "update": "UPDATE usermemories SET value = '\"new\"', updated_at = timezone('utc', now()) WHERE id = %s",
    }
    with psycopg.connect(_plain_url(settings)) as conn:
        conn.execute(statements[change], (entry_id,))
        yield conn
        conn.commit()


def _wait_for_blocked_delete(settings: Settings, timeout: float = 30) -> None:
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE '%%DELETE FROM usermemories%%'"
    )
    deadline = time.monotonic() + timeout
    with psycopg.connect(_plain_url(settings), autocommit=True) as conn:
        while True:
            row = conn.execute(query).fetchone()
            if row and row[0]:
                return
            if time.monotonic() > deadline:
                raise AssertionError("the prune never waited for the application's row lock")
            time.sleep(0.01)


def _observed_long_ago(settings: Settings, user_id: str) -> None:
    """Reverie looked at the user's counts a year ago and saw no recall since."""
    long_ago = now().replace(year=now().year - 1)
    table = table_for(settings)
    with session_scope(settings) as session:
        entry_state.observe_recalls(session, table, user_id, long_ago)
        session.execute(update(EntryState).where(EntryState.user_id == user_id).values(last_recalled_at=long_ago))


def _prune_while_app_writes(settings: Settings, *, change: str, counted: bool, chunk: bool) -> None:
    target, other = seed(
        settings,
        [
            entry("u1", "seat", "aisle", age_days=200, access_count=3 if counted else 0),
            entry("u1", "meal", "veg", age_days=200),
        ],
    )
    seed(settings, [entry("u2", "old", "x", age_days=200)])
    if counted:
        # Seen with its count already: stale until the count grows.
        _observed_long_ago(settings, "u1")
    with ThreadPoolExecutor(max_workers=1) as pool, _app_holds(settings, target["id"], change):
        users = ["u1", "u2"]
        running = pool.submit(lambda: _chunk(settings, users) if chunk else [dream_user(settings, "u1")])
        # The prune has read the entry as stale and now waits for the application's lock.
        _wait_for_blocked_delete(settings)
        assert not running.done()
    outcomes = running.result(timeout=60)
    assert outcomes[0].status == "succeeded" and outcomes[0].entries_pruned == 1
    assert keys_of(settings, "u1") == {"seat"}
    with session_scope(settings) as session:
        archived = set(session.scalars(select(ArchivedEntry.entry_id).where(ArchivedEntry.user_id == "u1")))
    assert archived == {other["id"]}
    if chunk:
        assert keys_of(settings, "u2") == set()


@pytest.mark.parametrize("chunk", [False, True], ids=["per-user", "chunk"])
@pytest.mark.parametrize("counted", [False, True], ids=["never-recalled", "recalled-before"])
@pytest.mark.parametrize("change", ["recall", "update"])
def test_entry_written_by_the_application_during_a_prune_survives(
    pg_settings: Settings, change: str, counted: bool, chunk: bool
) -> None:
    _prune_while_app_writes(_settings(pg_settings), change=change, counted=counted, chunk=chunk)


@pytest.mark.slow
def test_entry_written_by_the_application_during_a_prune_survives_long(pg_settings: Settings) -> None:
    settings = _settings(pg_settings)
    for round_no in range(40):
        for change in ("recall", "update"):
            for chunk in (False, True):
                with psycopg.connect(_plain_url(settings), autocommit=True) as conn:
                    conn.execute(
                        "TRUNCATE usermemories, dream_archive, dream_events, dream_entry_state, dream_runs, "
                        "dream_user_state, dream_contradictions CASCADE"
                    )
                _prune_while_app_writes(settings, change=change, counted=bool(round_no % 2), chunk=chunk)
