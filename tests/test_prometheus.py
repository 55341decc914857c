"""A real Prometheus scrapes the worker with the repository's configuration.

Needs Debian's ``prometheus`` package (``prometheus`` and ``promtool`` on PATH). The
end-to-end test starts a real ``celery -A worker.app worker`` against the run's
PostgreSQL database and a Redis database number of its own, has it process signals
and a dream, then starts the real Prometheus on loopback (throwaway storage) with the
repository's scrape configuration and reads the result back through its HTTP API.
Every process is killed at the end, also on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis as redis_lib
import yaml

from tests.test_metrics import ROOT, free_port
from worker.settings import Settings
from worker.wakeup import publish, wake_signals

OPS = ROOT / "ops"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found: install Debian's `prometheus` package (apt-get install -y prometheus)")
    return path


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(OPS / "alerts.yml")], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


def test_the_stale_gauges_alert_fires_when_the_gauges_stop_being_read(tmp_path: Path) -> None:
    """Prometheus's own rule evaluation (``promtool test rules``) over two workers' pages:
    one whose queue gauges are read every 15 s (beat and the broker up), and the same
    after the reads stop (a broker outage): the alert fires only for the second."""
    tests = {
        "rule_files": [str(OPS / "alerts.yml")],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                # Read every 15 s: the timestamp keeps up with the clock.
                "input_series": [
                    {"series": 'dream_signals_gauges_read_timestamp_seconds{job="reverie"}', "values": "0+15x40"}
                ],
                "alert_rule_test": [{"eval_time": "9m", "alertname": "ReverieQueueGaugesStale", "exp_alerts": []}],
            },
            {
                "interval": "15s",
                # Read until 2 min, then never again (the page still answers, the value frozen).
                "input_series": [
                    {"series": 'dream_signals_gauges_read_timestamp_seconds{job="reverie"}', "values": "0+15x8 120x32"}
                ],
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": "ReverieQueueGaugesStale", "exp_alerts": []},
                    {
                        "eval_time": "6m",
                        "alertname": "ReverieQueueGaugesStale",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning"},
                                "exp_annotations": {
                                    "summary": "The signal queue gauges have not been read for more than 2 minutes",
                                    "description": "The gauges (and the alerts on pending and dead signals) are 4m "
                                    "0s old: beat, the broker or the database is not reaching the workers.",
                                    "runbook": "ops/RUNBOOK.md#reveriequeuegaugesstale",
                                },
                            }
                        ],
                    },
                ],
            },
        ],
    }
    path = tmp_path / "stale.test.yml"
    path.write_text(yaml.safe_dump(tests), "utf-8")
    result = subprocess.run([tool("promtool"), "test", "rules", str(path)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_config() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "config", str(OPS / "prometheus.yml")], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_dashboard_charts_every_documented_family() -> None:
    from tests.test_metrics import DOCUMENTED_FAMILIES

    dashboard = json.loads((OPS / "grafana-dashboard.json").read_text("utf-8"))
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for name in DOCUMENTED_FAMILIES:
        assert name in exprs, f"no panel charts {name}"


def test_runbook_has_a_section_per_alert() -> None:
    rules = yaml.safe_load((OPS / "alerts.yml").read_text("utf-8"))["groups"][0]["rules"]
    runbook = (OPS / "RUNBOOK.md").read_text("utf-8")
    for rule in rules:
        assert f"### {rule['alert']}" in runbook
        assert rule["annotations"]["runbook"].endswith("#" + rule["alert"].lower())


def api(port: int, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}?{query}", timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def instant(port: int, expr: str) -> float | None:
    result = api(port, "query", query=expr)["result"]
    return float(result[0]["value"][1]) if result else None


REDIS_DB_URL = os.environ.get("REVERIE_TEST_PROMETHEUS_REDIS_URL", "redis://127.0.0.1:6379/13")
SLEEPER = "prom-sleeper"
SIGNAL_USERS = ["prom-user-0", "prom-user-1", "prom-user-2"]


class Processes:
    """Subprocesses in their own process groups, logs in files, all killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # The child keeps its own copy of the descriptor; ours is closed at once.
        with (self.tmp / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv, cwd=self.tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log"))


@pytest.fixture()
def processes(tmp_path: Path) -> Iterator[Processes]:
    client = redis_lib.Redis.from_url(REDIS_DB_URL, socket_connect_timeout=3)
    client.flushdb()
    running = Processes(tmp_path)
    try:
        yield running
    finally:
        running.stop_all()
        client.flushdb()
        client.close()


def insert_work(conn: psycopg.Connection[Any]) -> list[int]:
    """Three session ends, one malformed feedback and a user with a stale memory, by
    plain SQL as a producer in another language would write them."""
    ids = []
    for n, user in enumerate(SIGNAL_USERS):
        payload = {"conversation_id": f"c-{n}", "messages": [{"role": "user", "content": f"my color is blue {n}"}]}
        row = conn.execute(
            "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('session_end', %s, %s) RETURNING id",
            (user, json.dumps(payload)),
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    row = conn.execute(
        "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('feedback', %s, %s) RETURNING id",
        (SIGNAL_USERS[0], json.dumps({"deliverable_id": "d"})),
    ).fetchone()
    assert row is not None
    ids.append(row[0])
    conn.execute(
        "INSERT INTO usermemories (user_id, key, value, category, created_at, updated_at) VALUES "
        "(%s, 'old_hobby', '\"kites\"', 'fact', now() - interval '200 days', now() - interval '200 days')",
        (SLEEPER,),
    )
    return ids


def wait_until(what: str, check: Callable[[], bool], timeout: float, processes: Processes) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        for proc in processes.procs:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args!r} exited ({proc.returncode}) while waiting until {what}\n{processes.logs()}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting until {what}\n{processes.logs()}")


def test_prometheus_scrapes_a_real_worker(pg_settings: Settings, processes: Processes, tmp_path: Path) -> None:
    prometheus = tool("prometheus")
    metrics_port = free_port()
    env = {
        **os.environ,
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_BROKER_URL": REDIS_DB_URL,
        "REVERIE_METRICS_PORT": str(metrics_port),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics-worker"),
        "REVERIE_LOG_FORMAT": "json",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    argv = [sys.executable, "-m", "celery", "-A", "worker.app", "worker"]
    argv += ["-Q", "signals,dreams,housekeeping", "-c", "2", "-n", "prom-worker@%h", "--loglevel", "INFO"]
    argv += ["--without-gossip", "--without-mingle"]
    processes.start("worker", argv, env)

    # The work, by plain SQL; the wake-ups as the producer and the dispatcher send them.
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
        ids = insert_work(conn)
        broker = Settings(_env_file=None, database_url=pg_settings.database_url, broker_url=REDIS_DB_URL)
        assert wake_signals(broker, ids) == len(ids)
        assert publish(broker, "dream.run_user", [[SLEEPER]]) == 1

        def statuses() -> dict[str, int]:
            rows = conn.execute(
                "SELECT status, count(*) FROM dream_signals WHERE id = ANY(%s) GROUP BY status", (ids,)
            ).fetchall()
            return {status: count for status, count in rows}

        wait_until("the signals are processed", lambda: statuses() == {"done": 3, "rejected": 1}, 30, processes)
        wait_until(
            "the user has dreamed",
            lambda: bool(
                conn.execute(
                    "SELECT 1 FROM dream_runs WHERE user_id = %s AND status = 'succeeded'", (SLEEPER,)
                ).fetchall()
            ),
            20,
            processes,
        )

    # The repository's configuration, pointed at this worker and scraping fast.
    config = yaml.safe_load((OPS / "prometheus.yml").read_text("utf-8"))
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(OPS / "alerts.yml")]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "reverie"]
    # The stack finds its workers by name; here the one worker is on loopback.
    job.pop("dns_sd_configs")
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config), "utf-8")

    web_port = free_port()
    server = processes.start(
        "prometheus",
        [
            prometheus,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            "--web.enable-lifecycle",
        ],
        dict(os.environ),
    )
    done, rejected, users, target = wait_for_scrape(web_port, server, processes)

    assert target["health"] == "up", target
    assert target["labels"]["job"] == "reverie"
    # The queue gauges were read from the database (at start, then on beat's schedule).
    read_ago = instant(web_port, 'time() - max(dream_signals_gauges_read_timestamp_seconds{job="reverie"})')
    assert read_ago is not None and 0 <= read_ago < 120, read_ago
    assert done == 3.0
    assert rejected == 1.0
    assert users == 1.0


