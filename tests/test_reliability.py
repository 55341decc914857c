"""Process-level reliability: what a worker loses when the processes under it fail.

Each test drives real processes (a ``celery worker`` and beat, the real PostgreSQL, a
throwaway ``redis-server`` of its own) and counts what users rely on: signals sent,
processed, lost and applied twice (and, for dreams, runs started, finished and left
half-done). Each prints its figures and carries them in its assertion messages.

1. The worker is SIGKILLed (its whole process group) at random moments and restarted,
   while signals are enqueued the way producers enqueue them.
2. The broker is stopped while producers keep enqueuing, then started again on the
   same port; the worker is never restarted by hand.
3. The worker's database connections are terminated (``pg_terminate_backend``)
   again and again while users dream and signals are processed.

The default run uses counts that fit CI; ``python -m tests -m slow
tests/test_reliability.py`` runs the full counts.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from store.db import build_engine, closing_transaction
from tests.processes import Db, RedisServer, Service, Wrap, kill_group, session_end_payload
from worker.errors import DatabaseUnavailable
from worker.producer import enqueue_signal
from worker.settings import Settings

pytestmark = pytest.mark.acceptance

USERS = [f"rel-user-{i:02d}" for i in range(40)]
EVENTS_PER_ACTIVITY = 2
PRODUCER_APP = "reliability-producer"


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def db(pg_settings: Settings) -> Iterator[Db]:
    handle = Db(pg_settings.database_url)
    yield handle
    handle.close()


def producer_for(settings: Settings, redis_server: RedisServer) -> Settings:
    """The producer's settings: the test's broker, and sessions named apart from the
    worker's, so that terminating the worker's sessions leaves the producer's alone."""
    url = f"{settings.database_url}?application_name={PRODUCER_APP}"
    return settings.model_copy(update={"broker_url": redis_server.url(), "database_url": url})


def _service(tmp: Path, settings: Settings, redis_server: RedisServer, **env: str) -> Service:
    # Fewer dreams in the signal tests (a changed user is due an hour after the change,
    # or at their slot); a fact a dream merges meanwhile is followed into the archive by tally().
    env.setdefault("REVERIE_DISPATCH_DIRTY_DELAY_SECONDS", "3600")
    # These tests count deliveries, not spend: the full form's 10,000 signals would pass
    # the default day cap, and wait for the next UTC day.
    env.setdefault("REVERIE_MAX_COST_PER_DAY", "1000")
    return Service(tmp, settings.database_url, redis_server.url(), **env)


# -- signals: what a producer sends and what it must find afterwards ------------------------


@dataclass
class Sent:
    """The signals a producer sent, by what their effect must be."""

    # Lists, not dicts: the test thread reads them while the producer appends.
    facts: list[tuple[int, str, int]] = field(default_factory=list)  # (id, user, n)
    activity: list[int] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)
    while_broker_down: int = 0

    @property
    def ids(self) -> list[int]:
        return [*(fact[0] for fact in self.facts), *self.activity, *self.invalid]


