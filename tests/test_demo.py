"""``reverie demo`` as the README runs it: embedded, offline, and it does the whole job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from worker import demo_world
from worker.logs import user_ref

HASH_KEY = "demo-test-secret"
#: A log line as the demo prints it (console format), and a user named in it.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+Z)? \[")
USER_FIELD = re.compile(r"\buser=(\S+)")


def _demo(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    # No broker, no model endpoint: anything that tried the network would fail here.
    env.update(
        {
            "REVERIE_BROKER_URL": "redis://127.0.0.1:1/0",
            "REVERIE_LOG_HASH_KEY": HASH_KEY,
            "NO_PROXY": "*",
            "COLUMNS": "200",
        }
    )
    return _reverie(["demo"], tmp_path, env)


def _reverie(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "from worker.cli import main; main()", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_demo_runs_the_whole_pipeline_offline(tmp_path: Path) -> None:
    result = _demo(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert (tmp_path / "reverie-demo.db").exists()
    # Facts from user messages are accepted; what the assistant and the tool said about
    # themselves ("My name is TravelBot") never becomes a memory of the user's.
    assert "favorite_color" in out and "accepted" in out
    assert "TravelBot" not in out
    # A key said another way lands on the existing entry (archived first), not beside it.
    assert "update (proposed as 'favorite_color', same meaning)" in " ".join(out.split())
    # Malformed producer rows are rejected with the field named.
    assert "payload.conversation_id" in out and "payload.events[0].at" in out
    # The dream pass pruned, flagged and summarized, and spent something under the cap.
    summary = out[out.rindex("pass:") :].replace("\n", " ")
    assert "pruned 3" in summary and "contradictions 2" in summary and "summarized 6" in summary
    assert "routines found 1" in summary
    assert "signals done 5" in summary and "rejected 2" in summary
    # One agent's profile, before and after: the signal's fact, the changed value and
    # the contradiction the dream found all show after; none of them before.
    before = out[out.index("Profile of alice as travel-agent sees it, before") : out.index("Signals: what each one")]
    after = out[out.index("Profile of alice as travel-agent sees it, after") :]
    assert "- favourite colour: green\n" in before and "home airport" not in before
    assert "(contradicted)" not in before
    assert "- favourite colour: blue\n" in after and "- home airport: Munich\n" in after
    assert "- language: English (contradicted)" in after and "green" not in after
    # The last line says how to reach the demo's store; its command, run as it is, works.
    hint = out.strip().splitlines()[-1]
    command = hint.split(": ", 1)[1].split()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env[command[0].split("=", 1)[0]] = command[0].split("=", 1)[1]
    shown = _reverie(command[2:], tmp_path, env)
    assert shown.returncode == 0, shown.stderr
    assert "- home airport: Munich" in shown.stdout
    assert not (tmp_path / "reverie.db").exists()


def test_demo_prints_each_user_beside_the_reference_its_log_lines_use(tmp_path: Path) -> None:
    """The tables name users, the log lines name them by keyed reference only; the demo
    prints the pairs, so a reader can match a log line with a table row."""
    result = _demo(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    logs = [line for line in lines if LOG_LINE.match(line)]
    printed = [line for line in lines if not LOG_LINE.match(line)]
    assert logs, "the demo printed no log lines"
    named = {match for line in logs for match in USER_FIELD.findall(line)}
    # Every user the pipeline worked on shows up in the logs, by reference only.
    expected = {user: user_ref(user, HASH_KEY) for user in demo_world.USERS}
    assert named == set(expected.values()), (named, expected)
    for line in logs:
        assert not any(re.search(rf"\b{user}\b", line) for user in demo_world.USERS), line
    # The demo's own output pairs each user with that reference, on one row.
    for user, ref in expected.items():
        assert any(re.search(rf"\b{user}\b.*\b{ref}\b", line) for line in printed), (user, ref)


def test_the_demo_runs_the_same_whatever_reverie_settings_the_shell_has(tmp_path: Path) -> None:
    # A shell set up for production: the demo's store, model, broker and figures are its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env.update(
        {
            "REVERIE_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/production",
            "REVERIE_LLM_MODEL": "gpt-4o",
            "REVERIE_PRUNE_STALE_AFTER_DAYS": "0",
            "REVERIE_MAX_COST_PER_RUN": "not-a-number",
            "REVERIE_LOG_FORMAT": "bogus",
            "NO_PROXY": "*",
            "COLUMNS": "200",
        }
    )
    result = _reverie(["demo"], tmp_path, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pass: users 3, pruned 3, contradictions 2" in " ".join(result.stdout.split())


def test_at_80_columns_the_demos_tables_fit_and_keep_keys_whole(tmp_path: Path) -> None:
    """A terminal 80 columns wide: no table is cut at its right edge, and a key is not
    broken mid-word while the columns of prose beside it could wrap at their spaces."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env.update({"REVERIE_BROKER_URL": "", "NO_PROXY": "*", "COLUMNS": "80"})
    result = _reverie(["demo"], tmp_path, env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if not LOG_LINE.match(line)]
    tables = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert tables and all(len(line) <= 80 and line[-1] in "┓┃┩│┘" for line in tables), tables
    candidates = "\n".join(lines[lines.index(next(x for x in lines if "Candidate memories" in x)) :])
    for key in ("favourite_colour", "preferred_language", "response_length", "response_format"):
        assert f" {key} " in candidates, key