def wait_for_scrape(port: int, server: subprocess.Popen[bytes], processes: Processes) -> tuple[Any, ...]:
    deadline = time.monotonic() + 30
    last_error = ""
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"prometheus exited: {processes.logs()}")
        try:
            targets = api(port, "targets")["activeTargets"]
            done = instant(port, 'sum(dream_signals_processed_total{job="reverie",outcome="done"})')
            rejected = instant(port, 'sum(dream_signals_processed_total{job="reverie",outcome="rejected"})')
            users = instant(port, 'sum(dream_users_processed_total{job="reverie"})')
            up = instant(port, 'up{job="reverie"}')
        except OSError as exc:
            last_error = str(exc)
            time.sleep(0.3)
            continue
        # The targets page is read before the queries: a scrape that lands between
        # them leaves it "unknown" while `up` already reads 1, so wait for both.
        if targets and targets[0]["health"] == "up" and up == 1.0 and done is not None and users is not None:
            return done, rejected, users, targets[0]
        last_error = f"targets={targets} up={up} done={done} users={users}"
        time.sleep(0.3)
    pytest.fail(f"prometheus never scraped the worker ({last_error}): {processes.logs()}")


def _gauge(port: int, name: str, kind: str) -> float | None:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in page.splitlines():
        if line.startswith(f'{name}{{kind="{kind}"}} '):
            return float(line.split()[-1])
    return None


