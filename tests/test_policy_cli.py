"""``reverie policy set|show`` and policy validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.errors import ConfigError
from worker.policy import defaults, effective, parse_assignments
from worker.settings import Settings

REVERIE = str(Path(sys.executable).with_name("reverie"))


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REVERIE_DATABASE_URL": settings.database_url}
    return subprocess.run([REVERIE, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_set_then_show(pg_settings: Settings) -> None:
    done = _cli(pg_settings, "policy", "set", "travel", "pruneStaleAfterDays=30", "contradictionResolution=keep_newest")
    assert done.returncode == 0, done.stderr
    done = _cli(pg_settings, "policy", "set", "travel", "maxCostPerRun=0.1")
    assert done.returncode == 0, done.stderr
    shown = json.loads(_cli(pg_settings, "policy", "show", "travel").stdout)["travel"]
    assert shown["pruneStaleAfterDays"] == 30 and shown["contradictionResolution"] == "keep_newest"
    assert shown["maxCostPerRun"] == 0.1 and shown["summarizeMinEntries"] == 5
    assert shown["overrides"] == ["contradictionResolution", "maxCostPerRun", "pruneStaleAfterDays"]
    everything = json.loads(_cli(pg_settings, "policy", "show").stdout)
    assert set(everything) == {"*", "travel"} and everything["*"]["pruneStaleAfterDays"] == 90


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("nope=1", "unknown policy field"),
        ("pruneStaleAfterDays=-1", "at least 0"),
        ("summarizeMinEntries=1", "at least 2"),
        ("contradictionResolution=delete_all", "one of flag, keep_newest"),
        ("enabled=maybe", "true or false"),
        ("maxCostPerRun=lots", "amount in USD"),
        ("profileWriter=llm", "one of deterministic, model"),
        ("justakey", "KEY=VALUE"),
    ],
)
def test_bad_values_are_one_line_errors(pg_settings: Settings, assignment: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_assignments([assignment])


def test_cli_bad_value_exit_code(pg_settings: Settings) -> None:
    done = _cli(pg_settings, "policy", "set", "travel", "pruneStaleAfterDays=soon")
    assert done.returncode == 2 and done.stderr.startswith("reverie: error:") and "Traceback" not in done.stderr


def test_effective_policy_fills_defaults(pg_settings: Settings) -> None:
    policy = effective(pg_settings, {"summarizeTargetEntries": "3", "enabled": "false"})
    assert policy.summarizeTargetEntries == 3 and not policy.enabled and not policy.prunes
    assert defaults(pg_settings).pruneStaleAfterDays == 90


def test_profile_writer_is_a_policy_field_defaulting_to_the_setting(pg_settings: Settings) -> None:
    done = _cli(pg_settings, "policy", "set", "travel", "profileWriter=model")
    assert done.returncode == 0, done.stderr
    shown = json.loads(_cli(pg_settings, "policy", "show").stdout)
    assert shown["travel"]["profileWriter"] == "model" and shown["*"]["profileWriter"] == "deterministic"
    assert effective(pg_settings, {"profileWriter": "model"}).writes_profiles_with_model
    assert not effective(pg_settings, {"profileWriter": "model", "enabled": False}).writes_profiles_with_model
    assert defaults(pg_settings.model_copy(update={"profile_writer": "model"})).profileWriter == "model"