class Producer(threading.Thread):
    """Enqueues ``count`` signals, paced over ``seconds``: session ends and activity
    through :func:`enqueue_signal` (row committed, then a wake-up), and every tenth an
    invalid session end by plain SQL, as a foreign producer might write it."""

    def __init__(self, settings: Settings, count: int, seconds: float, *, start: int = 0) -> None:
        super().__init__(daemon=True)
        self.settings = settings
        self.count = count
        self.seconds = seconds
        self.first = start
        self.sent = Sent()
        self.broker_down = threading.Event()
        self.error: BaseException | None = None
        # Numbers for :meth:`burst`'s signals, past those of the paced ones.
        self._extra = (n for n in itertools.count(start + count + 1000) if n % 10 not in (1, 2))

    def run(self) -> None:
        db = Db(self.settings.database_url.split("?")[0])
        began = time.monotonic()
        try:
            for index in range(self.count):
                self._send(db, self.first + index)
                ahead = began + self.seconds * (index + 1) / self.count - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        finally:
            db.close()

    def _send(self, db: Db, n: int) -> None:
        user = USERS[n % len(USERS)]
        if n % 10 == 1:
            signal_id = db.insert_signal("session_end", user, {"conversation_id": f"bad-{n}"})
            self.sent.invalid.append(signal_id)
        elif n % 10 == 2:
            at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=n)
            events = [{"action": f"act-{k}", "at": (at + timedelta(seconds=k)).isoformat()} for k in range(2)]
            signal_id = enqueue_signal("activity", user, {"events": events}, settings=self.settings).signal_id
            self.sent.activity.append(signal_id)
        else:
            signal_id = enqueue_signal("session_end", user, session_end_payload(n), settings=self.settings).signal_id
            self.sent.facts.append((signal_id, user, n))
        if self.broker_down.is_set():
            self.sent.while_broker_down += 1

    def burst(self, count: int) -> None:
        """``count`` more valid session ends at once, from the caller's thread, tallied
        with the paced ones (each for a user who has had signals before)."""
        db = Db(self.settings.database_url.split("?")[0])
        try:
            for _ in range(count):
                self._send(db, next(self._extra))
        finally:
            db.close()

    def finish(self, timeout: float) -> Sent:
        self.join(timeout)
        assert not self.is_alive(), "the producer did not finish"
        if self.error is not None:
            raise AssertionError(f"the producer failed: {self.error!r}") from self.error
        return self.sent


@dataclass
class Tally:
    """Signals sent, and what became of them."""

    sent: int
    done: int
    rejected: int
    lost: int
    applied_twice: int
    statuses: str = ""
    most_attempts: int = 0
    #: Signals claimed more than once: each had an attempt cut short (a killed worker's
    #: batch waits for its lease and is claimed again).
    retried: int = 0

    def __str__(self) -> str:
        return (
            f"sent={self.sent} done={self.done} rejected={self.rejected} lost={self.lost} "
            f"applied_twice={self.applied_twice} statuses={self.statuses} most_attempts={self.most_attempts}"
        )


def tally(db: Db, sent: Sent) -> Tally:
    """Compare each signal's recorded effect with the one it must have had.

    A fact must have been written once (one ``dream_events`` row) into the entry the
    event names, with the transcript's value; the entry is in the memory table, or in
    the archive if a dream merged it since.
    """
    status = dict(db.rows("SELECT id, status FROM dream_signals WHERE id = ANY(%s)", sent.ids))
    events: dict[int, list[tuple[str, str]]] = {}
    for signal_id, entry_id, key in db.rows(
        "SELECT signal_id, entry_id, key FROM dream_events WHERE signal_id = ANY(%s)", sent.ids
    ):
        events.setdefault(signal_id, []).append((entry_id, key))
    entry_ids = [entry_id for written in events.values() for entry_id, _key in written]
    values = dict(db.rows("SELECT id, value FROM usermemories WHERE id = ANY(%s)", entry_ids))
    for entry_id, value in db.rows(
        "SELECT entry_id, row -> 'value' FROM dream_archive WHERE entry_id = ANY(%s) AND run_id IS NOT NULL", entry_ids
    ):
        values.setdefault(entry_id, value)
    activity = dict(
        db.rows("SELECT signal_id, count(*) FROM dream_activity WHERE signal_id = ANY(%s) GROUP BY signal_id", sent.ids)
    )
    duplicate_keys = db.value(
        "SELECT count(*) FROM (SELECT 1 FROM usermemories WHERE visibility <> 'global' "
        "GROUP BY user_id, key, source_agent_id HAVING count(*) > 1) d"
    )
    done = rejected = lost = twice = 0
    for signal_id, _user, n in sent.facts:
        written = events.get(signal_id, [])
        effect = [(key, values.get(entry_id)) for entry_id, key in written]
        done += status.get(signal_id) == "done"
        lost += not (status.get(signal_id) == "done" and effect == [(f"item_{n}_colour", f"shade{n}")])
        twice += len(written) > 1
    for signal_id in sent.activity:
        rows = activity.get(signal_id, 0)
        done += status.get(signal_id) == "done"
        lost += not (status.get(signal_id) == "done" and rows == EVENTS_PER_ACTIVITY)
        twice += rows > EVENTS_PER_ACTIVITY
    for signal_id in sent.invalid:
        rejected += status.get(signal_id) == "rejected"
        lost += status.get(signal_id) != "rejected"
        twice += len(events.get(signal_id, [])) > 0
    by_status = ",".join(f"{k}:{v}" for k, v in sorted(db.statuses(sent.ids).items()))
    most = db.value("SELECT coalesce(max(attempts), 0) FROM dream_signals WHERE id = ANY(%s)", sent.ids)
    retried = db.value("SELECT count(*) FROM dream_signals WHERE id = ANY(%s) AND attempts > 1", sent.ids)
    return Tally(len(sent.ids), done, rejected, lost, twice + duplicate_keys, by_status, int(most), int(retried))


