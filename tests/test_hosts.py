"""Reverie across hosts: each host a Linux network namespace on a bridge.

One ``db`` host runs a PostgreSQL and a ``redis-server`` of the test's own, bound to
its address; two worker hosts each run ``reverie worker``, a ``beat`` host runs
``reverie beat``; the test process (the producers, the tallies) sits on the bridge as
another machine would. What is shown, with real processes and real network cuts:

1. A vanished host's open transaction does not hold its row locks for hours: the
   server ends its session (idle in a transaction, or silent), another host takes the
   lease over, and the vanished host's commit, once it is back, is refused.
2. One worker host is cut off from the network mid-transaction while signals flow and
   users dream, stays away past every lease, and comes back: every signal is applied
   once, nothing is lost, and no two runs of one user overlap.
3. The dream sweep over two worker hosts does the same work as over one, no user
   twice; the wall time of each is reported.

Needs root and iproute2 (network namespaces); skipped, saying why, without them.
``python -m tests -m slow tests/test_hosts.py`` runs the long form.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from store import locks
from store.db import dispose_engines, session_scope
from store.migrate import upgrade
from tests import netns
from tests.processes import Db, RedisServer, Service, kill_group
from tests.test_reliability import (
    Producer,
    Supervisor,
    _make_due,
    _seed_dreamers,
    dream_tally,
    poll,
    report,
    settled,
    tally,
    unfinished,
)
from worker.settings import Settings

WHY_NOT = netns.unavailable()
if WHY_NOT is not None:
    print(f"[hosts] skipped: {WHY_NOT}")
pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-host tests: {WHY_NOT}"),
]

WORKERS = ("w1", "w2")
#: Short leases and guards, so a cut-off host is "away past the leases" in seconds.
SHORT = {
    "REVERIE_SIGNAL_LEASE_SECONDS": "5",
    "REVERIE_DREAM_LEASE_SECONDS": "4",
    "REVERIE_DATABASE_IDLE_IN_TRANSACTION_SECONDS": "4",
    "REVERIE_DATABASE_KEEPALIVE_SECONDS": "2",
}
AWAY_SECONDS = 15.0  # past every lease and guard above, with room to take over


@dataclass
class Cluster:
    network: netns.Network
    hosts: dict[str, netns.Host]
    postgres: netns.Postgres
    redis: RedisServer
    databases: Iterator[int]

    def fresh_database(self) -> Settings:
        """A new, migrated database on the db host; settings for the test process."""
        name = f"hosts_{next(self.databases)}"
        with self.postgres.admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        settings = Settings(_env_file=None, database_url=self.postgres.url(name), broker_url=self.redis.url())
        upgrade(settings)
        dispose_engines()
        return settings


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("hosts")
    with netns.hosts("db", *WORKERS, "beat") as (network, hosts):
        postgres = netns.Postgres(hosts["db"], network.subnet)
        redis = RedisServer(tmp, bind=hosts["db"].address, wrap=hosts["db"].argv)
        try:
            redis.start()
            yield Cluster(network, hosts, postgres, redis, itertools.count(1))
        finally:
            dispose_engines()
            redis.stop()
            postgres.stop()


def backends_of(db: Db, host: netns.Host) -> dict[str, int]:
    """The host's sessions on the server, by state (``idle in transaction``...)."""
    rows = db.rows(
        "SELECT state, count(*) FROM pg_stat_activity WHERE client_addr = %s::inet GROUP BY state", host.address
    )
    return {str(state): int(n) for state, n in rows}


def overlapping_runs(db: Db) -> int:
    """Pairs of runs of one user whose intervals overlap (an unfinished run never ends)."""
    return int(
        db.value(
            "SELECT count(*) FROM dream_runs a JOIN dream_runs b ON a.user_id = b.user_id AND a.id < b.id "
            "WHERE a.started_at < coalesce(b.finished_at, 'infinity') "
            "AND b.started_at < coalesce(a.finished_at, 'infinity')"
        )
    )