def test_each_worker_of_the_split_layout_keeps_its_queue_gauges_fresh(
    pg_settings: Settings, processes: Processes, tmp_path: Path
) -> None:
    # As deployed: one worker takes the signals, another the dreams and housekeeping,
    # each serving its own page, and beat. A dead signal retried and done must leave
    # both pages' dead gauge (the alert fires on any of them), not only the page of the
    # worker that runs housekeeping: the signals worker once kept its start-up values.
    url = pg_settings.database_url.replace("+psycopg", "")
    with psycopg.connect(url, autocommit=True) as conn:
        (signal_id,) = conn.execute(
            "INSERT INTO dream_signals (kind, user_id, payload, status, attempts, last_error) VALUES "
            "('activity', 'u1', '{\"events\": []}', 'dead', 5, 'out of attempts') RETURNING id"
        ).fetchone() or (None,)
    ports = {"signals": free_port(), "dreams,housekeeping": free_port()}
    base = {
        **os.environ,
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_BROKER_URL": REDIS_DB_URL,
        "REVERIE_LOG_FORMAT": "json",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    for index, (queues, port) in enumerate(ports.items()):
        env = {**base, "REVERIE_METRICS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / f"m{index}")}
        argv = [sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q", queues, "-c", "1"]
        argv += ["-n", f"split{index}@%h", "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
        processes.start(f"worker-{index}", argv, env)
    beat = [sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-s", str(tmp_path / "beat-state")]
    processes.start("beat", [*beat, "--loglevel", "INFO"], base)

    def dead_on(port: int) -> float | None:
        try:
            return _gauge(port, "dream_signals_dead", "activity")
        except OSError:
            return None

    wait_until(
        "both pages count the dead signal", lambda: all(dead_on(p) == 1.0 for p in ports.values()), 60, processes
    )
    with psycopg.connect(url, autocommit=True) as conn:
        # What `reverie signals retry` and a worker's run of it come to.
        conn.execute("UPDATE dream_signals SET status = 'done' WHERE id = %s", (signal_id,))
    # Beat refreshes the gauges every 15 s, on each queue.
    wait_until("both pages count none", lambda: all(dead_on(p) == 0.0 for p in ports.values()), 45, processes)
