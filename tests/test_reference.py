"""``docs/reference.md`` keeps up with the code.

Every setting, metric family (with its type, labels and the label values known in
advance), command and option, ``dream_`` table, signal schema, policy field and signal
status is in the reference; nothing it lists has left the code; and the SQL it gives
producers runs on PostgreSQL as it says. Each failure names what is missing and where
it belongs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import typer.main
from prometheus_client.metrics import MetricWrapperBase

from store.models import SIGNAL_STATUSES, Base
from worker import metrics
from worker.cli import app
from worker.payloads import KINDS
from worker.policy import FIELD_NAMES
from worker.producer import enqueue_signal
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
NAME = "docs/reference.md"


def section(title: str, level: int = 2) -> str:
    """The text under the heading ``title`` (of ``level``), up to the next heading of
    that level or above."""
    text = REFERENCE.read_text("utf-8")
    marks = "#" * level
    match = re.search(rf"^{marks} {re.escape(title)}\n(.*?)(?=^#{{1,{level}}} |\Z)", text, re.M | re.S)
    assert match is not None, f"{NAME} has no '{marks} {title}' section"
    return match.group(1)


def table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows whose first cell is one backquoted name: name -> the other cells."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"`[^`]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_every_setting_has_a_row_and_every_row_a_setting() -> None:
    rows = table_rows(section("Settings"))
    fields = {f"REVERIE_{name.upper()}": info for name, info in Settings.model_fields.items()}
    missing = [
        f"{env} (Settings.{env.removeprefix('REVERIE_').lower()}, default {info.default!r})"
        for env, info in fields.items()
        if env not in rows
    ]
    assert not missing, f"{NAME}, section 'Settings', has no `| \\`REVERIE_...\\` | default | meaning |` row for: " + (
        "; ".join(missing)
    )
    stale = sorted(set(rows) - set(fields))
    assert not stale, f"{NAME}, section 'Settings', documents settings worker/settings.py no longer has: {stale}"


def _families() -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(exposed name, type, label names) of every family defined in worker.metrics."""
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            kind = value._type
            name = value._name + "_total" if kind == "counter" else value._name
            yield name, kind, tuple(value._labelnames)


def test_every_metric_family_has_its_type_and_labels() -> None:
    rows = table_rows(section("Metrics"))
    families = list(_families())
    assert len(families) >= 14, "worker.metrics defines fewer families than the reference test expects to find"
    problems: list[str] = []
    for name, kind, labels in families:
        row = rows.get(name)
        if row is None:
            problems.append(f"no row for {name} ({kind}, labels {', '.join(labels) or 'none'})")
            continue
        if row[0] != kind:
            problems.append(f"{name} is a {kind}, the row says {row[0]!r}")
        documented = re.findall(r"`([^`]+)`", row[1])
        if sorted(documented) != sorted(labels):
            problems.append(f"{name} has labels {list(labels)}, the row lists {documented}")
    stale = sorted(set(rows) - {name for name, _kind, _labels in families})
    if stale:
        problems.append(f"rows for families worker.metrics no longer defines: {stale}")
    assert not problems, f"{NAME}, section 'Metrics': " + "; ".join(problems)


def test_every_label_value_known_in_advance_is_listed() -> None:
    text = section("Metrics")
    known = {
        "kind": KINDS,
        "outcome (signals)": metrics.SIGNAL_OUTCOMES,
        "source": metrics.MEMORY_WRITE_SOURCES,
        "action": metrics.MEMORY_WRITE_ACTIONS,
        "purpose": metrics.LLM_PURPOSES,
        "direction": metrics.LLM_DIRECTIONS,
        "outcome (model calls)": metrics.LLM_OUTCOMES,
        "scope": metrics.BUDGET_SCOPES,
        "verdict": metrics.PROFILE_VERDICTS,
    }
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    problems = []
    for label, values in known.items():
        row = rows.get(label)
        if row is None:
            problems.append(f"no `| {label} | values |` row")
            continue
        absent = [value for value in values if f"`{value}`" not in row]
        if absent:
            problems.append(f"the {label} row lacks {absent}")
    assert not problems, f"{NAME}, section 'Metrics', label values: " + "; ".join(problems)


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    # Duck-typed: the command-line framework may carry a click of its own, whose Group
    # is not the installed click's.
    subcommands = getattr(command, "commands", None)
    if subcommands is not None:
        for name, sub in sorted(subcommands.items()):
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), command


def test_every_command_and_option_is_documented() -> None:
    text = section("Command line")
    problems: list[str] = []
    commands = list(_commands(typer.main.get_command(app), ("reverie",)))
    assert len(commands) >= 13, "the command tree is smaller than the reference test expects"
    for path, command in commands:
        match = re.search(rf"^### `{re.escape(path)}`\n(.*?)(?=^### |\Z)", text, re.M | re.S)
        if match is None:
            problems.append(f"no '### `{path}`' heading")
            continue
        body = match.group(1)
        for param in command.params:
            flags = [opt for opt in (*param.opts, *param.secondary_opts) if opt.startswith("-")]
            absent = [flag for flag in flags if flag != "--help" and not mentions(body, flag)]
            if absent:
                problems.append(f"`{path}` does not mention {', '.join(absent)}")
    headings = set(re.findall(r"^### `(reverie[^`]*)`", text, re.M))
    stale = sorted(headings - {path for path, _command in commands})
    if stale:
        problems.append(f"headings for commands the CLI no longer has: {stale}")
    assert not problems, f"{NAME}, section 'Command line': " + "; ".join(problems)


