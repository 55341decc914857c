"""A real Prometheus scrapes the worker with the repository's configuration.

Needs Debian's ``prometheus`` package (``prometheus`` and ``promtool`` on PATH); the
server runs on loopback with a throwaway storage directory and is stopped at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_metrics import ROOT, enqueue_work, free_port, served_metrics
from worker.settings import Settings

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
    assert "SUCCESS: 6 rules found" in result.stdout


def test_promtool_accepts_the_config() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "config", str(OPS / "prometheus.yml")], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_dashboard_charts_every_contract_family() -> None:
    from tests.test_metrics import CONTRACT_FAMILIES

    dashboard = json.loads((OPS / "grafana-dashboard.json").read_text("utf-8"))
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for name in CONTRACT_FAMILIES:
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


def test_prometheus_scrapes_the_worker(pg_settings: Settings, tmp_path: Path) -> None:
    prometheus = tool("prometheus")
    enqueue_work(pg_settings)

    with served_metrics(pg_settings, tmp_path / "mp") as metrics_port:
        # The repository's configuration, pointed at this worker and scraping fast.
        config = yaml.safe_load((OPS / "prometheus.yml").read_text("utf-8"))
        config["global"]["scrape_interval"] = "1s"
        config["global"]["evaluation_interval"] = "1s"
        config["rule_files"] = [str(OPS / "alerts.yml")]
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "reverie"]
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config), "utf-8")

        web_port = free_port()
        log_path = tmp_path / "prometheus.log"
        with (
            log_path.open("w") as log_file,
            subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{web_port}",
                    "--web.enable-lifecycle",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            ) as server,
        ):
            try:
                done, rejected, pending, target = wait_for_scrape(web_port, server, log_path)
            finally:
                server.terminate()
                try:
                    server.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()

    assert target["health"] == "up", target
    assert target["labels"]["job"] == "reverie"
    assert done == 4.0
    assert rejected == 1.0
    assert pending == 1.0


def wait_for_scrape(port: int, server: subprocess.Popen[bytes], log_path: Path) -> tuple[Any, ...]:
    deadline = time.monotonic() + 45
    last_error = ""
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"prometheus exited: {log_path.read_text()[-3000:]}")
        try:
            targets = api(port, "targets")["activeTargets"]
            done = instant(port, 'sum(dream_signals_processed_total{job="reverie",outcome="done"})')
            rejected = instant(port, 'sum(dream_signals_processed_total{job="reverie",outcome="rejected"})')
            pending = instant(port, 'sum(dream_signals_pending{job="reverie"})')
            up = instant(port, 'up{job="reverie"}')
        except OSError as exc:
            last_error = str(exc)
            time.sleep(0.3)
            continue
        if targets and up == 1.0 and done is not None and pending is not None:
            return done, rejected, pending, targets[0]
        last_error = f"targets={targets} up={up} done={done}"
        time.sleep(0.3)
    pytest.fail(f"prometheus never scraped the worker ({last_error}): {log_path.read_text()[-2000:]}")
