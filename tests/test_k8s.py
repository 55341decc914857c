"""ops/k8s, checked without a cluster: every built-in manifest against the Kubernetes
API schemas, the KEDA and Prometheus Operator objects by structure, the commands against
the real CLI, and the autoscaler's query against a real migrated PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import psycopg
import pytest
import yaml

from store.types import now
from tests.test_compose import _parse_reverie
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "ops" / "k8s"
#: The Kubernetes version the manifests are written for and validated against.
KUBERNETES_VERSION = "1.30"
#: The installed console script, the very command the containers run.
REVERIE = Path(sys.executable).with_name("reverie")
BUILT_IN = {"Namespace", "ConfigMap", "Secret", "Job", "Deployment", "Service"}
#: The postgresql trigger's metadata fields (KEDA 2.10+ scaler docs).
KEDA_POSTGRESQL_FIELDS = {
    "query",
    "targetQueryValue",
    "activationTargetQueryValue",
    "connectionFromEnv",
    "host",
    "port",
    "userName",
    "passwordFromEnv",
    "dbName",
    "sslmode",
}


def _load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S / name).read_text())
    return loaded


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return _load("kustomization.yaml")


@pytest.fixture(scope="module")
def manifests(kustomization: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, for every resource the kustomization lists."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for name in kustomization["resources"]:
        for document in yaml.safe_load_all((K8S / name).read_text()):
            objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = obj["spec"]["template"]["spec"]["containers"]
    return containers


def _workloads(manifests: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: obj for (kind, name), obj in manifests.items() if kind in ("Deployment", "Job")}


def test_the_kustomization_lists_every_manifest_in_the_folder(kustomization: dict[str, Any]) -> None:
    on_disk = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)
    assert kustomization["kind"] == "Kustomization"


def test_built_in_manifests_match_the_kubernetes_schemas(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    checked = set()
    for (kind, name), obj in manifests.items():
        if kind in BUILT_IN:
            # strict: an unknown or misspelt field is an error, not silently dropped.
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            checked.add(kind)
        else:
            assert obj["apiVersion"] in ("keda.sh/v1alpha1", "monitoring.coreos.com/v1"), (kind, name)
    assert checked == BUILT_IN


def test_the_schemas_do_reject_a_broken_manifest(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(manifests[("Deployment", "reverie-worker")]))
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    misspelt = yaml.safe_load(yaml.safe_dump(manifests[("Deployment", "reverie-beat")]))
    misspelt["spec"]["stratgy"] = {"type": "Recreate"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)


def test_every_workload_runs_the_image_compose_builds(
    manifests: dict[tuple[str, str], dict[str, Any]], kustomization: dict[str, Any]
) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    image = compose["x-reverie"]["image"]
    name, tag = image.split(":")
    import tomllib

    assert tag == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (override,) = kustomization["images"]
    assert override == {"name": name, "newTag": tag}
    workloads = _workloads(manifests)
    assert set(workloads) == {"reverie-migrate", "reverie-worker", "reverie-dreamer", "reverie-beat"}
    for obj in workloads.values():
        for container in _containers(obj):
            assert container["image"] == name
            assert {ref.get("configMapRef", ref.get("secretRef"))["name"] for ref in container["envFrom"]} == {
                "reverie-settings",
                "reverie-secrets",
            }


def _commands(manifests: dict[tuple[str, str], dict[str, Any]]) -> list[list[str]]:
    found = []
    for obj in _workloads(manifests).values():
        for container in _containers(obj):
            found.append(container["command"])
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in container:
                    found.append(container[probe]["exec"]["command"])
    return found


def test_every_command_is_a_real_reverie_invocation(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    commands = _commands(manifests)
    subcommands = {argv[1] for argv in commands}
    assert subcommands == {"migrate", "worker", "beat", "health"}
    for argv in commands:
        _parse_reverie(argv)  # every option is one the command takes
    for subcommand in sorted(subcommands):
        done = subprocess.run(
            [str(REVERIE), subcommand, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=ROOT,
        )
        assert done.returncode == 0, (subcommand, done.stderr)
        assert "Usage:" in done.stdout


#: The two workers' Deployments, and the queues each consumes.
WORKERS = {"reverie-worker": {"signals"}, "reverie-dreamer": {"dreams", "housekeeping"}}


@pytest.mark.parametrize("deployment", sorted(WORKERS))
def test_the_worker_serves_metrics_and_is_probed_with_reverie_health(
    manifests: dict[tuple[str, str], dict[str, Any]], deployment: str
) -> None:
    (container,) = _containers(manifests[("Deployment", deployment)])
    port = Settings.model_fields["metrics_port"].default
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert str(port) == manifests[("ConfigMap", "reverie-settings")]["data"]["REVERIE_METRICS_PORT"]
    ready = _parse_reverie(container["readinessProbe"]["exec"]["command"])
    assert ready.info_name == "health" and ready.params["broker"] and ready.params["metrics"]
    alive = _parse_reverie(container["livenessProbe"]["exec"]["command"])
    assert alive.info_name == "health" and alive.params["metrics"]
    worker = _parse_reverie(container["command"])
    assert set(worker.params["queues"].split(",")) == WORKERS[deployment]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]


def test_beat_stays_a_singleton_through_rollouts(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    beat = manifests[("Deployment", "reverie-beat")]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = _containers(beat)
    assert _parse_reverie(container["command"]).info_name == "beat"


def test_migrate_is_a_job_that_runs_reverie_migrate(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    job = manifests[("Job", "reverie-migrate")]
    (container,) = _containers(job)
    assert container["command"] == ["reverie", "migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")


def test_settings_in_the_configmap_and_secret_are_real_settings(
    manifests: dict[tuple[str, str], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    values = dict(manifests[("ConfigMap", "reverie-settings")]["data"])
    values.update(manifests[("Secret", "reverie-secrets")]["stringData"])
    for key, value in values.items():
        assert key.startswith("REVERIE_"), key
        assert key.removeprefix("REVERIE_").lower() in Settings.model_fields, key
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None)
    assert settings.database_url.startswith("postgresql+psycopg://")
    # Placeholders only: nothing that could be a real secret ships in the example.
    for key in ("REVERIE_DATABASE_URL", "REVERIE_BROKER_URL", "REVERIE_LOG_HASH_KEY"):
        assert "CHANGE-ME" in values[key], key


def test_every_queue_is_consumed_and_signals_never_wait_behind_dream_runs(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    from worker.app import DREAMS_QUEUE, QUEUES, SIGNALS_QUEUE

    consumed = {}
    for name, obj in _workloads(manifests).items():
        for container in _containers(obj):
            if container["command"][:2] == ["reverie", "worker"]:
                consumed[name] = set(_parse_reverie(container["command"]).params["queues"].split(","))
    assert consumed == WORKERS
    assert set().union(*consumed.values()) == set(QUEUES)
    for name, queues in consumed.items():
        assert not {SIGNALS_QUEUE, DREAMS_QUEUE} <= queues, name


def test_no_deployment_selects_another_ones_pods(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    deployments = {name: obj for (kind, name), obj in manifests.items() if kind == "Deployment"}
    for name, obj in deployments.items():
        selector = obj["spec"]["selector"]["matchLabels"]
        assert selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items(), name
        for other, other_obj in deployments.items():
            if other != name:
                labels = other_obj["spec"]["template"]["metadata"]["labels"]
                assert not selector.items() <= labels.items(), (name, other)


def test_the_metrics_service_and_servicemonitor_reach_the_worker_pods(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    service = manifests[("Service", "reverie-worker-metrics")]
    for deployment in WORKERS:
        pod_labels = manifests[("Deployment", deployment)]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), deployment
    beat_labels = manifests[("Deployment", "reverie-beat")]["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= beat_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics" and port["port"] == Settings.model_fields["metrics_port"].default

    monitor = manifests[("ServiceMonitor", "reverie-worker")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/metrics"


def _scaled_object(manifests: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    return manifests[("ScaledObject", name)]


@pytest.mark.parametrize("deployment", sorted(WORKERS))
def test_the_scaledobject_scales_the_worker_on_a_postgresql_query(
    manifests: dict[tuple[str, str], dict[str, Any]], deployment: str
) -> None:
    scaled = _scaled_object(manifests, deployment)
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    assert ("Deployment", target["name"]) in manifests
    assert target["name"] == deployment
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert isinstance(spec["pollingInterval"], int) and isinstance(spec["cooldownPeriod"], int)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"
    assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
    metadata = trigger["metadata"]
    assert set(metadata) <= KEDA_POSTGRESQL_FIELDS
    assert {"query", "targetQueryValue", "connectionFromEnv"} <= set(metadata)
    # KEDA reads trigger metadata as strings.
    assert all(isinstance(value, str) for value in metadata.values())
    assert float(metadata["targetQueryValue"]) > 0
    assert float(metadata["activationTargetQueryValue"]) >= 0
    # connectionFromEnv names a variable of the scale target's container.
    (container,) = _containers(manifests[("Deployment", target["name"])])
    secret = next(ref["secretRef"]["name"] for ref in container["envFrom"] if "secretRef" in ref)
    assert metadata["connectionFromEnv"] in manifests[("Secret", secret)]["stringData"]


def _query(manifests: dict[tuple[str, str], dict[str, Any]], name: str) -> str:
    query: str = _scaled_object(manifests, name)["spec"]["triggers"][0]["metadata"]["query"]
    return query


def _seed(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Signals and schedule rows of every kind; returns how many are work to do, per
    worker Deployment."""
    at = now()
    signals = [
        ("pending", at, 3),
        ("processing", at, 2),
        ("failed", at - timedelta(seconds=5), 1),  # its backoff has ended
        ("failed", at + timedelta(minutes=10), 1),  # still backing off: not yet work
        ("done", at, 4),
        ("dead", at, 1),
        ("rejected", at, 1),
    ]
    number = 0
    for status, available_at, count in signals:
        for _ in range(count):
            number += 1
            conn.execute(
                "INSERT INTO dream_signals (kind, user_id, payload, idempotency_key, status, available_at)"
                " VALUES ('activity', %s, '{}'::jsonb, %s, %s, %s)",
                (f"s{number}", f"k{number}", status, available_at),
            )
    hour = timedelta(hours=1)
    users = [
        # (user, next_dream_at, dirty_since, dispatched_at, last_dream_at)
        ("due-1", at - timedelta(minutes=1), None, None, None),
        ("due-2", at - timedelta(seconds=1), None, at - 24 * hour, at - 24 * hour),
        ("later-1", at + hour, None, None, None),
        ("later-2", at + 5 * hour, None, at - 20 * hour, at - 20 * hour),
        ("dirty", at + 3 * hour, at - timedelta(minutes=2), at - 10 * hour, at - 10 * hour),
        ("dirty-already-sent", at + 3 * hour, at - timedelta(minutes=2), at - timedelta(minutes=1), at - 10 * hour),
        ("in-flight", at + 20 * hour, None, at - timedelta(minutes=10), at - 24 * hour),
        ("in-flight-new", at + 20 * hour, None, at - timedelta(minutes=3), None),
        ("dreamed-since", at + 20 * hour, None, at - timedelta(minutes=10), at - timedelta(minutes=5)),
        ("run-lost-long-ago", at + 20 * hour, None, at - 2 * hour, at - 30 * hour),
    ]
    for row in users:
        conn.execute(
            "INSERT INTO dream_user_state (user_id, next_dream_at, dirty_since, dispatched_at, last_dream_at)"
            " VALUES (%s, %s, %s, %s, %s)",
            row,
        )
    waiting_signals = 3 + 2 + 1
    # due-1, due-2, dirty, dirty-already-sent (its run is in flight), in-flight, in-flight-new
    waiting_users = 6
    return {"reverie-worker": waiting_signals, "reverie-dreamer": waiting_users}


def test_the_scaling_query_counts_the_work_waiting_and_in_flight(
    manifests: dict[tuple[str, str], dict[str, Any]], pg_settings: Settings
) -> None:
    url = pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        for deployment in WORKERS:
            row = conn.execute(_query(manifests, deployment)).fetchone()
            assert row is not None and row[0] == 0  # a fresh database: no work, zero replicas wanted
        expected = _seed(conn)
        for deployment in WORKERS:
            (value,) = conn.execute(_query(manifests, deployment)).fetchone() or (None,)
            assert value == expected[deployment], deployment
            assert isinstance(value, int)


def test_the_scaling_query_is_served_by_indexes(
    manifests: dict[tuple[str, str], dict[str, Any]], pg_settings: Settings
) -> None:
    """It runs every polling interval: with sequential scans ruled out it still has a plan,
    so on a table of millions of users it reads the waiting rows, not the table."""
    url = pg_settings.database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        for deployment in WORKERS:
            plan = "\n".join(str(row[0]) for row in conn.execute("EXPLAIN " + _query(manifests, deployment)))
            assert "Seq Scan" not in plan, plan
