"""docker-compose.yml, checked without a Docker engine: the services exist, start in
order, run commands the CLI accepts, and agree with the settings and the scrape config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from worker.cli import app
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"postgres", "redis", "migrate", "worker", "beat", "prometheus"}


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


@pytest.mark.parametrize("service", ["migrate", "worker", "beat"])
def test_service_commands_are_real_reverie_invocations(compose: dict[str, Any], service: str) -> None:
    argv = compose["services"][service]["command"]
    context = _parse_reverie(argv)
    assert context.info_name == {"migrate": "migrate", "worker": "worker", "beat": "beat"}[service]
    if service == "worker":
        assert set(context.params["queues"].split(",")) == {"signals", "dreams", "housekeeping"}


def test_the_worker_healthcheck_pings_this_app(compose: dict[str, Any]) -> None:
    test = compose["services"]["worker"]["healthcheck"]["test"]
    assert test[:6] == ["CMD", "celery", "-A", "worker.app", "inspect", "ping"]


def test_start_up_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("worker", "beat"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }
    assert services["prometheus"]["depends_on"] == {"worker": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    assert services["beat"]["deploy"]["replicas"] == 1
    for name in ("postgres", "redis", "worker"):
        assert "healthcheck" in services[name], name


def test_environment_agrees_with_the_settings_and_the_other_services(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    env: dict[str, str] = services["worker"]["environment"]
    for name in ("migrate", "worker", "beat"):
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
    assert f"{default_port}:{default_port}" in services["worker"]["ports"]


def test_prometheus_scrapes_the_worker_on_the_metrics_port(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    assert "./ops:/etc/prometheus:ro" in prometheus["volumes"]
    scrape = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    port = compose["services"]["worker"]["environment"]["REVERIE_METRICS_PORT"]
    assert f"worker:{port}" in targets
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