# -- 1. a vanished host's transaction ----------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from sqlalchemy import text
    from store import locks
    from store.db import session_scope
    from worker.settings import Settings

    url, idle, keepalive = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    settings = Settings(_env_file=None, database_url=url, broker_url="",
                        database_idle_in_transaction_seconds=idle, database_keepalive_seconds=keepalive)
    ttl = timedelta(seconds=2)
    with session_scope(settings) as session:
        assert locks.acquire(session, "u1", "host-a", ttl)
    try:
        with session_scope(settings) as session:
            # A run's write transaction: it re-takes its lease (locking the row), writes, and
            # would commit, but its host is cut off before it can.
            assert locks.renew_many(session, ["u1"], "host-a", ttl)
            session.execute(text("INSERT INTO usermemories (user_id, key, value) VALUES ('u1', 'late', '\\"x\\"')"))
            print("held", flush=True)
            sys.stdin.readline()
        print("committed", flush=True)
    except Exception as exc:
        print("refused", type(exc).__name__, flush=True)
    """
)


@pytest.mark.parametrize(("idle", "keepalive"), [(2.0, 0.0), (0.0, 1.0)], ids=["idle-in-transaction", "keepalive"])
def test_a_vanished_hosts_transaction_is_ended_and_its_late_commit_refused(
    cluster: Cluster, idle: float, keepalive: float
) -> None:
    settings = cluster.fresh_database()
    host = cluster.hosts["w1"]
    db = Db(settings.database_url)
    holder = subprocess.Popen(
        host.argv([sys.executable, "-c", HOLDER, settings.database_url, str(idle), str(keepalive)]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        line = holder.stdout.readline().decode()
        assert line.strip() == "held", line + holder.stdout.read().decode()
        host.cut()
        cut = time.monotonic()
        # Another host wants the user once the lease has run out: it must not wait for TCP.
        taken_after = None
        while time.monotonic() - cut < 30:
            try:
                with session_scope(settings) as session:
                    session.execute(text("SET LOCAL lock_timeout = '500ms'"))
                    if locks.acquire(session, "u1", "host-b", timedelta(minutes=5)):
                        taken_after = time.monotonic() - cut
                        break
            except OperationalError:
                pass  # the row is still locked by the vanished host's transaction
            time.sleep(0.2)
        left = backends_of(db, host)
        host.restore()
        holder.stdin.write(b"go\n")
        holder.stdin.flush()
        said = holder.stdout.read().decode().strip()
        holder.wait(timeout=60)
    finally:
        host.restore()
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    late = db.value("SELECT count(*) FROM usermemories WHERE key = 'late'")
    owner = db.value("SELECT lock_token FROM dream_user_state WHERE user_id = 'u1'")
    db.close()
    line = report(
        "vanished_transaction",
        guard="idle" if idle else "keepalive",
        lease_taken_over_after_s=None if taken_after is None else f"{taken_after:.1f}",
        sessions_left=left,
        returning_host=said,
        late_rows=late,
    )
    assert taken_after is not None, f"the lease stayed locked by the vanished host: {line}"
    assert left == {}, f"the server kept the vanished host's sessions: {line}"
    assert said.startswith("refused") and late == 0 and owner == "host-b", line


# -- 2. a worker host cut off mid-transaction, away past the leases ------------------------


def _in_transaction(db: Db, host: netns.Host, *, waiting: bool = False) -> int:
    """The host's sessions inside a transaction that has written (and, with
    ``waiting``, now waits for a row lock)."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE client_addr = %s::inet AND backend_xid IS NOT NULL"
    if waiting:
        query += " AND wait_event_type = 'Lock'"
    return int(db.value(query, host.address))


def _cut_mid_transaction(db: Db, host: netns.Host, more_work: Callable[[], None], tries: int = 10) -> tuple[int, int]:
    """Cut ``host`` off while it has a writing transaction open; (transactions it left
    open, tries). The test holds every schedule row for a moment, so the host's next
    write that touches one (a signal marking its user changed, a run re-taking its
    lease) waits, mid-transaction, until the host is cut; then the rows are let go and
    its transaction runs on to its end, where it waits for a COMMIT that cannot come.
    While the rows are held no user is dispatched, so each try first calls
    ``more_work`` (signals for users who have a schedule row): the paced producer alone
    may be done, or its signals all taken by the other host, before a try catches one."""
    for attempt in range(1, tries + 1):
        with psycopg.connect(db.url, connect_timeout=5) as blocker:
            blocker.execute("SELECT user_id FROM dream_user_state FOR UPDATE")
            more_work()
            caught = poll(lambda: _in_transaction(db, host, waiting=True) > 0, 10)
            if caught:
                host.cut()
            blocker.rollback()
        if caught:
            return _in_transaction(db, host), attempt
    return 0, tries


