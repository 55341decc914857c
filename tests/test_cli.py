"""The command line as a user runs it: real processes, one-line errors, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.dream_seed import entry, seed
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


def test_help_lists_the_documented_commands() -> None:
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


@pytest.mark.parametrize(
    "args", [["profile", "alice"], ["run", "--json"], ["health"], ["signals", "list"], ["erase-user", "alice", "--yes"]]
)
def test_a_command_on_a_sqlite_file_that_is_not_there_says_so_and_creates_nothing(
    tmp_path: Path, args: list[str]
) -> None:
    # With no REVERIE_DATABASE_URL, the default is ./reverie.db: a command reading it
    # must not leave an empty database behind (it would look like a production one).
    result = run(args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("reverie: error: ")]
    assert errors == [
        f"reverie: error: no database at {tmp_path / 'reverie.db'}: `reverie migrate` creates it "
        "(or set REVERIE_DATABASE_URL to yours)"
    ], result.stderr
    assert list(tmp_path.iterdir()) == []
    created = run(["migrate"], cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert (tmp_path / "reverie.db").exists()
    again = run(["profile", "alice"], cwd=tmp_path)
    assert again.returncode == 1 and "no profile for user alice" in again.stderr, again.stderr


def test_a_sqlite_url_with_options_names_its_file_and_a_missing_directory_is_said(tmp_path: Path) -> None:
    env = {"REVERIE_DATABASE_URL": "sqlite:///r.db?timeout=30"}
    assert run(["migrate"], env=env, cwd=tmp_path).returncode == 0
    healthy = run(["health"], env=env, cwd=tmp_path)
    assert healthy.returncode == 0, healthy.stderr
    nowhere = run(["health"], env={"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path}/nodir/r.db"})
    assert_one_line_error(
        nowhere, f"no database at {tmp_path}/nodir/r.db: its directory {tmp_path}/nodir does not exist"
    )


def test_a_pass_keeps_the_collector_off_what_the_process_loaded(tmp_path: Path) -> None:
    # The cyclic collector's full walks cover every object the process holds; a pass
    # over many users makes them often. `reverie run` moves what its start-up loaded
    # (SQLAlchemy, the settings, the tasks) out of their reach before the pass, as the
    # worker's main process does before it forks (a pass over 1,000 users: 2.4 s to 2.1 s).
    env = {"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}"}
    assert run(["migrate"], env=env).returncode == 0
    seed(_sqlite(tmp_path / "r.db"), [entry("user-1", "pet", "a cat")])
    frozen = [
        sys.executable,
        "-c",
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
        "from worker.cli import main\n"
        "main()",
    ]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")} | env
    done = subprocess.run(
        [*frozen, "run", "--json"], capture_output=True, text=True, env=full_env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["users_processed"] == 1
    counted = [line for line in done.stderr.splitlines() if line.startswith("frozen ")]
    assert counted and int(counted[-1].split()[1]) > 20_000, done.stderr


def _sqlite(path: Path) -> Settings:
    return Settings(_env_file=None, database_url=f"sqlite:///{path}")  # type: ignore[call-arg]


def test_bad_setting_is_one_line() -> None:
    result = run(["migrate"], env={"REVERIE_METRICS_PORT": "not-a-port"})
    assert_one_line_error(result, "REVERIE_METRICS_PORT")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("REVERIE_MAX_COST_PER_DAY", "inf"),
        ("REVERIE_MAX_COST_PER_RUN", "Infinity"),
        ("REVERIE_DREAM_INTERVAL_HOURS", "inf"),
    ],
)
def test_an_infinite_setting_is_refused_in_one_line(name: str, value: str, tmp_path: Path) -> None:
    # An infinite cap overflowed the budget's integer nano-dollars and made policy show
    # print JSON no parser takes (Infinity).
    result = run(["policy", "show"], env={"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}", name: value})
    assert_one_line_error(result, name, "finite")
    assert result.stdout == ""


def test_a_database_url_whose_port_is_not_a_number_is_one_line() -> None:
    result = run(["health"], env={"REVERIE_DATABASE_URL": "postgresql://u:secret@127.0.0.1:abc/x"})
    assert_one_line_error(result, "REVERIE_DATABASE_URL", "port is not a number")
    assert "secret" not in result.stderr


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


def test_a_payload_sent_by_the_command_line_and_by_sql_is_one_signal_whatever_its_numbers(
    pg_settings: Settings,
) -> None:
    # The default key hashes the payload as PostgreSQL's jsonb writes it, which keeps a
    # number's digits as sent (100.50, 1e2 as 100): the command line writes the file's own
    # text, so the same text by SQL is the same signal, whichever comes first.
    import psycopg

    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    texts = [
        '{"events": [{"action": "paid", "at": "2026-11-27T09:00:00Z", "attributes": {"amount": 100.50, "n": 1e2}}]}',
        '{"events": [{"action": "tip", "at": "2026-11-27T09:00:00Z", "attributes": {"amount": 0.10}}]}',
    ]
    sql = "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'u1', %s) ON CONFLICT DO NOTHING"
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
        first = run(["enqueue", "activity", "--user", "u1", "--payload", "-"], env=env, stdin=texts[0])
        assert first.returncode == 0 and first.stdout.startswith("enqueued signal "), first.stderr
        assert conn.execute(sql, (texts[0],)).rowcount == 0  # the same signal: nothing written
        assert conn.execute(sql, (texts[1],)).rowcount == 1
        second = run(["enqueue", "activity", "--user", "u1", "--payload", "-"], env=env, stdin=texts[1])
        assert second.returncode == 0 and second.stdout.startswith("duplicate:"), second.stdout
        stored = conn.execute("SELECT payload::text FROM dream_signals ORDER BY id").fetchall()
    assert ["100.50" in stored[0][0], "0.10" in stored[1][0]] == [True, True], stored


def test_the_payload_size_limit_counts_the_text_the_command_line_writes(pg_settings: Settings) -> None:
    # The text is what is stored: a number's long digits count, however short Python's
    # float of it would be.
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_MAX_PAYLOAD_BYTES": "2000"}
    digits = "0." + "1" * 3000
    event = {"action": "paid", "at": "2026-11-27T09:00:00Z", "attributes": {"amount": "AMOUNT"}}
    text = json.dumps({"events": [event]}).replace('"AMOUNT"', digits)
    refused = run(["enqueue", "activity", "--user", "u1", "--payload", "-"], env=env, stdin=text)
    assert_one_line_error(refused, "payload: is over 2000 bytes; at most 2000 allowed")
    listed = run(["signals", "list", "--json"], env=env)
    assert listed.returncode == 0 and listed.stdout == "", listed.stdout


@pytest.mark.parametrize("source", ["/dev/zero", "-"], ids=["endless-file", "endless-stdin"])
def test_an_endless_payload_is_refused_past_the_limit_without_being_held(pg_settings: Settings, source: str) -> None:
    """``--payload /dev/zero`` (or a producer's pipe that never ends) is refused once it
    passes the limit: the command reads no further, in 2 GiB of address space."""
    import resource

    def two_gib() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    full_env["REVERIE_DATABASE_URL"] = pg_settings.database_url
    with open("/dev/zero", "rb") as zeros:
        refused = subprocess.run(
            [*REVERIE, "enqueue", "activity", "--user", "u1", "--payload", source],
            stdin=zeros,
            capture_output=True,
            text=True,
            env=full_env,
            timeout=120,
            check=False,
            preexec_fn=two_gib,
        )
    assert_one_line_error(refused, "payload: is over 1048576 bytes; at most 1048576 allowed")
    assert refused.returncode == 1


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
        (
            ["enqueue", "activity", "--user", "u", "--payload", "-"],
            '{"events": [], "n": ' + "1" * 5000 + "}",
            ("payload: is not JSON Reverie reads", "4300"),
        ),
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


# -- usage errors read as a click program's, whatever click the CLI framework carries ----


def test_unknown_command_is_a_usage_error() -> None:
    result = run(["enque"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "unexpected" not in result.stderr
    assert "Usage: reverie" in result.stderr
    assert "Try 'reverie --help' for help." in result.stderr
    assert "No such command 'enque'" in result.stderr


def test_missing_option_is_a_usage_error() -> None:
    result = run(["enqueue", "session_end", "--payload", "-"], stdin="{}")
    assert result.returncode == 2
    assert "unexpected" not in result.stderr
    assert "Usage: reverie enqueue" in result.stderr
    assert "Missing option '--user'" in result.stderr


def test_unknown_option_is_a_usage_error() -> None:
    result = run(["run", "--bogus"])
    assert result.returncode == 2
    assert "No such option: --bogus" in result.stderr
    assert "Try 'reverie run --help' for help." in result.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["erase-user", "", "--yes"], "user: must not be empty"),
        (["erase-user", "u" * 300, "--yes"], "user: is 300 characters long; at most 255 allowed"),
        (["restore", "--run", str(2**64)], "less than or equal to 9223372036854775807"),
        (["restore", "--signal", str(2**64)], "less than or equal to 9223372036854775807"),
        (["signals", "retry", str(2**64)], "less than or equal to 9223372036854775807"),
        (["profile", ""], "must not be empty"),
    ],
)
def test_a_name_or_id_nothing_can_have_is_a_usage_error_before_the_database(
    argv: list[str], said: str, tmp_path: Path
) -> None:
    """Exit 2 and a line saying what is wrong, as any usage error, not a database error
    (an id past a BIGINT's range) or another exit code from one command to the next."""
    result = run(argv, env={"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path}/none.db"})
    assert result.returncode == 2, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_bare_reverie_prints_the_help() -> None:
    result = run([])
    assert "unexpected" not in result.stderr + result.stdout
    shown = result.stdout + result.stderr
    assert "Usage: reverie" in shown
    for command in ("run", "enqueue", "erase-user", "demo"):
        assert command in shown


def test_help_texts_speak_of_the_product_only() -> None:
    result = run(["--help"])
    assert "contract" not in result.stdout.lower()


# -- the database in use is said, never silently created -----------------------------------


def test_unset_database_says_which_sqlite_file(tmp_path: Path) -> None:
    result = run(["migrate"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"using the SQLite file {(tmp_path / 'reverie.db').resolve()}" in result.stderr
    listed = run(["signals", "list", "--json"], cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.strip() == ""  # the notice stays off stdout
    assert "REVERIE_DATABASE_URL is not set" in listed.stderr


def test_configured_database_is_not_announced(tmp_path: Path) -> None:
    result = run(["migrate"], env={"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"})
    assert result.returncode == 0, result.stderr
    assert "not set" not in result.stderr


# -- erase-user asks on a terminal; --yes for scripts ----------------------------------------


def _erase_on_a_terminal(args: list[str], answer: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import pty

    master, slave = pty.openpty()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    full_env.update(env)
    try:
        proc = subprocess.Popen(
            REVERIE + args, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env
        )
        os.write(master, answer.encode())
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _memory_rows(settings: Settings, user: str) -> int:
    from sqlalchemy import func, select

    from store.db import session_scope
    from store.memories import table_for

    table = table_for(settings)
    with session_scope(settings) as session:
        return int(session.scalar(select(func.count()).select_from(table).where(table.c.user_id == user)) or 0)


def _seed_one_entry(settings: Settings, user: str) -> None:
    from store.db import session_scope
    from store.memories import table_for, upsert_entry

    with session_scope(settings) as session:
        upsert_entry(
            session,
            table_for(settings),
            user_id=user,
            key="favorite_color",
            value="blue",
            category="preference",
            source="test",
        )


def test_an_erasure_that_fails_gives_the_lease_back_at_once(store_settings: Settings) -> None:
    # Rolled back (here: a memory table that is not there), the erasure held the user's
    # lease for minutes all the same: the next run skipped the user as busy.
    from sqlalchemy import select

    from store.db import session_scope
    from store.models import UserState

    seed(store_settings, [entry("u1", "city", "Lisbon")])
    env = {"REVERIE_DATABASE_URL": store_settings.database_url}
    assert run(["run", "--user", "u1"], env=env).returncode == 0  # the user has a schedule row
    for user in ("u1", "u-none"):
        failed = run(["erase-user", user, "--yes"], env={**env, "REVERIE_MEMORY_TABLE": "no_such_table"})
        assert failed.returncode == 1 and "Traceback" not in failed.stderr
    with session_scope(store_settings) as session:
        states = {row.user_id: row for row in session.scalars(select(UserState))}
    assert set(states) == {"u1"}  # no schedule row is left for a user that had none
    assert states["u1"].lock_token is None and states["u1"].locked_until is None
    again = run(["run", "--user", "u1", "--json"], env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["users_processed"] == 1


def test_erase_user_asks_on_a_terminal_and_no_keeps_everything(pg_settings: Settings) -> None:
    _seed_one_entry(pg_settings, "u-keep")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = _erase_on_a_terminal(["erase-user", "u-keep"], "n\n", env)
    assert result.returncode != 0
    assert "Erase every row of user 'u-keep'" in result.stdout
    assert _memory_rows(pg_settings, "u-keep") == 1
    confirmed = _erase_on_a_terminal(["erase-user", "u-keep"], "y\n", env)
    assert confirmed.returncode == 0, confirmed.stderr
    assert _memory_rows(pg_settings, "u-keep") == 0


def test_a_settings_file_that_is_not_utf8_is_named_in_one_line(tmp_path: Path) -> None:
    (tmp_path / ".env").write_bytes(b"garbage\n\x00\xff\n")
    result = run(["health"], cwd=tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, f"the settings file {tmp_path.resolve() / '.env'} is not UTF-8 text")


def _signal_state(pid: int) -> str:
    """A process's state and signal masks (pending, blocked, ignored), and where it waits."""
    try:
        with open(f"/proc/{pid}/status") as status:
            kept = [
                line.strip() for line in status if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn"))
            ]
        with open(f"/proc/{pid}/wchan") as wchan:
            kept.append(f"wchan: {wchan.read().strip()}")
    except OSError as exc:
        kept = [f"not readable: {exc}"]
    return ", ".join(kept)


def test_ctrl_c_at_the_erase_question_is_an_interruption_exit_130(pg_settings: Settings) -> None:
    import pty
    import select
    import signal
    import time

    _seed_one_entry(pg_settings, "u-keep")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    full_env["REVERIE_DATABASE_URL"] = pg_settings.database_url
    master, slave = pty.openpty()
    try:
        # As a terminal's shell starts a command: Ctrl-C's signal at its default. A
        # process inherits an ignored signal, and something earlier in a whole-suite run
        # leaves SIGINT and SIGQUIT ignored in this one (seen through the masks below),
        # so the command, rightly honouring that, never heard Ctrl-C. A handler of this
        # process's own is not inherited: the command starts with the default.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            proc = subprocess.Popen(
                [*REVERIE, "erase-user", "u-keep"],
                stdin=slave,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=full_env,
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        assert proc.stdout is not None
        asked = b""
        deadline = time.monotonic() + 60
        while b"[y/N]" not in asked and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                asked += os.read(proc.stdout.fileno(), 4096)
        assert b"[y/N]" in asked
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Seen once in a whole-suite run: say how the process stood, not only that
            # it did not end (and end it, so that the tests after this one are not hit).
            stood = _signal_state(proc.pid)
            proc.kill()
            proc.communicate()
            pytest.fail(
                f"reverie erase-user did not end on SIGINT: {stood}; this process: {_signal_state(os.getpid())}"
            )
    finally:
        os.close(master)
        os.close(slave)
    assert proc.returncode == 130
    assert _memory_rows(pg_settings, "u-keep") == 1


def test_erase_user_yes_skips_the_question_on_a_terminal(pg_settings: Settings) -> None:
    _seed_one_entry(pg_settings, "u-gone")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = _erase_on_a_terminal(["erase-user", "u-gone", "--yes"], "", env)
    assert result.returncode == 0, result.stderr
    assert "Erase every row" not in result.stdout
    assert _memory_rows(pg_settings, "u-gone") == 0


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_erase_user_json_is_the_only_thing_on_stdout_and_its_log_line_goes_to_stderr(
    pg_settings: Settings, log_format: str
) -> None:
    _seed_one_entry(pg_settings, "u-json")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_LOG_FORMAT": log_format}
    result = run(["erase-user", "u-json", "--yes", "--json"], env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["user"] == "u-json"  # one JSON object, nothing else
    assert "user_erased" in result.stderr and "u-json" not in result.stderr
    if log_format == "json":
        assert [json.loads(line)["event"] for line in result.stderr.splitlines()] == ["user_erased"]


@pytest.mark.parametrize(
    ("column", "needles"),
    [
        ("no_such_col", ("REVERIE_MEMORY_LAST_ACCESS_COLUMN=no_such_col", "has no such column")),
        ("updated_at", ("REVERIE_MEMORY_LAST_ACCESS_COLUMN", "memory table's own columns")),
    ],
)
def test_a_last_access_column_that_cannot_be_used_stops_run_and_health_in_one_line(
    pg_settings: Settings, column: str, needles: tuple[str, ...]
) -> None:
    # Said before any work: not one failed run per user, and not only once users are due.
    from sqlalchemy import func, select

    from store.db import session_scope
    from store.models import Run

    _seed_one_entry(pg_settings, "u-col")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_MEMORY_LAST_ACCESS_COLUMN": column}
    for args in (["run", "--all", "--json"], ["run"], ["health"]):
        result = run(args, env=env)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert_one_line_error(result, *needles)
        assert result.stdout == ""
    with session_scope(pg_settings) as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 0


def test_the_memory_columns_a_last_access_column_may_not_be_are_the_tables_own() -> None:
    from store.models import memory_table
    from worker.settings import EDDI_MEMORY_COLUMNS

    assert {column.name for column in memory_table().columns} == EDDI_MEMORY_COLUMNS


# -- reverie health: what the container healthchecks run ------------------------------------


def test_health_is_green_on_a_migrated_database(pg_settings: Settings, redis_url: str) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": redis_url}
    result = run(["health", "--broker"], env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("healthy: database at revision ")


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        ([], {"REVERIE_DATABASE_URL": "postgresql://postgres:s3cret@127.0.0.1:1/nowhere"}, ("database unreachable",)),
        (["--broker"], {"REVERIE_BROKER_URL": "redis://:s3cret@127.0.0.1:1/0"}, ("broker", "does not answer")),
        (["--metrics"], {"REVERIE_METRICS_PORT": "1"}, ("/metrics", "127.0.0.1:1")),
    ],
)
def test_health_fails_in_one_line_when_a_dependency_is_down(
    pg_settings: Settings, args: list[str], env: dict[str, str], needles: tuple[str, ...]
) -> None:
    full = {"REVERIE_DATABASE_URL": pg_settings.database_url, **env}
    result = run(["health", *args], env=full)
    assert result.returncode == 1
    assert_one_line_error(result, *needles)
    assert "s3cret" not in result.stderr


def test_health_fails_on_an_unmigrated_database(tmp_path: Path) -> None:
    import sqlite3

    sqlite3.connect(tmp_path / "new.db").close()  # there, and empty
    result = run(["health"], env={"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'new.db'}"})
    assert_one_line_error(result, "run reverie migrate")


def test_on_sqlite_the_last_access_column_is_found_whatever_its_case(sqlite_settings: Settings) -> None:
    from sqlalchemy import text

    from store.db import session_scope
    from store.memories import check_memory_table
    from worker.errors import ConfigError

    with session_scope(sqlite_settings) as session:
        session.execute(text('ALTER TABLE usermemories ADD COLUMN "LastAccessed" TIMESTAMP'))
    check_memory_table(sqlite_settings.model_copy(update={"memory_last_access_column": "lastaccessed"}))
    with pytest.raises(ConfigError, match="has no such column"):
        check_memory_table(sqlite_settings.model_copy(update={"memory_last_access_column": "lastaccess"}))


def _invoke(monkeypatch: pytest.MonkeyPatch, settings: Settings, args: list[str]) -> Any:
    """``reverie ARGS`` in this process, on ``settings``' database (its settings read afresh)."""
    from typer.testing import CliRunner

    from worker.cli import app
    from worker.settings import get_settings

    monkeypatch.setenv("REVERIE_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, args)
    finally:
        get_settings.cache_clear()


def _pruned_once(settings: Settings, user: str) -> int:
    """A user with a stale global entry and a fresh one, dreamed once: the run that pruned it."""
    from tasks.dream import dream_user
    from tests.dream_seed import entry, seed

    seed(
        settings,
        [
            entry(user, "old_hobby", "chess", visibility="global", agent=None, age_days=300),
            entry(user, "home_city", "Lisbon", visibility="global", agent=None),
        ],
    )
    outcome = dream_user(settings, user)
    assert outcome.entries_pruned == 1 and outcome.run_id is not None
    return outcome.run_id


def test_restore_rebuilds_the_profiles_at_once_and_leaves_the_user_to_a_free_dream(pg_settings: Settings) -> None:
    # The restore rebuilds the profiles itself, and marks the user changed (keeping an
    # earlier mark): the dream after the dirty delay puts nothing it restored away again,
    # and rebuilds no profile.
    from sqlalchemy import select

    from store import schedule
    from store.db import session_scope
    from store.models import Profile, UserState
    from tasks.dream import dream_user
    from tests.dream_seed import entries_of

    run_id = _pruned_once(pg_settings, "u-r")

    def profile_text() -> str:
        with session_scope(pg_settings) as session:
            return str(session.scalar(select(Profile.text).where(Profile.user_id == "u-r", Profile.agent_id == "")))

    assert "chess" not in profile_text()
    with session_scope(pg_settings) as session:  # a change before the restore: its mark stays
        schedule.mark_dirty(session, pg_settings, "u-r")
        marked = session.scalar(select(UserState.dirty_since).where(UserState.user_id == "u-r"))
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = run(["restore", "--run", str(run_id)], env=env)
    assert result.returncode == 0, result.stderr
    assert "restored 1 entries" in result.stdout and "1 profiles rebuilt" in result.stdout
    assert "- old hobby: chess" in profile_text()
    with session_scope(pg_settings) as session:
        assert session.scalar(select(UserState.dirty_since).where(UserState.user_id == "u-r")) == marked
    outcome = dream_user(pg_settings, "u-r")
    assert (outcome.entries_pruned, outcome.entries_summarized, outcome.profiles_built) == (0, 0, 0)
    assert "old_hobby" in {row["key"] for row in entries_of(pg_settings, "u-r").values()}


def test_erase_user_waits_for_a_dream_under_way_and_says_so(pg_settings: Settings) -> None:
    # A dream holds the user (renewing its lease): the erasure says it waits, and by
    # default waits as long as a healthy dream can run (not one lease, which a chunk
    # renews). Given up, it names the user as typed and erases nothing.
    from datetime import timedelta as span

    from sqlalchemy import func, select

    from store import locks
    from store.db import session_scope
    from store.memories import table_for
    from tasks.dream import DREAM_TIME_LIMIT_SECONDS
    from tasks.erase import lease_wait
    from tests.dream_seed import entry, seed

    assert lease_wait(pg_settings) > DREAM_TIME_LIMIT_SECONDS
    seed(pg_settings, [entry("busy user", "home_city", "Lisbon")])
    with session_scope(pg_settings) as session:
        assert locks.acquire(session, "busy user", "a-dream", span(minutes=10))
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = run(["erase-user", "busy user", "--yes", "--wait", "1"], env=env)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "waiting for the dream of user 'busy user' under way to end (up to 1 s)..." in lines
    assert (
        lines[-1]
        == "reverie: error: a dream of user 'busy user' was still running after 1 s: nothing erased; try again later"
    )
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        assert session.scalar(select(func.count()).select_from(table)) == 1
    assert run(["erase-user", "busy user", "--yes", "--wait", "-1"], env=env).returncode == 2


def test_a_restore_that_dies_before_its_profile_rebuild_leaves_the_user_to_a_dream_soon(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Killed between the restore's commit and the profiles' rebuild: the user is marked
    # changed by the restore itself, so a dream after the dirty delay rebuilds them (not
    # the scheduled one, a day away).
    from sqlalchemy import select

    from store import schedule
    from store.db import session_scope
    from store.models import UserState
    from store.types import db_now
    from worker.cli import dream_cmds

    run_id = _pruned_once(pg_settings, "u-k")

    def killed(*_: object) -> None:
        raise SystemExit(137)

    monkeypatch.setattr(dream_cmds, "_rebuild_profiles", killed)
    result = _invoke(monkeypatch, pg_settings, ["restore", "--run", str(run_id)])
    assert result.exit_code == 137
    with session_scope(pg_settings) as session:
        assert session.scalar(select(UserState.dirty_since).where(UserState.user_id == "u-k")) is not None
        later = db_now(session) + timedelta(seconds=pg_settings.dispatch_dirty_delay_seconds + 1)
        assert "u-k" in schedule.due_user_ids(session, later, 10, pg_settings)


def test_a_restore_during_a_dream_leaves_the_user_marked_after_that_dream_ends(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dream holds the user (started after an earlier change), the restore commits, and
    # the dream ends before the restore rebuilds the profiles: the user stays marked, for
    # the dream may have read the rows before the restore.
    from sqlalchemy import select

    from store import locks, schedule
    from store.db import session_scope
    from store.models import UserState
    from store.types import db_now
    from worker.cli import dream_cmds

    run_id = _pruned_once(pg_settings, "u-d")
    with session_scope(pg_settings) as session:
        schedule.mark_dirty(session, pg_settings, "u-d")  # an earlier change
    with session_scope(pg_settings) as session:
        dream_started = db_now(session)
        assert locks.acquire(session, "u-d", "a-dream", timedelta(minutes=10))
    rebuild = dream_cmds._rebuild_profiles

    def the_dream_ends_first(settings: Settings, users: Any) -> Any:
        with session_scope(pg_settings) as session:
            schedule.mark_dreamed_many(session, {"u-d": dream_started + timedelta(days=1)}, dream_started)
            locks.release(session, "u-d", "a-dream")
        return rebuild(settings, users)

    monkeypatch.setattr(dream_cmds, "_rebuild_profiles", the_dream_ends_first)
    result = _invoke(monkeypatch, pg_settings, ["restore", "--run", str(run_id)])
    assert result.exit_code == 0, result.output
    with session_scope(pg_settings) as session:
        assert session.scalar(select(UserState.dirty_since).where(UserState.user_id == "u-d")) is not None


def test_a_restore_leaves_model_written_profiles_to_the_model_at_the_next_dream(pg_settings: Settings) -> None:
    # The restore rebuilds at once, with no model call (deterministic); the model writes
    # those profiles again at the user's next dream, not only after the next change.
    from sqlalchemy import select

    from store.db import session_scope
    from store.models import Profile
    from tasks.dream import dream_users
    from tests.dream_seed import entry, seed

    settings = pg_settings.model_copy(update={"profile_writer": "model"})
    seed(
        settings,
        [
            entry("u-m", "old_hobby", "chess", visibility="global", agent=None, age_days=300),
            entry("u-m", "home_city", "Lisbon", visibility="global", agent=None),
        ],
    )
    [outcome] = dream_users(settings, ["u-m"])
    assert outcome.entries_pruned == 1 and outcome.run_id is not None

    def stored() -> tuple[str, str]:
        with session_scope(settings) as session:
            row = session.scalars(select(Profile).where(Profile.user_id == "u-m", Profile.agent_id == "")).one()
            return row.text, row.layout["writer"]

    assert stored()[1] == "model"
    env = {"REVERIE_DATABASE_URL": settings.database_url, "REVERIE_PROFILE_WRITER": "model"}
    result = run(["restore", "--run", str(outcome.run_id)], env=env)
    assert result.returncode == 0, result.stderr
    assert stored() == (stored()[0], "deterministic") and "- old hobby: chess" in stored()[0]
    [again] = dream_users(settings, ["u-m"])
    assert again.profiles_built == 1
    text, writer = stored()
    assert writer == "model" and "- old hobby: chess" in text


def test_a_postgresql_older_than_served_stops_run_and_health_in_one_line(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before any work, as ``reverie migrate`` does: not a profile build failing on every pass.
    import store.db
    from worker.cli import main
    from worker.settings import get_settings

    monkeypatch.setattr(store.db, "MIN_POSTGRESQL", 990000)  # as if this server were too old
    monkeypatch.setenv("REVERIE_DATABASE_URL", pg_settings.database_url)
    get_settings.cache_clear()
    try:
        for args in (["run", "--json"], ["health"]):
            with pytest.raises(SystemExit) as exited:
                main(args)
            out, err = capsys.readouterr()
            assert exited.value.code == 1, args
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "PostgreSQL 99 or newer is needed; this server is" in lines[0], err
            assert out == ""
    finally:
        get_settings.cache_clear()


# -- what a newcomer tried: refused before any work, or said plainly after it ---------------

ACTIVITY = json.dumps({"events": [{"action": "digest", "at": "2026-11-02T09:00:00Z"}]})


def _runs(settings: Settings) -> int:
    from sqlalchemy import func, select

    from store.db import session_scope
    from store.models import Run

    with session_scope(settings) as session:
        return int(session.scalar(select(func.count()).select_from(Run)) or 0)


@pytest.mark.parametrize("target", ["missing-dir/reverie.prom", "."], ids=["no directory", "a directory"])
def test_run_refuses_a_metrics_textfile_it_cannot_write_before_the_pass(
    pg_settings: Settings, tmp_path: Path, target: str
) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    assert run(["enqueue", "activity", "--user", "u1", "--payload", "-"], env=env, stdin=ACTIVITY).returncode == 0
    result = run(["run", "--user", "u1", "--json", "--metrics-textfile", str(tmp_path / target)], env=env)
    assert result.returncode == 2
    assert_one_line_error(result, "--metrics-textfile")
    # Nothing was done: the pass the file was for did not run.
    assert _runs(pg_settings) == 0
    assert json.loads(run(["signals", "list", "--json"], env=env).stdout)["status"] == "pending"


def test_run_refuses_a_metrics_textfile_that_is_a_pipe_or_device_and_leaves_it_as_it_is(
    sqlite_settings: Settings, tmp_path: Path
) -> None:
    # The file is replaced by a rename: pointed at /dev/null (to throw the metrics away)
    # it would have put a regular file in the device's place; a pipe hung the pass.
    import stat

    pipe = tmp_path / "pipe.prom"
    os.mkfifo(pipe)
    targets = [pipe]
    if os.geteuid() == 0:
        null = tmp_path / "null"
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append(null)
    seed(sqlite_settings, [entry("u1", "city", "Lisbon")])
    env = {"REVERIE_DATABASE_URL": sqlite_settings.database_url}
    for target in targets:
        result = run(["run", "--user", "u1", "--metrics-textfile", str(target)], env=env)
        assert result.returncode == 2
        assert_one_line_error(result, "--metrics-textfile", "not a regular file")
        mode = target.lstat().st_mode
        assert stat.S_ISFIFO(mode) if target == pipe else stat.S_ISCHR(mode)
    assert _runs(sqlite_settings) == 0


def test_a_payload_refused_for_a_field_never_quotes_what_the_producer_put_there(sqlite_settings: Settings) -> None:
    # The error is printed, and kept as the signal's last error after retention has
    # emptied its payload: it names the field, not its text.
    env = {"REVERIE_DATABASE_URL": sqlite_settings.database_url}
    for at in ("my pin is 4321", "12026-01-01T00:00:00"):
        payload = json.dumps({"events": [{"action": "gym", "at": at}]})
        result = run(["enqueue", "activity", "--user", "u1", "--payload", "-"], env=env, stdin=payload)
        assert_one_line_error(result, "payload.events[0].at")
        assert "4321" not in result.stderr and "12026" not in result.stderr


def test_run_whose_metrics_cannot_be_written_after_the_pass_prints_its_summary_and_says_so(
    pg_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A disk that fills during the pass: the pass is committed, its summary (and run ids,
    # which cron keeps) printed; the one error line names the metrics file.
    from typer.testing import CliRunner

    from worker import metrics_textfile
    from worker.cli import app
    from worker.settings import get_settings

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics_textfile, "write_textfile", full)
    # In this process (pytest's), not a command's own: its heap stays the collector's.
    monkeypatch.setattr("worker.heap.freeze_loaded", lambda: None)
    seed(pg_settings, [entry("u1", "city", "Lisbon")])
    monkeypatch.setenv("REVERIE_DATABASE_URL", pg_settings.database_url)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(
            app, ["run", "--user", "u1", "--user", "u-typo", "--json", "--metrics-textfile", str(tmp_path / "r.prom")]
        )
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1
    summary = json.loads(result.stdout.splitlines()[0])
    assert summary["users_processed"] == 1 and len(summary["run_ids"]) == 1
    assert "its metrics were not written to" in result.stderr and "No space left on device" in result.stderr
    # The user it did not dream is still named.
    assert "no entries and no schedule for --user u-typo" in result.stderr
    assert _runs(pg_settings) == 1


def test_run_refuses_an_empty_user(pg_settings: Settings) -> None:
    result = run(["run", "--user", ""], env={"REVERIE_DATABASE_URL": pg_settings.database_url})
    assert result.returncode == 2  # a usage error, as every command's
    assert_one_line_error(result, "--user: must not be empty")
    assert _runs(pg_settings) == 0


def test_run_names_the_users_it_does_not_know_and_makes_nothing_for_them(store_settings: Settings) -> None:
    # A typo, or a user erased since the cron line was written: dreaming one would make
    # a schedule row (and a run every interval after) for a user that is not there.
    from sqlalchemy import func, select

    from store.db import session_scope
    from store.models import UserState

    seed(store_settings, [entry("u-real", "city", "Lisbon")])
    env = {"REVERIE_DATABASE_URL": store_settings.database_url}
    result = run(["run", "--user", "u-real", "--user", "u-typo", "--json"], env=env)
    assert result.returncode == 1
    summary = json.loads(result.stdout)
    assert summary["users_processed"] == 1 and summary["users_unknown"] == ["u-typo"]
    assert len(summary["run_ids"]) == 1
    assert "not dreamed, no entries and no schedule for --user u-typo" in result.stderr
    assert "Traceback" not in result.stderr
    with session_scope(store_settings) as session:
        users = set(session.scalars(select(UserState.user_id)))
        assert users == {"u-real"}
        assert session.scalar(select(func.count()).select_from(UserState).where(UserState.user_id == "u-typo")) == 0
    assert _runs(store_settings) == 1
    # An erased user is not brought back as a schedule row either.
    assert run(["erase-user", "u-real", "--yes"], env=env).returncode == 0
    again = run(["run", "--user", "u-real"], env=env)
    assert again.returncode == 1 and "--user u-real" in again.stderr
    assert "0 dreamed" in again.stdout
    with session_scope(store_settings) as session:
        assert session.scalar(select(func.count()).select_from(UserState)) == 0
    assert _runs(store_settings) == 0  # the erasure took the user's run; the pass made none


def test_one_users_unreadable_value_fails_that_user_alone_and_the_pass_goes_on(sqlite_settings: Settings) -> None:
    # SQLite takes any text in the host's JSON column; an application wrote a bare word.
    # On the embedded store users are dreamed one by one: the one whose data breaks the
    # run fails, and the users after it are dreamed, their profiles built, the summary printed.
    from sqlalchemy import text

    from store.db import session_scope

    seed(sqlite_settings, [entry("u-a", "city", "Nice"), entry("u-b", "city", "Rome"), entry("u-c", "city", "Oslo")])
    with session_scope(sqlite_settings) as session:
        session.execute(text("UPDATE usermemories SET value = 'hello world' WHERE user_id = 'u-b'"))
    env = {"REVERIE_DATABASE_URL": sqlite_settings.database_url}
    result = run(["run", "--user", "u-a", "--user", "u-b", "--user", "u-c", "--json"], env=env)
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout)
    assert (summary["users_processed"], summary["users_failed"]) == (2, 1), summary
    assert len(summary["run_ids"]) == 3
    assert result.returncode == 1  # a failed user is a failed pass, for cron to mail
    assert "hello world" not in result.stdout + result.stderr
    for user, city in (("u-a", "Nice"), ("u-c", "Oslo")):
        shown = run(["profile", user, "--agent", "agent-a"], env=env)
        assert shown.returncode == 0 and city in shown.stdout, shown.stderr


def test_a_broker_url_that_is_not_redis_is_refused_before_a_signal_is_written(pg_settings: Settings) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": "bogus://"}
    result = run(["enqueue", "activity", "--user", "u1", "--payload", "-"], env=env, stdin=ACTIVITY)
    assert result.returncode == 1
    assert_one_line_error(result, "REVERIE_BROKER_URL", "redis://")
    listed = run(["signals", "list", "--json"], env={"REVERIE_DATABASE_URL": pg_settings.database_url})
    assert listed.stdout.strip() == ""


def test_a_broker_url_with_its_password_in_the_query_is_a_setting_error_not_a_crash(pg_settings: Settings) -> None:
    # The broker's client takes the password from the URL's own part, and fails with a
    # TypeError where the query gives it again.
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_BROKER_URL": "redis://127.0.0.1:6379/0?password=s3",
    }
    for args in (["health", "--broker"], ["enqueue", "activity", "--user", "u1", "--payload", "-"]):
        result = run(args, env=env, stdin=ACTIVITY)
        assert result.returncode == 1
        assert_one_line_error(result, "REVERIE_BROKER_URL", "password in its query")
        assert "s3" not in result.stderr


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis://:s3@127.0.0.1:99999/0", "port"),
        ("redis://:s3@127.0.0.1:abc/0", "port"),
        ("redis://:s3@127.0.0.1:6379/abc", "database number"),
    ],
    ids=["port-out-of-range", "port-not-a-number", "database-not-a-number"],
)
def test_a_broker_url_the_client_cannot_read_is_refused_before_a_signal_is_written(
    pg_settings: Settings, url: str, needle: str
) -> None:
    # Not a crash after the signal was committed (the wake-up reads the URL after it).
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": url}
    for args in (["health", "--broker"], ["enqueue", "activity", "--user", "u1", "--payload", "-"]):
        result = run(args, env=env, stdin=ACTIVITY)
        assert result.returncode == 1
        assert_one_line_error(result, "REVERIE_BROKER_URL", needle)
        assert "s3" not in result.stderr
    listed = run(["signals", "list", "--json"], env={"REVERIE_DATABASE_URL": pg_settings.database_url})
    assert listed.stdout.strip() == ""


def test_a_database_url_with_an_unescaped_at_in_its_password_is_refused_without_showing_it() -> None:
    # Read as is, the host would be the password's end, printed in the error about it.
    result = run(["health"], env={"REVERIE_DATABASE_URL": "postgresql://postgres:p@ssw0rd@127.0.0.1:5432/x"})
    assert_one_line_error(result, "REVERIE_DATABASE_URL", "%40")
    assert "ssw0rd" not in result.stderr


def test_a_payload_limit_past_what_jsonb_holds_is_a_setting_error() -> None:
    result = run(["health"], env={"REVERIE_MAX_PAYLOAD_BYTES": "9223372036854775806"})
    assert_one_line_error(result, "REVERIE_MAX_PAYLOAD_BYTES")


def test_health_of_a_broker_that_takes_the_connection_and_never_replies_fails_in_time(
    pg_settings: Settings,
) -> None:
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": f"redis://127.0.0.1:{port}/0"}
        started = time.monotonic()
        result = run(["health", "--broker"], env=env)
        took = time.monotonic() - started
    assert_one_line_error(result, "does not answer")
    assert result.returncode == 1
    assert took < 60, took  # the run() helper's own limit is 120 s; the check's, 5 s


@pytest.mark.parametrize("agent", ["", "a" * 300], ids=["empty", "too-long"])
def test_policy_show_refuses_an_agent_id_policy_set_refuses(pg_settings: Settings, agent: str) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = run(["policy", "show", agent], env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert_one_line_error(result, "agent")


@pytest.mark.parametrize("agent", ["*", ""])
def test_policy_set_refuses_the_defaults_row_and_an_empty_agent(pg_settings: Settings, agent: str) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = run(["policy", "set", agent, "enabled=false"], env=env)
    assert result.returncode == 2
    assert_one_line_error(result, "agent" if agent == "" else "'*' is not an agent")
    shown = json.loads(run(["policy", "show"], env=env).stdout)
    assert set(shown) == {"*"} and shown["*"]["enabled"] is True


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("DROP COLUMN access_count", "has no column access_count"),
        ("DROP COLUMN group_ids, DROP COLUMN conflicted", "has no column group_ids, conflicted"),
        (
            "ALTER COLUMN id DROP DEFAULT, ALTER COLUMN id TYPE uuid USING gen_random_uuid()",
            "column id is UUID; Reverie needs text",
        ),
        ("ALTER COLUMN updated_at TYPE text", "column updated_at is TEXT; Reverie needs a timestamp"),
    ],
    ids=["missing", "two-missing", "uuid-id", "text-time"],
)
def test_a_memory_table_reverie_cannot_work_on_fails_health_run_and_the_worker_up_front(
    pg_settings: Settings, change: str, said: str
) -> None:
    """A table of another layout was found only by every run and signal failing, while
    ``health`` (a readiness probe) said healthy: now each says what is wrong, at once."""
    from sqlalchemy import text as sql

    from store.db import session_scope

    with session_scope(pg_settings) as session:
        session.execute(sql("CREATE TABLE hostmem (LIKE usermemories INCLUDING ALL)"))
        session.execute(sql(f"ALTER TABLE hostmem {change}"))
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_MEMORY_TABLE": "hostmem",
        "REVERIE_LOG_HASH_KEY": "a-secret-of-the-tests-own-0123456789",
    }
    try:
        # migrate too: it exited 0 and scheduled the table's users for workers that refuse it.
        for args in (["health"], ["run", "--all"], ["migrate"]):
            result = run(args, env=env)
            assert result.returncode == 1, (args, result.stdout)
            assert_one_line_error(result, "the memory table hostmem", said)
            assert "scheduled" not in result.stdout
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql("DROP TABLE hostmem"))


def test_a_memory_table_with_domain_types_passes_the_check(pg_settings: Settings) -> None:
    """A domain is judged by its base type: a table Reverie works on is not refused."""
    from sqlalchemy import text as sql

    from store.db import session_scope

    with session_scope(pg_settings) as session:
        session.execute(sql("CREATE DOMAIN ktext AS text"))
        session.execute(sql("CREATE DOMAIN kstamp AS timestamp"))
        session.execute(sql("CREATE TABLE hostmem (LIKE usermemories INCLUDING ALL)"))
        session.execute(sql("ALTER TABLE hostmem ALTER COLUMN user_id TYPE ktext, ALTER COLUMN updated_at TYPE kstamp"))
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_MEMORY_TABLE": "hostmem",
        "REVERIE_LOG_HASH_KEY": "a-secret-of-the-tests-own-0123456789",
    }
    try:
        result = run(["health"], env=env)
        assert result.returncode == 0, result.stderr
    finally:
        with session_scope(pg_settings) as session:
            session.execute(sql("DROP TABLE hostmem"))
            session.execute(sql("DROP DOMAIN ktext"))
            session.execute(sql("DROP DOMAIN kstamp"))


def test_health_fails_when_the_memory_table_it_is_set_to_does_not_exist(pg_settings: Settings) -> None:
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_MEMORY_TABLE": "othertable",
        "REVERIE_LOG_HASH_KEY": "a-secret-of-the-tests-own-0123456789",
    }
    result = run(["health"], env=env)
    assert result.returncode == 1
    assert_one_line_error(result, "othertable does not exist", "REVERIE_MEMORY_TABLE")
    # The work commands say the same, not "run reverie migrate" (a migrated database:
    # migrate would not make the misnamed table, and must not be the advice).
    for args in (["run"], ["run", "--all", "--json"]):
        work = run(args, env=env)
        assert_one_line_error(work, "othertable does not exist", "REVERIE_MEMORY_TABLE")
        assert "migrate`" not in work.stderr and "run reverie migrate" not in work.stderr
    assert run(["health"], env={"REVERIE_DATABASE_URL": pg_settings.database_url}).returncode == 0


def test_retry_all_dead_with_none_says_nothing_changed(pg_settings: Settings) -> None:
    result = run(["signals", "retry", "--all-dead"], env={"REVERIE_DATABASE_URL": pg_settings.database_url})
    assert result.returncode == 0
    assert result.stdout.strip() == "no dead signal; nothing changed"


@pytest.mark.parametrize("path", [".", "missing-dir/demo.db"], ids=["a directory", "no directory"])
def test_demo_refuses_a_path_it_cannot_create(tmp_path: Path, path: str) -> None:
    result = run(["demo", "--path", path], cwd=tmp_path)
    assert result.returncode == 2
    assert_one_line_error(result, "--path")


@pytest.mark.parametrize("archive", ["365", "0"])
def test_events_kept_shorter_than_the_archive_are_refused(tmp_path: Path, archive: str) -> None:
    # A restore reads the events of what it undoes: with the events purged first, it left
    # in the summaries it should take out, and kept the values it should put back.
    env = {"REVERIE_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}", "REVERIE_ARCHIVE_RETENTION_DAYS": archive}
    result = run(["migrate"], env=env)
    assert result.returncode == 1
    assert_one_line_error(result, "REVERIE_EVENT_RETENTION_DAYS", "REVERIE_ARCHIVE_RETENTION_DAYS")
    assert run(["migrate"], env={**env, "REVERIE_EVENT_RETENTION_DAYS": "0"}).returncode == 0


def _policy_show_failing(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failing: object
) -> str:
    """``reverie policy show`` (in this process) with its read replaced by ``failing``;
    asserts exit 1 and returns stderr."""
    from store import policies
    from worker.cli import main
    from worker.settings import get_settings

    monkeypatch.setattr(policies, "all_configs", failing)
    monkeypatch.setenv("REVERIE_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["policy", "show"])
    finally:
        get_settings.cache_clear()
    assert exited.value.code == 1
    return capsys.readouterr().err


def test_a_database_error_a_command_meets_names_its_sqlstate_and_never_the_value_it_quotes(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # PostgreSQL's message quotes the value it refused ("invalid input syntax for type
    # integer: ..."), and a cron job's output is mailed and kept like a log.
    from sqlalchemy import text

    def refused(session: object, *_: object) -> object:
        return session.execute(text("SELECT CAST(:v AS integer)"), {"v": "zq-secret-value-qz"})  # type: ignore[attr-defined]

    err = _policy_show_failing(pg_settings, monkeypatch, capsys, refused)
    lines = [line for line in err.splitlines() if line.startswith("reverie: error: ")]
    assert len(lines) == 1, err
    assert "database error" in lines[0] and "SQLSTATE 22P02" in lines[0] and "InvalidTextRepresentation" in lines[0]
    assert "zq-secret-value-qz" not in err


def test_an_unexpected_error_names_its_type_and_where_not_its_message(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*_: object) -> object:
        raise ValueError("could not read zq-secret-value-qz")

    err = _policy_show_failing(pg_settings, monkeypatch, capsys, broken)
    assert "reverie: error: unexpected ValueError at " in err and "zq-secret-value-qz" not in err


def test_a_failed_connection_names_the_server_and_other_driver_errors_quote_nothing() -> None:
    import psycopg
    import sqlalchemy
    from sqlalchemy.exc import OperationalError

    from worker.cli.common import describe_error

    engine = sqlalchemy.create_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    with pytest.raises(OperationalError) as refused:
        engine.connect()
    said = describe_error(refused.value)
    assert said.startswith("database error: connection failed") and '"127.0.0.1", port 1' in said
    # Without a SQLSTATE, but not about the connection: the quoted text is taken out.
    mid = OperationalError("SELECT 1", {}, psycopg.OperationalError('server said "zq-secret-value-qz"'))
    assert "zq-secret-value-qz" not in describe_error(mid) and "database error" in describe_error(mid)


def test_sqlalchemys_own_error_repeating_a_drivers_message_quotes_nothing() -> None:
    from sqlalchemy.exc import PendingRollbackError

    from worker.cli.common import describe_error

    said = describe_error(
        PendingRollbackError(
            "This Session's transaction has been rolled back due to a previous exception during flush. "
            'Original exception was: invalid input syntax for type integer: "zq-secret-value-qz"'
        )
    )
    assert said.startswith("database error: PendingRollbackError: This Session's transaction")
    assert "zq-secret-value-qz" not in said


def test_the_readmes_first_signal_queued_without_an_agent_shows_in_every_profile(store_settings: Settings) -> None:
    # The README's SQL example names no agent: the facts it yields belong to no agent, so
    # no agent's privacy keeps them out of a profile, and every profile shows them.
    from sqlalchemy import text

    from store.db import session_scope

    seed(store_settings, [entry("user-42", "pet", "a cat named Miso", visibility="self", agent="writer")])
    with session_scope(store_settings) as session:
        session.execute(
            text(
                "INSERT INTO dream_signals (kind, user_id, payload, idempotency_key) VALUES ('session_end', "
                '\'user-42\', \'{"conversation_id": "c1", "messages": [{"role": "user", "content": '
                "\"My favorite color is blue\"}]}', 'session_end:c1')"
            )
        )
    env = {"REVERIE_DATABASE_URL": store_settings.database_url}
    done = run(["run", "--json"], env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["users_processed"] == 1
    with session_scope(store_settings) as session:
        owners = session.execute(
            text("SELECT visibility, source_agent_id FROM usermemories WHERE user_id = 'user-42' AND key <> 'pet'")
        ).all()
    assert owners and all(owner is None for _, owner in owners), owners
    alone = run(["profile", "user-42"], env=env)
    assert alone.returncode == 0 and "blue" in alone.stdout and "Miso" not in alone.stdout, alone.stdout
    writer = run(["profile", "user-42", "--agent", "writer", "--json"], env=env)
    shown = json.loads(writer.stdout)
    assert "blue" in shown["text"] and "Miso" in shown["text"], shown
    other = run(["profile", "user-42", "--agent", "planner"], env=env)
    assert "blue" in other.stdout and "Miso" not in other.stdout


@pytest.mark.parametrize(
    ("query", "named"), [("sslmode=bogus", 'invalid sslmode value: "bogus"'), ("foo=bar", '"foo"')]
)
def test_a_connection_option_the_driver_refuses_is_named_in_one_line(query: str, named: str) -> None:
    url = f"postgresql://postgres:s3cret-pw@127.0.0.1:5432/postgres?{query}"
    result = run(["health"], env={"REVERIE_DATABASE_URL": url})
    assert_one_line_error(result, "REVERIE_DATABASE_URL", named)
    assert "s3cret-pw" not in result.stderr


@pytest.mark.parametrize(
    ("stored", "why"),
    [("Bobby-the-secret", "is not valid JSON"), ("[" * 1100 + "]" * 1100, "is nested deeper than Reverie reads")],
    ids=["not-json", "too-deep"],
)
def test_a_value_sqlite_holds_that_is_not_json_fails_its_users_work_in_words_and_is_left_as_it_is(
    tmp_path: Path, stored: str, why: str
) -> None:
    # SQLite does not check its JSON column: a host may write text that is not JSON. The
    # user's run fails, saying so (never quoting the value), nothing of theirs is
    # rewritten or archived, the other users are dreamed; a signal for that user fails
    # and waits for another attempt (not dead at once); once the row is mended, the
    # user is dreamed and the signal done.
    import sqlite3

    db = tmp_path / "r.db"
    env = {"REVERIE_DATABASE_URL": f"sqlite:///{db}", "REVERIE_SUMMARIZE_INTERACTIONS": "false"}
    assert run(["migrate"], env=env).returncode == 0
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO usermemories (id, user_id, key, value, visibility) VALUES (?, ?, ?, ?, 'global')",
            [("b1", "bob", "name", stored), ("b2", "bob", "city", '"Paris"'), ("a1", "alice", "city", '"Rome"')],
        )
    said = '{"conversation_id": "c1", "messages": [{"role": "user", "content": "My favorite color is blue"}]}'
    assert run(["enqueue", "session_end", "--user", "bob", "--payload", "-"], env=env, stdin=said).returncode == 0
    done = run(["run", "--all", "--json"], env=env)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert (report["users_processed"], report["users_failed"], report["signals_failed"]) == (1, 1, 1), report
    assert len(report["errors"]) == 1 and f"a value in the database {why}" in report["errors"][0], report
    assert ("json_valid" in report["errors"][0]) == (why == "is not valid JSON")
    assert "Bobby" not in done.stdout + done.stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM usermemories WHERE id = 'b1'").fetchone() == (stored,)
        assert conn.execute("SELECT count(*) FROM dream_archive").fetchone() == (0,)
        status, last_error = conn.execute("SELECT status, last_error FROM dream_signals").fetchone()
        assert status == "failed" and f"a value in the database {why}" in last_error, (status, last_error)
        assert last_error.startswith("a value in the database"), last_error  # the host's row, not a bug
        if why == "is not valid JSON":
            # The query the message gives finds the row.
            found = conn.execute("SELECT id, user_id, key FROM usermemories WHERE NOT json_valid(value)").fetchall()
            assert found == [("b1", "bob", "name")]
        conn.execute("UPDATE usermemories SET value = '\"Bobby\"' WHERE id = 'b1'")
        # The signal's next attempt is due now, not after its back-off.
        conn.execute("UPDATE dream_signals SET available_at = CURRENT_TIMESTAMP")
    again = run(["run", "--user", "bob", "--json"], env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout)["users_processed"] == 1
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT status FROM dream_signals").fetchone() == ("done",)
    shown = run(["profile", "bob"], env=env)
    assert shown.returncode == 0 and "- name: Bobby" in shown.stdout and "blue" in shown.stdout, shown.stdout


def test_a_jsonb_value_nested_deeper_than_python_reads_fails_its_users_run_in_words(pg_settings: Settings) -> None:
    import psycopg

    deep = "[" * 1100 + "]" * 1100
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO usermemories (user_id, key, value, visibility) VALUES ('bob', 'deep', %s::jsonb, 'global')",
            (deep,),
        )
    done = run(["run", "--user", "bob", "--json"], env={"REVERIE_DATABASE_URL": pg_settings.database_url})
    assert done.returncode == 1, done.stderr
    errors = json.loads(done.stdout)["errors"]
    assert len(errors) == 1 and "a value in the database is nested deeper than Reverie reads" in errors[0], errors


def test_a_cron_pass_that_leaves_a_signal_dead_exits_1_and_says_so(pg_settings: Settings) -> None:
    # An unpriced model is a permanent error: the signal is dead at once, and nothing
    # tries it again until an operator does. A cron job must not look green.
    import psycopg

    with psycopg.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('session_end', 'u1', "
            '\'{"conversation_id": "c1", "messages": [{"role": "user", "content": "My city is Rome"}]}\')'
        )
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_LLM_MODEL": "acme/unknown-model-9"}
    done = run(["run", "--json"], env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout)["signals_dead"] == 1
    said = [line for line in done.stderr.splitlines() if line.startswith("reverie: ")]
    assert said == [
        "reverie: 1 signal(s) ended dead in this pass "
        "(`reverie signals list --status dead` says why; `reverie signals retry` once mended)"
    ], done.stderr
    listed = run(["signals", "list", "--status", "dead", "--json"], env=env)
    assert listed.returncode == 0 and "permanent model error" in listed.stdout, listed.stdout
    # The next pass, with nothing new dead, is green again.
    again = run(["run", "--json"], env=env)
    assert again.returncode == 0, again.stderr


def test_a_payload_on_standard_input_that_is_not_utf8_is_said_so(pg_settings: Settings) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    env["REVERIE_DATABASE_URL"] = pg_settings.database_url
    done = subprocess.run(
        [*REVERIE, "enqueue", "activity", "--user", "u", "--payload", "-"],
        input=b'{"events": [], "note": "caf\xe9"}',
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.decode().strip().splitlines() == ["reverie: error: payload - is not UTF-8 text"]


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_a_worker_or_beat_without_a_broker_refuses_to_start(
    command: str, pg_settings: Settings, tmp_path: Path
) -> None:
    """An empty broker URL is cron mode: Celery would otherwise take its own default
    broker (an AMQP server on localhost) and send there without a word."""
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": ""}
    result = run([command], env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, "REVERIE_BROKER_URL is empty", "reverie run")
    # Started as Celery's own command, as the README also shows: it stops too.
    started = _celery(["-A", "worker.app", command, "--loglevel", "INFO"], env, tmp_path)
    assert started.returncode != 0
    output = started.stdout + started.stderr
    assert "REVERIE_BROKER_URL is empty" in output and "amqp://" not in output, output[-2000:]
    assert "Traceback" not in output and list(tmp_path.iterdir()) == []  # no beat state left either
    # Celery's own options in front of the command: still no broker, still refused.
    workdir = _celery(["--workdir", str(tmp_path), "-A", "worker.app", command], env, tmp_path)
    assert workdir.returncode != 0 and "REVERIE_BROKER_URL is empty" in workdir.stdout + workdir.stderr


def _celery(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m celery ARGS`` with ``env`` over this environment less its REVERIE_ variables."""
    return subprocess.run(
        [sys.executable, "-m", "celery", *args],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}, **env},
        cwd=cwd,
        timeout=120,
        check=False,
    )


def test_a_broker_given_on_celerys_command_line_is_a_broker(pg_settings: Settings, tmp_path: Path) -> None:
    # `celery -b URL` (or CELERY_BROKER_URL) with REVERIE_BROKER_URL empty: Celery uses
    # that broker, and the worker starts (it is stopped once it says it is ready).
    from tests.processes import free_port

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REVERIE_") and k != "CELERY_BROKER_URL"},
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_BROKER_URL": "",
        "REVERIE_METRICS_PORT": str(free_port()),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    broker = os.environ.get("REVERIE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    argv = [sys.executable, "-m", "celery", "-A", "worker.app", "-b", broker, "worker", "-Q", "signals"]
    argv += ["-c", "1", "-P", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "ready." in line or len(seen) > 400:
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    output = "".join(seen)
    assert "ready." in output and "REVERIE_BROKER_URL is empty" not in output, output[-2000:]


def test_health_of_the_broker_without_one_is_an_error(pg_settings: Settings) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": ""}
    result = run(["health", "--broker"], env=env)
    assert result.returncode == 1
    assert_one_line_error(result, "no broker: REVERIE_BROKER_URL is empty")


def test_beat_with_a_state_file_it_cannot_write_is_a_usage_error(tmp_path: Path) -> None:
    result = run(["beat", "--schedule", str(tmp_path / "missing" / "beat-state")])
    assert result.returncode == 2
    assert_one_line_error(result, "--schedule", "does not exist")


def test_only_celerys_worker_and_beat_commands_count_as_started_without_a_broker() -> None:
    from worker.celery_hooks import _celery_command

    python_m = ["/venv/lib/python3.11/site-packages/celery/__main__.py"]  # python -m celery
    assert _celery_command(["/usr/bin/celery", "-A", "worker.app", "beat", "-s", "x"]) == "beat"
    assert _celery_command([*python_m, "--app=worker.app", "-q", "worker", "-Q", "beat"]) == "worker"
    assert _celery_command(["/usr/bin/celery", "-A", "worker.app", "inspect", "active"]) == "inspect"
    # A user named so, in another command, or another module run with -m: not a worker or beat.
    assert _celery_command(["/usr/local/bin/reverie", "run", "--user", "beat"]) is None
    assert _celery_command(["/repo/tests/__main__.py", "-k", "beat"]) is None


def test_a_misspelled_setting_is_named_at_the_start_of_a_pass(pg_settings: Settings) -> None:
    # A misspelled cap keeps the default cap: the pass says which variables no setting reads.
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_MAX_COST_PER_DAYY": "3",
        "reverie_max_cost_per_run": "0.5",  # read: the names are not case-sensitive
        "REVERIE_TEST_ANYTHING": "x",  # the test suite's own
        "REVERIE_LOG_FORMAT": "json",
    }
    result = run(["run", "--json"], env=env)
    assert result.returncode == 0, result.stderr
    warned = [json.loads(line) for line in result.stderr.splitlines() if '"unknown_settings"' in line]
    assert len(warned) == 1, result.stderr
    assert warned[0]["names"] == ["REVERIE_MAX_COST_PER_DAYY"] and warned[0]["level"] == "warning"
    quiet = run(["run", "--json"], env={k: v for k, v in env.items() if k != "REVERIE_MAX_COST_PER_DAYY"})
    assert "unknown_settings" not in quiet.stderr


def test_a_misspelled_setting_in_the_settings_file_is_named_too(pg_settings: Settings, tmp_path: Path) -> None:
    # Settings come from the environment or a .env file: a misspelling in either is named.
    (tmp_path / ".env").write_text("REVERIE_MAX_COST_PER_DAYS=1\nREVERIE_LOG_FORMAT=json\n", encoding="utf-8")
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url}
    result = run(["run", "--json"], env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warned = [json.loads(line) for line in result.stderr.splitlines() if '"unknown_settings"' in line]
    assert [w["names"] for w in warned] == [["REVERIE_MAX_COST_PER_DAYS"]], result.stderr


def test_run_names_a_user_it_was_asked_for_and_another_run_holds(pg_settings: Settings) -> None:
    # A worker's run (or another pass) holds u-held: `run --user` did not dream them, so
    # it says so and does not exit 0; the user it could dream is dreamed.
    from datetime import timedelta

    from store import locks
    from store.db import session_scope

    seed(pg_settings, [entry("u-held", "city", "Lisbon"), entry("u-free", "city", "Porto")])
    with session_scope(pg_settings) as session:
        assert locks.acquire(session, "u-held", "another-run", timedelta(minutes=10))
    result = run(
        ["run", "--user", "u-held", "--user", "u-free", "--json"],
        env={"REVERIE_DATABASE_URL": pg_settings.database_url},
    )
    assert result.returncode == 1, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["users_processed"], summary["users_skipped"]) == (1, 1)
    assert "busy" not in summary
    assert "reverie: not dreamed, another run holds --user u-held (" in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["worker", "-l", "bogus"], 2, "--loglevel 'bogus'"),
        (["beat", "--loglevel", "loud"], 2, "--loglevel 'loud'"),
        (["worker", "-Q", ""], 2, "a queue name is empty"),
        (["worker", "-Q", "signals,,dreams"], 2, "a queue name is empty"),
    ],
)
def test_a_bad_log_level_or_queue_name_is_a_usage_error_of_reverie_not_of_celery(
    args: list[str], code: int, needle: str, pg_settings: Settings, tmp_path: Path
) -> None:
    env = {"REVERIE_DATABASE_URL": pg_settings.database_url, "REVERIE_BROKER_URL": "redis://127.0.0.1:1/0"}
    result = run(args, env=env, cwd=tmp_path)
    assert result.returncode == code
    assert_one_line_error(result, needle)
    assert "celery" not in result.stderr


@pytest.mark.parametrize("command", [["run"], ["migrate"], ["worker"], ["beat"], ["health"]])
def test_a_bad_log_level_setting_stops_any_command_naming_the_variable(
    command: list[str], pg_settings: Settings, tmp_path: Path
) -> None:
    """Else `reverie run` ran at INFO without a word, and a worker or beat stopped with
    Celery's usage text for `-l`, which the operator never typed."""
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_BROKER_URL": "redis://127.0.0.1:1/0",
        "REVERIE_LOG_LEVEL": "bogus",
    }
    result = run(command, env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, "REVERIE_LOG_LEVEL", "DEBUG, INFO, WARNING, ERROR, CRITICAL")
    # Any case, as before: a lower-case level is a level.
    fine = run(["health"], env={**env, "REVERIE_LOG_LEVEL": "warning"}, cwd=tmp_path)
    assert fine.returncode == 0, fine.stderr


def test_an_error_names_the_database_url_as_the_operator_wrote_it() -> None:
    # The settings make a postgresql:// URL the driver's postgresql+psycopg://; a message
    # shows the one the operator set (its password masked).
    result = run(["health"], env={"REVERIE_DATABASE_URL": "postgresql://app:s3cret@127.0.0.1:1/app"})
    assert_one_line_error(result, "database unreachable at postgresql://app:***@127.0.0.1:1/app")
    assert "s3cret" not in result.stderr and "+psycopg" not in result.stderr


@pytest.mark.parametrize("addr", ["0.0.0.0:9540", "http://0.0.0.0", "-bad-", "a b", "9100", "1.2.3"])
def test_a_metrics_address_no_server_can_listen_on_stops_the_worker_naming_the_variable(
    addr: str, pg_settings: Settings, tmp_path: Path
) -> None:
    """Else the worker started, served no /metrics, and said so in one log line only."""
    env = {
        "REVERIE_DATABASE_URL": pg_settings.database_url,
        "REVERIE_BROKER_URL": "redis://127.0.0.1:1/0",
        "REVERIE_METRICS_ADDR": addr,
    }
    for command in (["worker"], ["health"]):
        result = run(command, env=env, cwd=tmp_path)
        assert result.returncode == 1
        assert_one_line_error(result, "REVERIE_METRICS_ADDR", "without a port")
    for fine in ("127.0.0.1", "::", "localhost", "metrics.internal"):
        assert run(["health"], env={**env, "REVERIE_METRICS_ADDR": fine}, cwd=tmp_path).returncode == 0, fine
