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
    # A set prints what a show of the agent prints next.
    assert done.stdout == _cli(pg_settings, "policy", "show", "travel").stdout
    shown = json.loads(done.stdout)["travel"]
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
        ("pruneStaleAfterDays=1000000", "at most 365,000"),
        ("maxCostPerRun=10000000000", "at most 1,000,000,000 USD"),
        ("justakey", "KEY=VALUE"),
    ],
)
def test_bad_values_are_one_line_errors(pg_settings: Settings, assignment: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_assignments([assignment])


def test_an_agent_named_by_spaces_alone_gets_a_policy_and_an_empty_name_none(pg_settings: Settings) -> None:
    # The application's rows may name an agent so, and its entries are dreamed under it.
    done = _cli(pg_settings, "policy", "set", " ", "pruneStaleAfterDays=31")
    assert done.returncode == 0, done.stderr
    assert json.loads(_cli(pg_settings, "policy", "show", " ").stdout)[" "]["pruneStaleAfterDays"] == 31
    refused = _cli(pg_settings, "policy", "set", "", "pruneStaleAfterDays=31")
    assert refused.returncode == 2 and "agent: must not be empty" in refused.stderr, refused.stderr


def test_cli_bad_value_exit_code(pg_settings: Settings) -> None:
    done = _cli(pg_settings, "policy", "set", "travel", "pruneStaleAfterDays=soon")
    assert done.returncode == 2 and done.stderr.startswith("reverie: error:") and "Traceback" not in done.stderr


def test_the_largest_values_taken_dream_every_user_and_larger_ones_are_refused(pg_settings: Settings) -> None:
    """Each day count and amount at the most a policy or a setting takes: a cron pass
    (signals, dreams, the purge) still ends well; one more is refused, naming it, before
    any dream. (Larger ones overflowed the date arithmetic and the database's counters,
    and failed the dream of every user, whichever agent's policy held them.)"""
    from worker.settings import MAX_DAYS, MAX_DURATION_SECONDS, MAX_USD

    assert _cli(pg_settings, "policy", "set", "travel", f"pruneStaleAfterDays={MAX_DAYS}").returncode == 0
    assert _cli(pg_settings, "policy", "set", "travel", f"maxCostPerRun={MAX_USD:.0f}").returncode == 0
    largest = {
        "REVERIE_MAX_COST_PER_RUN": str(MAX_USD),
        "REVERIE_MAX_COST_PER_DAY": str(MAX_USD),
        "REVERIE_MAX_COST_PER_USER_PER_DAY": str(MAX_USD),
        "REVERIE_MAX_COST_PER_SIGNAL": str(MAX_USD),
        "REVERIE_PRUNE_STALE_AFTER_DAYS": str(MAX_DAYS),
        "REVERIE_ARCHIVE_RETENTION_DAYS": str(MAX_DAYS),
        "REVERIE_SIGNAL_PAYLOAD_RETENTION_DAYS": str(MAX_DAYS),
        "REVERIE_EVENT_RETENTION_DAYS": str(MAX_DAYS),
        "REVERIE_RUN_RETENTION_DAYS": str(MAX_DAYS),
        "REVERIE_SPEND_RETENTION_DAYS": str(MAX_DAYS),
        "REVERIE_SIGNAL_MAX_ATTEMPTS": "10000",
        "REVERIE_DATABASE_KEEPALIVE_SECONDS": "32767",
        "REVERIE_DATABASE_IDLE_IN_TRANSACTION_SECONDS": "2147483",
        "REVERIE_PURGE_BATCH_SIZE": "1000000",
        "REVERIE_DREAM_INTERVAL_HOURS": str(MAX_DURATION_SECONDS // 3600),
        **{
            f"REVERIE_{name.upper()}": str(MAX_DURATION_SECONDS)
            for name in (
                "llm_timeout_seconds",
                "dream_lease_seconds",
                "signal_lease_seconds",
                "signal_backoff_seconds",
                "dispatch_lease_seconds",
                "dispatch_dirty_delay_seconds",
                "sweep_grace_seconds",
                "cron_time_limit_seconds",
            )
        },
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env |= {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": "", **largest}
    payload = {"conversation_id": "c1", "messages": [{"role": "user", "content": "My favorite color is blue."}]}
    enqueued = subprocess.run(
        [REVERIE, "enqueue", "session_end", "--user", "u1", "--agent", "travel", "--payload", "-"],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert enqueued.returncode == 0, enqueued.stderr
    done = subprocess.run([REVERIE, "run", "--json"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["errors"] == [] and report["users_processed"] == 1 and report["signals_processed"] == 1
    # The dispatcher's tick (beat's) at these values too.
    from schedules.dispatcher import dispatch
    from worker.settings import Settings as Loaded

    with pytest.MonkeyPatch.context() as patched:
        for name, value in largest.items():
            patched.setenv(name, value)
        sent: list[list[str]] = []
        dispatch(Loaded(_env_file=None, database_url=pg_settings.database_url), sent.append)  # type: ignore[call-arg]
    for name, value in largest.items():
        over = str(float(value) * 10 if "COST" in name or "HOURS" in name else int(value) * 10)
        refused = subprocess.run(
            [REVERIE, "run", "--json"], capture_output=True, text=True, env={**env, name: over}, timeout=60, check=False
        )
        assert refused.returncode == 1 and refused.stdout == "", (name, refused.stdout)
        assert refused.stderr.startswith(f"reverie: error: invalid setting {name}: "), refused.stderr


def test_a_stored_value_past_the_limit_is_refused_naming_the_agent_and_the_mend(pg_settings: Settings) -> None:
    """A policy stored before the limits (or by hand) stops the pass with one line that
    names its agent and how to mend it; mended, the user is dreamed."""
    from sqlalchemy import text

    from store.db import session_scope
    from tests.dream_seed import entry, seed

    assert _cli(pg_settings, "policy", "set", "zz", "pruneStaleAfterDays=30").returncode == 0
    with session_scope(pg_settings) as session:
        session.execute(text("""UPDATE dream_policies SET config = '{"pruneStaleAfterDays": 1000000}'"""))
    seed(pg_settings, [entry("u1", "city", "Oslo")])
    said = (
        "reverie: error: the stored policy of agent zz: pruneStaleAfterDays must be at most 365,000, not 1,000,000 "
        "(`reverie policy set zz FIELD=VALUE` mends it)\n"
    )
    # health too: the readiness probe said healthy while every pass stopped on it.
    for argv in (["run", "--user", "u1", "--json"], ["policy", "show"], ["health"]):
        refused = _cli(pg_settings, *argv)
        assert refused.returncode == 1 and refused.stderr.endswith(said), refused.stderr
    assert _cli(pg_settings, "policy", "set", "zz", "pruneStaleAfterDays=40").returncode == 0
    assert _cli(pg_settings, "health").returncode == 0
    done = _cli(pg_settings, "run", "--user", "u1", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["users_processed"] == 1, done.stderr


def test_every_duration_and_day_count_setting_has_a_limit() -> None:
    """A setting in seconds, hours or days with no upper limit is one a large value
    overflows in every dream: each is refused past its limit (one added later too)."""
    from pydantic import ValidationError

    names = [n for n in Settings.model_fields if n.endswith(("_seconds", "_hours", "_days"))]
    assert len(names) > 15
    for name in names:
        with pytest.raises(ValidationError, match=name):
            Settings(_env_file=None, **{name: 1e15})  # type: ignore[call-arg]


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