CUT_OFF = [
    pytest.param(80, 6, 12.0, id="ci"),
    pytest.param(600, 30, 60.0, id="full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("count", "user_count", "seconds"), CUT_OFF)
def test_a_worker_host_cut_off_past_its_leases_loses_and_repeats_nothing(
    cluster: Cluster, tmp_path: Path, count: int, user_count: int, seconds: float
) -> None:
    settings = cluster.fresh_database()
    db = Db(settings.database_url)
    users = [f"host-dreamer-{i:03d}" for i in range(user_count)]
    seeded = _seed_dreamers(db, users)
    w1, w2, beat = cluster.hosts["w1"], cluster.hosts["w2"], cluster.hosts["beat"]
    service = Service(
        tmp_path,
        settings.database_url,
        cluster.redis.url(),
        REVERIE_CONTRADICTION_RESOLUTION="keep_newest",
        REVERIE_LLM_MODEL="offline",
        # Users come due again every few seconds, so the other host takes over the users
        # of the cut-off one while it is away.
        REVERIE_DREAM_INTERVAL_HOURS=str(6 / 3600),
        REVERIE_DISPATCH_DIRTY_DELAY_SECONDS="3600",
        REVERIE_DISPATCH_CHUNK_SIZE="3",
        **SHORT,
    )
    began = time.monotonic()
    try:
        beat_proc = service.beat(wrap=beat.argv)
        worker1 = service.worker(wrap=w1.argv)
        worker2 = service.worker(wrap=w2.argv)
        assert poll(lambda: service.worker_ready(1) and service.worker_ready(2), 120), service.logs()
        producer = Producer(settings, count, seconds)
        producer.start()
        _make_due(db, users)
        time.sleep(seconds / 4)
        cut_open, tries = _cut_mid_transaction(db, w1, lambda: producer.burst(6))
        cut_at = time.monotonic()
        at_cut = backends_of(db, w1)
        poll(lambda: backends_of(db, w1) == {}, AWAY_SECONDS)
        sessions_ended_s = time.monotonic() - cut_at
        left_after = backends_of(db, w1)
        time.sleep(max(0.0, AWAY_SECONDS - (time.monotonic() - cut_at)))
        taken_over = db.value(
            "SELECT count(*) FROM dream_signals WHERE attempts > 1 AND id = ANY(%s)", producer.sent.ids
        )
        w1.restore()
        sent = producer.finish(seconds + 120)
        supervisor = Supervisor(service, worker1, 1, wrap=w1.argv)
        supervisor.check()
        supervised = ",".join(f"{why}:{n}" for why, n in sorted(supervisor.exits.items())) or "none"
        # Generous: on a loaded machine the backlog drains slowly; what is left
        # unfinished at the end still shows in the figures, as lost.
        poll(lambda: settled(db, sent), 120 + count)
        poll(lambda: dream_tally(db, users, seeded).users_dreamed == len(users), 60)
        # No more dispatching, and the workers stop as an operator stops them: what they
        # run ends, and nothing starts after it (a dispatcher tick or a chunk queued before
        # the beat stopped starts runs after it). A run still running then was left half-done.
        kill_group(beat_proc)
        dispatch_stopped = db.value("SELECT timezone('utc', now())")
        stopped = [service.stop_warm(proc) for proc in (supervisor.worker, worker2)]
        wall = time.monotonic() - began
        result = tally(db, sent)
        left = unfinished(db, sent)
        dreams = dream_tally(db, users, seeded)
        overlaps = overlapping_runs(db)
        lost_leases = db.value("SELECT count(*) FROM dream_runs WHERE status = 'failed' AND error LIKE '%%lease%%'")
        started_after = db.value("SELECT count(*) FROM dream_runs WHERE started_at > %s", dispatch_stopped)
        stuck = db.rows("SELECT id, user_id, started_at, trigger FROM dream_runs WHERE status = 'running'")
        worker_logs = service.logs()
    finally:
        w1.restore()
        service.stop_all()
        db.close()
    line = report(
        "host_cut_off",
        **vars(result),
        **vars(dreams),
        overlapping_runs=overlaps,
        runs_that_lost_their_lease=lost_leases,
        signals_taken_over=taken_over,
        open_transactions_at_cut=cut_open,
        cut_tries=tries,
        sessions_at_cut=at_cut,
        sessions_ended_after_s=f"{sessions_ended_s:.1f}",
        away_s=AWAY_SECONDS,
        w1_exit=supervised,
        workers_stopped=stopped,
        runs_started_after_dispatch_stopped=started_after,
        wall_s=f"{wall:.1f}",
    )
    assert cut_open > 0, f"w1 was never cut off mid-transaction: {line}"
    assert left_after == {}, f"the server kept the cut-off host's sessions: {line}"
    assert result.lost == 0 and result.applied_twice == 0, f"{line}\nunfinished: {left}"
    assert result.done + result.rejected == result.sent, line
    assert all(stopped), f"a worker did not finish its tasks and stop: {line}\n{worker_logs}"
    assert dreams.half_done == 0 and overlaps == 0, f"{line}\n(run, user, started, trigger): {stuck}\n{worker_logs}"
    assert dreams.archived_and_present == 0 and dreams.removed_unarchived == 0, line
    assert dreams.users_dreamed == len(users), line


# -- 3. the dream sweep over one host and over two ---------------------------------------


def _sweep(db: Db, users: list[str], seeded: set[str], timeout: float) -> float:
    began = time.monotonic()
    _make_due(db, users)
    poll(lambda: dream_tally(db, users, seeded).users_dreamed == len(users), timeout)
    poll(lambda: dream_tally(db, users, seeded).half_done == 0, 30)
    return time.monotonic() - began


def _outcome(db: Db, users: list[str]) -> tuple[Any, ...]:
    """What the sweep left: the memory table's rows and the archive, by content."""
    memory = db.rows(
        "SELECT user_id, key, value::text, category, conflicted FROM usermemories "
        "WHERE user_id = ANY(%s) ORDER BY 1, 2, 3",
        users,
    )
    archived = db.rows(
        "SELECT user_id, row ->> 'key', reason FROM dream_archive WHERE user_id = ANY(%s) ORDER BY 1, 2, 3", users
    )
    return tuple(memory), tuple(archived)


SWEEP = [
    pytest.param(24, id="ci"),
    pytest.param(300, id="full", marks=pytest.mark.slow),
]


def _start_over(db: Db, users: list[str]) -> set[str]:
    """Empty every table (the schema stays) and seed the same users again."""
    tables = [r[0] for r in db.rows("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
    tables = [t for t in tables if t != "dream_alembic_version"]
    db.run(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(sql.SQL(", ").join(map(sql.Identifier, tables))))
    return _seed_dreamers(db, users)


@pytest.mark.parametrize("user_count", SWEEP)
def test_the_dream_sweep_over_two_hosts_does_the_same_work_as_over_one(
    cluster: Cluster, tmp_path: Path, user_count: int
) -> None:
    users = [f"sweep-{i:04d}" for i in range(user_count)]
    figures: dict[int, dict[str, Any]] = {}
    outcomes: dict[int, tuple[Any, ...]] = {}
    settings = cluster.fresh_database()
    db = Db(settings.database_url)
    service = Service(
        tmp_path,
        settings.database_url,
        cluster.redis.url(),
        REVERIE_CONTRADICTION_RESOLUTION="keep_newest",
        REVERIE_LLM_MODEL="offline",
        REVERIE_DISPATCH_CHUNK_SIZE="10",
        REVERIE_DISPATCH_DIRTY_DELAY_SECONDS="3600",
    )
    try:
        for host_count in (1, 2):
            # The same start each time: the same users and rows, nothing dreamed yet.
            seeded = _start_over(db, users)
            service.worker(wrap=cluster.hosts[WORKERS[host_count - 1]].argv)
            assert poll(lambda: all(service.worker_ready(n + 1) for n in range(host_count)), 120), service.logs()
            beat_proc = service.beat(wrap=cluster.hosts["beat"].argv)
            assert poll(lambda: "Starting..." in (service.tmp / "beat.log").read_text(errors="replace"), 60)
            wall = _sweep(db, users, seeded, 60 + user_count)
            kill_group(beat_proc)
            beat_proc.wait(timeout=10)
            dreams = dream_tally(db, users, seeded)
            twice = db.value(
                "SELECT count(*) FROM (SELECT user_id FROM dream_runs GROUP BY user_id HAVING count(*) > 1) t"
            )
            outcomes[host_count] = _outcome(db, users)
            figures[host_count] = {"wall_s": f"{wall:.1f}", "users_done_twice": twice, **vars(dreams)}
    finally:
        service.stop_all()
        db.close()
    line = report(
        "sweep",
        users=user_count,
        **{f"{k}_{n}host": v for n, f in figures.items() for k, v in f.items()},
        same_outcome=outcomes[1] == outcomes[2],
    )
    for host_count in (1, 2):
        assert figures[host_count]["users_dreamed"] == user_count, line
        assert figures[host_count]["users_done_twice"] == 0 and figures[host_count]["half_done"] == 0, line
    assert outcomes[1] == outcomes[2], line
