"""docker-compose.yml, checked without a Docker engine: the services exist, start in
order, run commands the CLI accepts, and agree with the settings and the scrape config."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from worker.cli import app
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"postgres", "redis", "migrate", "worker", "dreamer", "beat", "prometheus"}
#: The two workers, and the queues each consumes.
WORKERS = {"worker": {"signals"}, "dreamer": {"dreams", "housekeeping"}}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def _parse_reverie(argv: list[str]) -> Any:
    """Parse a `reverie ...` command line as the CLI would, without running it."""
    assert argv[0] == "reverie"
    group = typer.main.get_command(app)
    root = group.make_context("reverie", [argv[1]])
    command = group.get_command(root, argv[1])  # type: ignore[attr-defined]
    assert command is not None, argv
    # Raises a usage error for an option or argument the command does not take.
    return command.make_context(argv[1], list(argv[2:]), parent=root)


def test_the_stack_has_every_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES


def test_redis_never_evicts_and_keeps_an_append_only_file(compose: dict[str, Any]) -> None:
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert command[command.index("--appendonly") + 1] == "yes"


@pytest.mark.parametrize("service", ["migrate", "worker", "dreamer", "beat"])
def test_service_commands_are_real_reverie_invocations(compose: dict[str, Any], service: str) -> None:
    argv = compose["services"][service]["command"]
    context = _parse_reverie(argv)
    assert context.info_name == {"migrate": "migrate", "worker": "worker", "dreamer": "worker", "beat": "beat"}[service]
    if service in WORKERS:
        assert set(context.params["queues"].split(",")) == WORKERS[service]


def test_every_queue_is_consumed_and_signals_never_wait_behind_dream_runs(compose: dict[str, Any]) -> None:
    # A dream chunk runs for tens of seconds: a worker that took signals and dreams kept
    # signals waiting as long behind one. Every queue the tasks are routed to is consumed.
    from worker.app import DREAMS_QUEUE, QUEUES, ROUTES, SIGNALS_QUEUE

    consumed: dict[str, set[str]] = {}
    for name, service in compose["services"].items():
        argv = service.get("command") or []
        if argv[:2] == ["reverie", "worker"]:
            consumed[name] = set(_parse_reverie(argv).params["queues"].split(","))
    assert set().union(*consumed.values()) == set(QUEUES) >= {route["queue"] for route in ROUTES.values()}
    for name, queues in consumed.items():
        assert not {SIGNALS_QUEUE, DREAMS_QUEUE} <= queues, name


def _health_commands(compose: dict[str, Any], service: str) -> list[list[str]]:
    test = compose["services"][service]["healthcheck"]["test"]
    if test[0] == "CMD":
        return [test[1:]]
    assert test[0] == "CMD-SHELL", test
    return [part.split() for part in test[1].split("&&")]


@pytest.mark.parametrize("service", sorted(WORKERS))
def test_the_worker_healthcheck_checks_the_database_the_broker_metrics_and_a_ping(
    compose: dict[str, Any], service: str
) -> None:
    commands = _health_commands(compose, service)
    health = _parse_reverie(commands[0])
    assert health.info_name == "health"
    assert health.params["broker"] and health.params["metrics"]
    assert commands[1][:6] == ["celery", "-A", "worker.app", "inspect", "ping", "--destination"]


def test_beat_has_a_healthcheck_that_checks_the_database_and_the_broker(compose: dict[str, Any]) -> None:
    (command,) = _health_commands(compose, "beat")
    health = _parse_reverie(command)
    assert health.info_name == "health" and health.params["broker"]


def test_workers_can_be_scaled_and_are_all_scraped(compose: dict[str, Any]) -> None:
    port = Settings.model_fields["metrics_port"].default
    for name in WORKERS:
        worker = compose["services"][name]
        assert "ports" not in worker  # a fixed host port would block --scale worker=3
        assert str(port) in worker["expose"]
    scrape = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "reverie"]
    assert job["dns_sd_configs"] == [{"names": ["worker", "dreamer"], "type": "A", "port": port}]


def test_the_log_hash_key_has_no_public_default_in_the_stack(compose: dict[str, Any]) -> None:
    value = compose["services"]["worker"]["environment"]["REVERIE_LOG_HASH_KEY"]
    assert value.startswith("${REVERIE_LOG_HASH_KEY:?"), value


def test_the_image_installs_the_pinned_set(compose: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md constraints.txt ./" in dockerfile
    assert "pip install -c constraints.txt ." in dockerfile
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "-c constraints.txt" in ci and "-c constraints.txt" in readme

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    pins = {normal(line.split("==")[0]) for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name = normal(re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0])
        assert name in pins, f"{name} is not pinned in constraints.txt"


def test_start_up_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("worker", "dreamer", "beat"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }
    assert services["prometheus"]["depends_on"] == {
        "worker": {"condition": "service_healthy"},
        "dreamer": {"condition": "service_healthy"},
    }
    assert services["migrate"]["restart"] == "no"
    assert services["beat"]["deploy"]["replicas"] == 1
    for name in ("postgres", "redis", "worker", "dreamer", "beat"):
        assert "healthcheck" in services[name], name


def test_environment_agrees_with_the_settings_and_the_other_services(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    env: dict[str, str] = services["worker"]["environment"]
    for name in ("migrate", "worker", "dreamer", "beat"):
        assert services[name]["environment"] == env
    for key, value in env.items():
        assert key.startswith("REVERIE_")
        assert key.removeprefix("REVERIE_").lower() in Settings.model_fields, key
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]

    pg = services["postgres"]["environment"]
    assert settings.database_url == (
        f"postgresql+psycopg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    )
    assert settings.broker_url.startswith("redis://redis:6379/")
    default_port = Settings.model_fields["metrics_port"].default
    assert settings.metrics_port == default_port


def test_prometheus_scrapes_the_worker_on_the_metrics_port(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    assert "./ops:/etc/prometheus:ro" in prometheus["volumes"]
    scrape = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    found = [
        (name, sd["port"]) for job in scrape["scrape_configs"] for sd in job["dns_sd_configs"] for name in sd["names"]
    ]
    port = int(compose["services"]["worker"]["environment"]["REVERIE_METRICS_PORT"])
    assert {("worker", port), ("dreamer", port)} <= set(found)
    for rule_file in scrape.get("rule_files", []):
        assert (ROOT / "ops" / rule_file).is_file()


def test_the_image_builds_from_this_repository(compose: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert compose["services"]["worker"]["build"] == "."
    assert 'CMD ["reverie", "worker"]' in dockerfile
    for package in ("worker", "tasks", "schedules", "store"):
        assert f"COPY {package} ./{package}" in dockerfile


def test_the_parser_used_above_rejects_what_the_cli_rejects() -> None:
    with pytest.raises(Exception, match="No such option"):
        _parse_reverie(["reverie", "migrate", "--no-such-option"])
    with pytest.raises(AssertionError):
        _parse_reverie(["reverie", "no-such-command"])