def poll(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return check()


def progress(db: Db, sent: Sent) -> int:
    """How many of the signals sent so far are finished (done or rejected)."""
    counts = db.statuses(sent.ids)
    return counts.get("done", 0) + counts.get("rejected", 0)


def settled(db: Db, sent: Sent) -> bool:
    return progress(db, sent) == len(sent.ids)


def unfinished(db: Db, sent: Sent) -> list[tuple[Any, ...]]:
    """A few of the signals that are neither done nor rejected, for the failure message."""
    return db.rows(
        "SELECT id, kind, status, attempts, claimed_until, available_at, last_error FROM dream_signals "
        "WHERE id = ANY(%s) AND status NOT IN ('done', 'rejected') ORDER BY id LIMIT 5",
        sent.ids,
    )


def report(name: str, **figures: Any) -> str:
    line = f"[reliability] {name}: " + " ".join(f"{k}={v}" for k, v in figures.items())
    print(line)
    return line


# -- 1. the worker is killed --------------------------------------------------------------

WORKER_KILLED = [
    pytest.param(300, 5, 10.0, id="ci"),
    pytest.param(10_000, 20, 120.0, id="full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("count", "kills", "seconds"), WORKER_KILLED)
def test_a_worker_killed_at_random_moments_loses_and_repeats_nothing(
    pg_settings: Settings,
    db: Db,
    redis_server: RedisServer,
    tmp_path: Path,
    count: int,
    kills: int,
    seconds: float,
) -> None:
    producer_settings = producer_for(pg_settings, redis_server)
    service = _service(tmp_path, pg_settings, redis_server)
    rng = random.Random(count * 7919 + kills)
    began = time.monotonic()
    try:
        service.beat()
        worker = service.worker()
        producer = Producer(producer_settings, count, seconds)
        producer.start()
        killed = in_flight = 0
        while killed < kills:
            # A random moment once the worker is up: during its first tasks, mid-batch, idle.
            poll(service.worker_ready, 60)
            time.sleep(rng.uniform(0, 2 * seconds / kills))
            in_flight += progress(db, producer.sent) < len(producer.sent.ids) or producer.is_alive()
            kill_group(worker)
            worker.wait(timeout=10)
            killed += 1
            worker = service.worker()
        killing = time.monotonic() - began
        sent = producer.finish(seconds + 60)
        produced = time.monotonic() - began
        # No wait_until: what is left unfinished must show in the figures, not as a timeout.
        poll(lambda: settled(db, sent), 120 + count / 5)
        wall = time.monotonic() - began
        result = tally(db, sent)
        left = unfinished(db, sent)
    finally:
        service.stop_all()
    line = report(
        "worker_killed",
        **vars(result),
        kills=killed,
        kills_with_work_in_flight=in_flight,
        killing_s=f"{killing:.1f}",
        produced_s=f"{produced:.1f}",
        wall_s=f"{wall:.1f}",
    )
    assert in_flight > 0, f"no kill came while signals were in flight: {line}"
    assert result.lost == 0 and result.applied_twice == 0, f"{line}\nunfinished: {left}"
    assert result.done + result.rejected == result.sent, line


# -- 2. the broker is restarted -----------------------------------------------------------

#: What kombu 5.7 raises when the Redis connection drops while a task's message is
#: unacknowledged (its channel has lost the connection it would restore or ack through).
KOMBU_LOST_CONNECTION = ("Unrecoverable error: AttributeError", "object has no attribute")


@dataclass
class Supervisor:
    """Restarts the worker whenever it has exited, as a supervisor would, and counts the
    exits by cause (``kombu``: the known crash; ``other``: anything else)."""

    service: Service
    worker: Any
    #: The worker's number among the service's (its log is ``worker<number>.log``).
    number: int
    #: How the worker is started (on another host: in its network namespace).
    wrap: Wrap | None = None
    exits: dict[str, int] = field(default_factory=dict)

    def check(self) -> None:
        if self.worker.poll() is None:
            return
        log = (self.service.tmp / f"worker{self.number}.log").read_text(errors="replace")
        why = "kombu" if all(part in log for part in KOMBU_LOST_CONNECTION) else "other"
        self.exits[why] = self.exits.get(why, 0) + 1
        self.worker = self.service.worker(wrap=self.wrap) if self.wrap else self.service.worker()
        self.number = self.service.count

    @property
    def total(self) -> int:
        return sum(self.exits.values())


BROKER_RESTARTED = [
    pytest.param(300, 2, 3.0, 20.0, id="ci"),
    pytest.param(1_000, 20, 2.0, 100.0, id="full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("count", "restarts", "outage", "seconds"), BROKER_RESTARTED)
def test_a_restarted_broker_loses_nothing_and_the_worker_reconnects_by_itself(
    pg_settings: Settings,
    db: Db,
    redis_server: RedisServer,
    tmp_path: Path,
    count: int,
    restarts: int,
    outage: float,
    seconds: float,
) -> None:
    """Producers keep enqueuing while the broker is killed and started again ``restarts``
    times; the worker must ride through every restart on its own (never exit), and every
    signal must take effect exactly once."""
    producer_settings = producer_for(pg_settings, redis_server)
    service = _service(tmp_path, pg_settings, redis_server)
    began = time.monotonic()
    try:
        service.beat()
        supervisor = Supervisor(service, service.worker(), service.count)
        producer = Producer(producer_settings, count, seconds)
        producer.start()
        gap = (seconds - restarts * outage) / (restarts + 1)
        for _ in range(restarts):
            time.sleep(gap)
            supervisor.check()
            redis_server.stop()
            producer.broker_down.set()
            time.sleep(outage)
            redis_server.start()
            producer.broker_down.clear()
        sent = producer.finish(seconds + 60)
        supervisor.check()
        # No wait_until: what is left unfinished must show in the figures, not as a timeout.
        poll(lambda: settled(db, sent), 300 + count / 2)
        supervisor.check()
        wall = time.monotonic() - began
        result = tally(db, sent)
        left = unfinished(db, sent)
    finally:
        service.stop_all()
    exits = ",".join(f"{k}:{v}" for k, v in sorted(supervisor.exits.items())) or "none"
    line = report(
        "broker_restarted",
        **vars(result),
        restarts=restarts,
        outage_s=outage,
        sent_while_down=sent.while_broker_down,
        worker_exits=supervisor.total,
        exit_causes=exits,
        wall_s=f"{wall:.1f}",
    )
    assert sent.while_broker_down > 0, f"nothing was produced while the broker was down: {line}"
    assert result.lost == 0 and result.applied_twice == 0, f"{line}\nunfinished: {left}"
    assert result.done + result.rejected == result.sent, line
    # The worker reconnects by itself: no exit at all, not even one a supervisor would answer.
    assert supervisor.total == 0, f"the worker exited: {line}\n{service.logs()}"


# -- 3. the database connections are killed ------------------------------------------------


class ConnectionKiller(threading.Thread):
    """Terminates every backend of the worker (``application_name = 'reverie'``) in the
    test database at random intervals until stopped."""

    def __init__(self, url: str, rng: random.Random, interval: tuple[float, float]) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.rng = rng
        self.interval = interval
        self.stopped = threading.Event()
        self.rounds = 0
        self.terminated = 0

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stopped.wait(self.rng.uniform(*self.interval)):
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = 'reverie' "
                    "AND pid <> pg_backend_pid()"
                ).fetchone()
                self.rounds += 1
                self.terminated += int(row[0]) if row else 0

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)


def _seed_dreamers(db: Db, users: list[str]) -> set[str]:
    """Per user: stale entries, a contradiction, and a group big enough to summarize.
    Returns the ids of every row seeded."""
    rows: list[tuple[str, str, str, str, int]] = []
    for user in users:
        rows += [(user, f"old_hobby_{k}", f'"kites {k}"', "fact", 200) for k in range(3)]
        rows += [(user, "home_city", '"Lisbon"', "fact", 3), (user, "Home City", '"Porto"', "fact", 2)]
        rows += [(user, f"trip_note_{k}", f'"visited museum {k}"', "context", 1) for k in range(6)]
    ids: set[str] = set()
    with db.conn.cursor() as cur:
        for user, key, value, category, age in rows:
            cur.execute(
                "INSERT INTO usermemories (user_id, key, value, category, source_agent_id, created_at, updated_at) "
                "VALUES (%s, %s, %s, %s, 'agent-a', now() - make_interval(days => %s), "
                "now() - make_interval(days => %s)) RETURNING id",
                (user, key, value, category, age, age),
            )
            fetched = cur.fetchone()
            assert fetched is not None
            ids.add(fetched[0])
    for user in users:
        # Not due yet: the test makes them due once the connections are being killed.
        db.run(
            "INSERT INTO dream_user_state (user_id, next_dream_at) "
            "VALUES (%s, timezone('utc', now()) + interval '1 day')",
            user,
        )
    return ids


def _make_due(db: Db, users: list[str]) -> None:
    db.run(
        "UPDATE dream_user_state SET next_dream_at = timezone('utc', now()) - interval '1 minute' "
        "WHERE user_id = ANY(%s)",
        users,
    )


@dataclass
class DreamTally:
    runs_started: int
    runs_finished: int
    half_done: int
    users_dreamed: int
    archived_and_present: int
    removed_unarchived: int


def dream_tally(db: Db, users: list[str], seeded: set[str]) -> DreamTally:
    statuses = dict(db.rows("SELECT status, count(*) FROM dream_runs GROUP BY status"))
    started = sum(statuses.values())
    finished = statuses.get("succeeded", 0) + statuses.get("failed", 0)
    dreamed = db.value(
        "SELECT count(DISTINCT user_id) FROM dream_runs WHERE status = 'succeeded' AND user_id = ANY(%s)", users
    )
    present = {row[0] for row in db.rows("SELECT id FROM usermemories WHERE user_id = ANY(%s)", users)}
    archived = {
        row[0]
        for row in db.rows("SELECT entry_id FROM dream_archive WHERE restored_at IS NULL AND user_id = ANY(%s)", users)
    }
    written = {
        row[0]
        for row in db.rows(
            "SELECT entry_id FROM dream_events WHERE user_id = ANY(%s) AND action IN ('insert', 'update')", users
        )
    }
    gone = (seeded | written) - present
    return DreamTally(
        runs_started=started,
        runs_finished=finished,
        half_done=started - finished,
        users_dreamed=dreamed,
        archived_and_present=len(archived & present),
        removed_unarchived=len(gone - archived),
    )


def quiet_tally(db: Db, users: list[str], seeded: set[str], timeout: float) -> DreamTally:
    """The first tally within ``timeout`` with no run open, else the last one taken."""
    last = dream_tally(db, users, seeded)
    deadline = time.monotonic() + timeout
    while last.half_done and time.monotonic() < deadline:
        time.sleep(0.5)
        last = dream_tally(db, users, seeded)
    return last


def recovered(db: Db, users: list[str], since: datetime) -> int:
    """Users with a run that started at or after ``since`` and succeeded."""
    return int(
        db.value(
            "SELECT count(DISTINCT user_id) FROM dream_runs WHERE status = 'succeeded' "
            "AND started_at >= %s AND user_id = ANY(%s)",
            since,
            users,
        )
    )


DB_KILLED = [
    pytest.param(30, 300, 20.0, id="ci"),
    pytest.param(300, 3_000, 90.0, id="full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("user_count", "count", "seconds"), DB_KILLED)
def test_killed_database_connections_leave_no_half_done_run_and_lose_no_signal(
    pg_settings: Settings,
    db: Db,
    redis_server: RedisServer,
    tmp_path: Path,
    user_count: int,
    count: int,
    seconds: float,
) -> None:
    users = [f"rel-dreamer-{i:03d}" for i in range(user_count)]
    seeded = _seed_dreamers(db, users)
    per_tick = max(1, round(2 * user_count / seconds))  # every user dispatched within half the window
    producer_settings = producer_for(pg_settings, redis_server)
    service = Service(
        tmp_path,
        pg_settings.database_url,
        redis_server.url(),
        REVERIE_CONTRADICTION_RESOLUTION="keep_newest",
        REVERIE_SUMMARIZE_INTERACTIONS="true",
        REVERIE_LLM_MODEL="offline",
        REVERIE_DISPATCH_DIRTY_DELAY_SECONDS="3600",
        REVERIE_DISPATCH_MAX_USERS=str(per_tick),
        REVERIE_DISPATCH_CHUNK_SIZE=str(per_tick),
    )
    killer = ConnectionKiller(db.url, random.Random(user_count), (0.05, 0.3))
    began = time.monotonic()
    try:
        service.beat()
        service.worker()
        # From the moment the worker is ready, for ``seconds``: kills, signals, and the
        # users' dreams, a few per dispatcher tick, so they run all through the kills.
        poll(service.worker_ready, 120)
        producer = Producer(producer_settings, count, seconds)
        producer.start()
        killer.start()
        _make_due(db, users)
        sent = producer.finish(seconds + 60)
        killer.stop()
        # No wait_until: what is left unfinished must show in the figures, not as a timeout.
        poll(lambda: settled(db, sent), 120 + count / 5)
        # No wait_until here: a run left half-done must show in the figures, not as a timeout.
        # The figures are the tally that showed no run open: a retry may start a run
        # just after it, which is not one left half-done.
        dreams = quiet_tally(db, users, seeded, 120)
        # What a run left half-done shows of itself, for the failure message.
        stuck = db.rows(
            "SELECT r.id, r.started_at, s.locked_until, s.lock_token IS NOT NULL, timezone('utc', now())"
            " FROM dream_runs r LEFT JOIN dream_user_state s ON s.user_id = r.user_id WHERE r.status = 'running'"
        )
        worker_logs = service.logs()
        # Unattended recovery: every user made due again dreams to the end, on the same worker.
        since = db.value("SELECT timezone('utc', now())")
        _make_due(db, users)
        poll(lambda: recovered(db, users, since) == len(users), 120)
        users_recovered = recovered(db, users, since)
        wall = time.monotonic() - began
        result = tally(db, sent)
        left = unfinished(db, sent)
        consistency = dream_tally(db, users, seeded)
        # How often a killed connection cost a signal an attempt or a dream its run.
        retried = db.value("SELECT coalesce(sum(attempts - 1), 0) FROM dream_signals WHERE id = ANY(%s)", sent.ids)
        runs_failed = db.value("SELECT count(*) FROM dream_runs WHERE status = 'failed'")
    finally:
        killer.stop()
        service.stop_all()
    line = report(
        "db_connections_killed",
        **vars(result),
        **vars(dreams) | {k: v for k, v in vars(consistency).items() if k.startswith(("archived", "removed"))},
        runs_failed=runs_failed,
        users_recovered=users_recovered,
        signal_attempts_repeated=retried,
        kill_rounds=killer.rounds,
        backends_terminated=killer.terminated,
        wall_s=f"{wall:.1f}",
    )
    assert killer.terminated > 0, f"no connection was terminated: {line}"
    assert result.lost == 0 and result.applied_twice == 0, f"{line}\nunfinished: {left}"
    assert dreams.half_done == 0, (
        f"runs left running after the worker went idle: {line}\n"
        f"(run, started, lease until, leased, now): {stuck}\n{worker_logs}"
    )
    assert users_recovered == len(users), f"the worker did not recover unattended: {line}\n{service.logs()}"
    assert consistency.archived_and_present == 0 and consistency.removed_unarchived == 0, line


def test_reverie_names_its_database_sessions_and_a_url_can_rename_them(pg_settings: Settings) -> None:
    # How the test above finds the worker's sessions, and how an operator can too.
    for url, name in ((pg_settings.database_url, "reverie"), (f"{pg_settings.database_url}?application_name=x", "x")):
        engine = build_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT current_setting('application_name')")).scalar() == name
        finally:
            engine.dispose()


def test_a_closing_transaction_is_retried_on_a_fresh_connection_when_its_own_is_killed(
    pg_settings: Settings,
) -> None:
    calls: list[int] = []

    def work(session: Session) -> int:
        calls.append(len(calls))
        if len(calls) == 1:
            # The first attempt's connection is terminated under it, as an operator would.
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return int(session.execute(text("SELECT 1")).scalar_one())

    assert closing_transaction(pg_settings, work, pause=0) == 1
    assert len(calls) == 2

    def always_killed(session: Session) -> None:
        calls.append(len(calls))
        session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    calls.clear()
    with pytest.raises(DatabaseUnavailable):
        closing_transaction(pg_settings, always_killed, attempts=3, pause=0)
    assert len(calls) == 3


@pytest.mark.parametrize(
    ("killed_after", "words"),
    [(0, None), (1, None), (0, "could not receive data from server: Connection timed out")],
    ids=["first", "second", "timed out"],
)
def test_a_connection_killed_while_its_session_is_set_up_is_a_lost_connection_tried_again(
    pg_settings: Settings, db: Db, killed_after: int, words: str | None
) -> None:
    # A kill that landed while a new connection's settings (its time zone and guards)
    # were being set once surfaced as a bare driver error ("the connection is lost"),
    # not as the database gone: the chunk's closing transaction was not tried again,
    # and its runs stayed "running" with their leases held for ten minutes.
    import store.db
    from store.db import dispose_engines, session_scope

    killed: list[int] = []
    setting = store.db.apply_session_settings

    def killed_on_the_way(dbapi_connection: Any, values: dict[str, str]) -> None:
        if not killed:
            pid = dbapi_connection.info.backend_pid
            killed.append(pid)
            first = dict(itertools.islice(values.items(), killed_after))
            setting(dbapi_connection, first)  # some are set, then the backend goes
            db.value("SELECT pg_terminate_backend(%s)", pid)
            poll(lambda: not db.value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", pid), 10)
            if words is not None:
                # The driver's words for a lost connection vary (a keepalive's or
                # tcp_user_timeout's timeout, an SSL EOF): none is needed to know it.
                cursor = dbapi_connection.cursor

                class LostInOtherWords:
                    def __init__(self, *args: Any, **kwargs: Any) -> None:
                        self.opened = cursor(*args, **kwargs)

                    def __enter__(self) -> LostInOtherWords:
                        return self

                    def __exit__(self, *exc: object) -> None:
                        self.opened.close()

                    def execute(self, *_: Any, **__: Any) -> None:
                        with contextlib.suppress(psycopg.Error):
                            self.opened.execute("SELECT 1")  # the driver finds the connection gone
                        raise psycopg.OperationalError(words)

                lost_in_other_words = LostInOtherWords
                dbapi_connection.cursor = lost_in_other_words
        setting(dbapi_connection, values)

    dispose_engines()  # no connection pooled: the next is a new one
    with pytest.MonkeyPatch.context() as patch:
        # The engine's listener looks the function up by name at each new connection.
        patch.setattr(store.db, "apply_session_settings", killed_on_the_way)
        done = closing_transaction(pg_settings, lambda session: session.execute(text("SELECT 1")).scalar_one(), pause=0)
    assert done == 1
    assert len(killed) == 1
    # The connection it was tried again on has every setting.
    with session_scope(pg_settings) as session:
        assert session.execute(text("SELECT current_setting('TimeZone')")).scalar_one() == "UTC"


def test_a_closing_transaction_outlasts_a_database_that_drops_connections_for_seconds(
    pg_settings: Settings,
) -> None:
    # Five quick tries (two seconds) were once all it had: a lease left held then stays
    # held for its whole length, many minutes. Now it keeps trying, for a bounded time.
    calls: list[float] = []

    def work(session: Session) -> int:
        calls.append(time.monotonic())
        if len(calls) <= 12:
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return int(session.execute(text("SELECT 1")).scalar_one())

    assert closing_transaction(pg_settings, work, pause=0.05) == 1
    assert len(calls) == 13

    def always_killed(session: Session) -> None:
        calls.append(time.monotonic())
        session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    calls.clear()
    with pytest.raises(DatabaseUnavailable):
        closing_transaction(pg_settings, always_killed, within=1.0, pause=0.1)
    assert calls[-1] - calls[0] <= 1.0
