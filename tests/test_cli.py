"""The command line as a user runs it: real processes, one-line errors, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.settings import Settings

REVERIE = [sys.executable, "-c", "from worker.cli import main; main()"]


def run(
    args: list[str], *, env: dict[str, str] | None = None, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    full_env.update(env or {})
    return subprocess.run(
        REVERIE + args, input=stdin, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=120, check=False
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("reverie: error: ")
    for needle in needles:
        assert needle in lines[0]


def test_help_lists_the_contract_commands() -> None:
    result = run(["--help"])
    assert result.returncode == 0
    for command in ("migrate", "enqueue", "signals", "demo"):
        assert command in result.stdout


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    result = run(["migrate"], env={"REVERIE_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nowhere"})
    assert_one_line_error(result, "database unreachable", "127.0.0.1:1")


SECRET_URL = "postgresql://reverie:UserinfoPw1@127.0.0.1:1/app?sslmode=prefer&password=QueryPw2&sslpassword=SslPw3"


@pytest.mark.parametrize("args", [["migrate"], ["run", "--json"], ["run"], ["signals", "list"]])
def test_secrets_in_the_database_url_are_never_printed(args: list[str]) -> None:
    result = run(args, env={"REVERIE_DATABASE_URL": SECRET_URL, "REVERIE_LOG_FORMAT": "json"})
    assert_one_line_error(result, "database unreachable", "127.0.0.1:1", "sslmode=prefer", "password=***")
    for secret in ("UserinfoPw1", "QueryPw2", "SslPw3"):
        assert secret not in result.stderr + result.stdout


def test_run_warns_once_when_the_log_hash_key_is_the_public_default(tmp_path: Path) -> None:
    env = {"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}", "REVERIE_LOG_FORMAT": "json"}
    assert run(["migrate"], env=env).returncode == 0
    default = run(["run", "--json"], env=env)
    own = run(["run", "--json"], env={**env, "REVERIE_LOG_HASH_KEY": "k-of-our-own"})
    assert default.returncode == 0 and own.returncode == 0
    warned = [line for line in default.stderr.splitlines() if "log_hash_key_is_public" in line]
    assert len(warned) == 1 and json.loads(warned[0])["process"] == "run"
    assert "log_hash_key_is_public" not in own.stderr
    assert json.loads(default.stdout)["users_processed"] == 0


def test_bad_setting_is_one_line() -> None:
    result = run(["migrate"], env={"REVERIE_METRICS_PORT": "not-a-port"})
    assert_one_line_error(result, "REVERIE_METRICS_PORT")


def test_unknown_database_scheme_is_one_line() -> None:
    result = run(["migrate"], env={"REVERIE_DATABASE_URL": "mysql://x@localhost/db"})
    assert_one_line_error(result, "unsupported database")


def test_unmigrated_database_says_to_migrate(tmp_path: Path) -> None:
    result = run(["signals", "list"], env={"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'empty.db'}"})
    assert_one_line_error(result, "reverie migrate")


def test_enqueue_roundtrip_and_duplicate(pg_settings: Settings, tmp_path: Path) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    payload = json.dumps({"events": [{"action": "digest", "at": "2026-11-02T09:00:00Z"}]})
    first = run(["enqueue", "activity", "--user", "u1", "--agent", "a1", "--payload", "-"], env=env, stdin=payload)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("enqueued signal ")
    again = run(["enqueue", "activity", "--user", "u1", "--agent", "a1", "--payload", "-"], env=env, stdin=payload)
    assert again.returncode == 0
    assert again.stdout.startswith("duplicate:") and "nothing written" in again.stdout
    listed = run(["signals", "list", "--json"], env=env)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["kind"], r["user"], r["status"]) for r in rows] == [("activity", "u1", "pending")]


@pytest.mark.parametrize(
    ("args", "stdin", "needles"),
    [
        (["enqueue", "nonsense", "--user", "u", "--payload", "-"], "{}", ("kind", "unknown kind")),
        (["enqueue", "activity", "--user", "u", "--payload", "-"], "{not json", ("not valid JSON",)),
        (["enqueue", "activity", "--user", "u", "--payload", "-"], "[1, 2]", ("payload", "JSON object")),
        (["enqueue", "activity", "--user", "u", "--payload", "-"], '{"events": "x"}', ("payload.events",)),
        (
            ["enqueue", "activity", "--user", "u", "--payload", "-"],
            '{"events": [{"action": "a", "at": "31/12/2026"}]}',
            ("payload.events[0].at", "ISO-8601"),
        ),
        (
            ["enqueue", "session_end", "--user", "u", "--payload", "-"],
            '{"conversation_id": "c", "messages": [{"role": "robot", "content": "x"}]}',
            ("payload.messages[0].role",),
        ),
        (
            ["enqueue", "feedback", "--user", "u", "--payload", "-"],
            '{"original": "a", "edited": "b"}',
            ("deliverable_id",),
        ),
        (["enqueue", "activity", "--user", "", "--payload", "-"], '{"events": []}', ("user_id",)),
        (
            ["enqueue", "activity", "--user", "u", "--payload", "-"],
            '{"events": [{"action": "a\\u0000b", "at": "2026-01-01T00:00:00Z"}]}',
            ("NUL",),
        ),
        (["enqueue", "activity", "--user", "u", "--payload", "/no/such/file.json"], None, ("cannot read",)),
    ],
)
def test_enqueue_bad_input_is_one_line_and_writes_nothing(
    pg_settings: Settings, args: list[str], stdin: str | None, needles: tuple[str, ...]
) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    assert_one_line_error(run(args, env=env, stdin=stdin), *needles)
    listed = run(["signals", "list", "--json"], env=env)
    assert listed.stdout.strip() == ""


def test_oversized_payload_is_refused(pg_settings: Settings) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_MAX_PAYLOAD_BYTES": "2048"}
    big = json.dumps({"conversation_id": "c", "messages": [{"role": "user", "content": "x" * 5000}]})
    assert_one_line_error(
        run(["enqueue", "session_end", "--user", "u", "--payload", "-"], env=env, stdin=big), "payload", "2048"
    )


def test_signals_retry_needs_a_target(pg_settings: Settings) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    assert_one_line_error(run(["signals", "retry"], env=env), "exactly one")
    assert_one_line_error(run(["signals", "retry", "12345"], env=env), "12345")