def test_every_dream_table_of_the_models_is_documented() -> None:
    rows = table_rows(section("Reverie's tables"))
    tables = sorted(name for name in Base.metadata.tables if name.startswith("dream_"))
    missing = [name for name in tables if name not in rows]
    assert not missing, f'{NAME}, section "Reverie\'s tables", has no `| \\`table\\` | holds |` row for: {missing}'


def test_every_dream_table_a_migrated_database_has_is_documented(pg_settings: Settings) -> None:
    rows = table_rows(section("Reverie's tables"))
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", "")) as conn:
        present = {
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'dream\\_%'"
            )
        }
    assert {"dream_signals", "dream_alembic_version"} <= present, f"not a migrated database: {sorted(present)}"
    missing = sorted(present - set(rows))
    assert not missing, f'{NAME}, section "Reverie\'s tables": reverie migrate creates {missing}, which have no row'
    documented = {name for name in rows if name.startswith("dream_")}
    stale = sorted(documented - present)
    assert not stale, f'{NAME}, section "Reverie\'s tables", documents tables reverie migrate does not create: {stale}'


def test_every_signal_schema_is_linked() -> None:
    text = REFERENCE.read_text("utf-8")
    schemas = sorted(path.name for path in (ROOT / "worker" / "schemas").glob("*.json"))
    assert schemas, "worker/schemas holds no schema"
    missing = [name for name in schemas if f"(../worker/schemas/{name})" not in text]
    assert not missing, f"{NAME} does not link these schemas as (../worker/schemas/NAME): {missing}"
    for name in schemas:
        assert json.loads((ROOT / "worker" / "schemas" / name).read_text("utf-8"))["$schema"].endswith("2020-12/schema")


def test_every_policy_field_and_signal_status_is_documented() -> None:
    fields = table_rows(section("Per-agent policies"))
    missing = [name for name in FIELD_NAMES if name not in fields]
    assert not missing, f"{NAME}, section 'Per-agent policies', has no row for the policy fields {missing}"
    stale = sorted(set(fields) - set(FIELD_NAMES))
    assert not stale, f"{NAME}, section 'Per-agent policies', documents fields worker/policy.py does not have: {stale}"
    statuses = table_rows(section("Statuses", level=3))
    missing = [status for status in SIGNAL_STATUSES if status not in statuses]
    assert not missing, f"{NAME}, section 'Statuses', has no row for the signal statuses {missing}"


def test_the_sql_insert_skips_a_duplicate_without_aborting_the_transaction(pg_settings: Settings) -> None:
    blocks = re.findall(r"```sql\n(.*?)```", section("Queueing a signal", level=3), re.S)
    inserts = [block for block in blocks if "INSERT INTO dream_signals" in block]
    assert len(inserts) == 1, f"{NAME}, 'Queueing a signal', should hold one ```sql INSERT INTO dream_signals block"
    statement = inserts[0]
    assert "ON CONFLICT (user_id, idempotency_key) DO NOTHING" in statement
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", "")) as conn:
        with conn.transaction():
            first = conn.execute(statement).rowcount
            # The producer's own work after the duplicate must still run in the same transaction.
            second = conn.execute(statement).rowcount
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert (first, second) == (1, 0)
        rows = conn.execute("SELECT kind, user_id, payload, status FROM dream_signals").fetchall()
    assert len(rows) == 1
    kind, user_id, payload, status = rows[0]
    assert status == "pending"
    # The reference says the default key is the same for every way in: enqueue_signal sees a duplicate.
    again = enqueue_signal(kind, user_id, payload, settings=pg_settings)
    assert not again.created


def test_readme_points_at_the_reference() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    assert readme.count("docs/reference.md") >= 3, (
        "README.md should link docs/reference.md near the top, in 'Command line' and in 'Configuration'"
    )
    assert "contract" not in readme.lower(), "README.md speaks of a contract users cannot read; name the reference"


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_resolves() -> None:
    text = REFERENCE.read_text("utf-8")
    anchors = {_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _hash, anchor = target.partition("#")
        if path and not (REFERENCE.parent / path).exists():
            problems.append(f"{target}: no such file")
        elif not path and anchor not in anchors:
            problems.append(f"{target}: no such heading")
    readme = (ROOT / "README.md").read_text("utf-8")
    for anchor in re.findall(r"\]\(docs/reference\.md#([^)\s]+)\)", readme):
        if anchor not in anchors:
            problems.append(f"README.md links docs/reference.md#{anchor}: no such heading")
    assert not problems, f"{NAME}: broken links: " + "; ".join(problems)
