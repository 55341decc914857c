"""``reverie demo``: the whole pipeline once, on an embedded SQLite file.

No broker, no network: the offline model stands in for a real one, with a nominal
price so the cost cap is exercised exactly as in production.

Log lines name users only by their keyed reference (``REVERIE_LOG_HASH_KEY``), as in
production; the demo's own tables name them as the memory table does. So that the two
can be read side by side, the demo first prints each user beside the reference its log
lines use. That key is printed on the console, never logged: the demo's log lines go
through the same redacting formatter as the worker's.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO, cast

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource
from rich.console import Console
from rich.table import Table

from store import report, seed
from store.db import dispose_engines, session_scope
from store.memories import table_for
from store.migrate import upgrade
from store.types import nano_to_usd, now
from worker import demo_world
from worker.logging_setup import configure_logging
from worker.logs import user_ref
from worker.producer import enqueue_signal
from worker.profiles_reader import PromptProfile, get_for_prompt
from worker.settings import Settings


class _DemoSettings(Settings):
    """The defaults and the demo's own values only: whatever REVERIE_* or ``.env`` say,
    the demo runs the same everywhere, on its embedded store, model and broker. Only the
    log hash key is taken from ``REVERIE_LOG_HASH_KEY``: the key its log lines name users
    with is the operator's."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def demo_settings(path: Path) -> Settings:
    own: dict[str, Any] = {"database_url": f"sqlite:///{path.resolve()}", "llm_model": "offline", "broker_url": ""}
    if os.environ.get("REVERIE_LOG_HASH_KEY"):
        own["log_hash_key"] = os.environ["REVERIE_LOG_HASH_KEY"]
    return _DemoSettings(**own)


def run_demo(path: Path, console: Console | None = None) -> dict[str, Any]:
    """Create a store at ``path``, seed it, run one pass, print what happened."""
    out = console or Console()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    settings = demo_settings(path)
    upgrade(settings)
    # The pipeline's log lines are read between the demo's tables: the same console,
    # in the console format, through the same redaction as the worker's.
    configure_logging(settings.model_copy(update={"log_format": "console"}), stream=cast(TextIO, out.file))
    seeded = _seed(settings)
    before = _profile_now(settings, build=True)
    out.print(f"[bold]Reverie demo[/bold]  store: {path}  model: offline  broker: none")
    out.print(
        f"seeded {seeded['entries']} memory entries for {len(demo_world.USERS)} users and "
        f"{len(demo_world.AGENTS)} agents, and {seeded['signals']} signals (all three kinds, two malformed)"
    )
    refs = user_refs(settings)
    _table(
        out,
        "Users, and how log lines name them (user=...)",
        ("user", "in log lines"),
        [(user, ref) for user, ref in refs.items()],
    )
    _print_profile(out, "before the signals and the dream", before)
    from schedules.cron import run_once
    from tasks.activity import detect_routines
    from tasks.signals import process_pending

    # The pass below would process the signals too; doing it first keeps each fact's verdict.
    signal_pass = process_pending(settings)
    result = run_once(settings, users=(), all_users=True)
    routines = detect_routines(settings)
    summary = _summarize(settings, result)
    summary["user_refs"] = refs
    summary["routines"] = routines
    summary["decisions"] = [
        (r.user_id, r.signal_id, r.kind, d.key, d.value, d.accepted, d.outcome)
        for r in signal_pass.results
        for d in r.decisions
    ]
    for key in ("processed", "rejected", "failed", "dead"):
        summary["pass"][f"signals_{key}"] += getattr(signal_pass, key)
    _print(out, summary)
    summary["profile_before"] = before.text
    after = _profile_now(settings, build=False)
    summary["profile_after"] = after.text
    _print_profile(out, "after the signals and the dream", after)
    user, agent = demo_world.PROFILE_SHOWN
    # Other commands read ``./reverie.db`` unless told otherwise: say how to reach this store.
    url = f"sqlite:///{path.resolve()}"
    hint = f"Look further into this store: REVERIE_DATABASE_URL={url} {_this_command()} profile {user} --agent {agent}"
    out.print(hint, markup=False, highlight=False, soft_wrap=True)
    dispose_engines()
    return summary


def user_refs(settings: Settings) -> dict[str, str]:
    """Each demo user and the reference that names them in log lines."""
    return {user: user_ref(user, settings.log_hash_key) for user in demo_world.USERS}


def _seed(settings: Settings) -> dict[str, int]:
    at = now()
    table = table_for(settings)
    rows = [
        seed.backdate(
            {
                "user_id": e.user_id,
                "key": e.key,
                "value": e.value,
                "category": e.category,
                "visibility": e.visibility,
                "source_agent_id": e.agent,
                "access_count": e.access_count,
                "group_ids": e.group_ids,
            },
            at - timedelta(days=e.age_days),
        )
        for e in demo_world.entries()
    ]
    with session_scope(settings) as session:
        count = seed.insert_entries(session, table, rows)
    _note_first_look(settings)
    signals = demo_world.signals(at)
    for s in signals:
        enqueue_signal(s.kind, s.user_id, s.payload, agent_id=s.agent_id, settings=settings)
    with session_scope(settings) as session:
        for kind, user, payload in demo_world.MALFORMED_SQL_SIGNALS:
            seed.insert_raw_signal(session, kind, user, payload)
    return {"entries": count, "signals": len(signals) + len(demo_world.MALFORMED_SQL_SIGNALS)}


def _note_first_look(settings: Settings) -> None:
    """Let Reverie take its first look at access counts, then simulate recalls.

    Reverie sees a recall as ``access_count`` growing between two looks; the demo
    records one look now and bumps the counter of the entry the app "recalled".
    """
    from store import entry_state

    table = table_for(settings)
    with session_scope(settings) as session:
        entry_state.observe_access_counts(session, table, user_ids=list(demo_world.USERS), at=now() - timedelta(days=1))
        seed.bump_access_count(session, table, user_id="alice", key="seat")


def _profile_now(settings: Settings, *, build: bool) -> PromptProfile:
    """The demo's shown profile as it stands (``build``: built first, as a dream would)."""
    user, agent = demo_world.PROFILE_SHOWN
    if build:
        from store import policies as policy_store
        from tasks import profiles
        from worker.policy import book

        with session_scope(settings) as session:
            policies = book(settings, policy_store.all_configs(session))
            profiles.refresh(session, settings, [user], book=policies)
    return get_for_prompt(user, agent, settings=settings)


def _print_profile(out: Console, when: str, profile: PromptProfile) -> None:
    out.print(
        f"[bold]Profile of {profile.user_id} as {profile.agent_id} sees it, {when}[/bold] "
        f"({profile.tokens} tokens, {profile.entries_included} entries, {profile.entries_left_out} left out)"
    )
    # Plain text: a value may hold brackets that markup would swallow.
    out.print(profile.text.rstrip("\n") or "(empty)", markup=False, highlight=False)


def _summarize(settings: Settings, result: Any) -> dict[str, Any]:
    table = table_for(settings)
    with session_scope(settings) as session:
        runs = report.runs(session)
        return {
            "pass": result.as_dict() if hasattr(result, "as_dict") else dict(vars(result)),
            "archived": report.archived(session),
            "contradictions": [(c.user_id, c.norm_key, len(c.entry_ids)) for c in report.open_contradictions(session)],
            "conflicted": report.conflicted_entries(session, table),
            "written": report.written_entries(session, table, ("session_end", "feedback", "activity", "summarize")),
            "signals": [(s.id, s.kind, s.user_id, s.status, s.last_error) for s in report.signals(session)],
            "runs": [
                (
                    r.id,
                    r.user_id,
                    r.status,
                    r.entries_pruned,
                    r.contradictions_found,
                    r.entries_summarized,
                    nano_to_usd(r.cost_nano),
                )
                for r in runs
            ],
            "entries_after": report.memory_counts(session, table),
        }


#: Columns that hold names, a key first (it is what a reader looks for): each is made
#: as wide as its longest name as far as the console's width allows once every column
#: has ``PROSE_CHARS`` (or its own width, if less); the rest fold, and prose (a value, a
#: verdict) wraps at its spaces.
NAME_COLUMNS = ("key", "normalised key", "user", "kind", "status", "reason", "category", "source", "action")
PROSE_CHARS = 10


def _table(out: Console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for column, width in zip(columns, _name_widths(out.width, columns, rows), strict=True):
        table.add_column(column, overflow="fold", width=width)
    for row in rows:
        table.add_row(*row)
    out.print(table)


def _name_widths(width: int, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[int | None]:
    """The width of each name column given more than ``PROSE_CHARS`` (None: rich's choice)."""
    widest = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(columns)]
    least = [min(w, PROSE_CHARS) for w in widest]
    # Each column takes its padding and a rule: 3 characters, and one more for the table.
    room = width - 3 * len(columns) - 1 - sum(least)
    widths: list[int | None] = [None] * len(columns)
    for name in NAME_COLUMNS:
        if name in columns and room > 0:
            index = columns.index(name)
            more = min(widest[index] - least[index], room)
            if more > 0:
                widths[index] = least[index] + more
                room -= more
    return widths


def _verdict(accepted: bool, outcome: str) -> str:
    return f"[green]accepted[/green]: {outcome}" if accepted else f"[red]refused[/red]: {outcome}"


def _print(out: Console, s: dict[str, Any]) -> None:
    _table(
        out,
        "Signals: what each one became",
        ("id", "kind", "user", "status", "why"),
        [(str(sid), kind, user, status, error or "") for sid, kind, user, status, error in s["signals"]],
    )
    _table(
        out,
        "Candidate memories from signals: accepted or refused, and why",
        ("user", "signal", "kind", "key", "value", "verdict"),
        [
            (user, str(sid), kind, key, str(value)[:40], _verdict(accepted, outcome))
            for user, sid, kind, key, value, accepted, outcome in s["decisions"]
        ],
    )
    _table(
        out,
        "Memories written from signals and summaries",
        ("user", "key", "value", "category", "source", "action"),
        [
            (w["user_id"], w["key"], json.dumps(w["value"])[:60], w["category"], w["source"], w["action"])
            for w in s["written"]
        ],
    )
    _table(
        out,
        "Archived first (restorable with `reverie restore --run ID` or `--signal ID`)",
        ("user", "reason", "key", "run", "signal"),
        [
            (user, reason, key, str(run_id or ""), str(signal_id or ""))
            for user, reason, key, run_id, signal_id in s["archived"]
        ],
    )
    _table(
        out,
        "Contradictions flagged (conflicted = true)",
        ("user", "normalised key", "entries"),
        [(user, key, str(n)) for user, key, n in s["contradictions"]],
    )
    _table(
        out,
        "Dream runs (the ledger)",
        ("run", "user", "status", "pruned", "contradictions", "summarized", "cost USD"),
        [
            (str(run_id), user, status, str(pruned), str(found), str(summarized), f"{cost:.6f}")
            for run_id, user, status, pruned, found, summarized, cost in s["runs"]
        ],
    )
    p = s["pass"]
    out.print(
        f"[bold]pass:[/bold] users {p.get('users_processed')}, pruned {p.get('entries_pruned')}, "
        f"contradictions {p.get('contradictions_found')}, summarized {p.get('entries_summarized')}, "
        f"signals done {p.get('signals_processed')} / rejected {p.get('signals_rejected')} / "
        f"failed {p.get('signals_failed')}, routines found {s.get('routines', 0)}, "
        f"dream spend {float(p.get('cost_usd', 0)):.6f} USD"
    )


def _this_command() -> str:
    """How this run was started (``.venv/bin/reverie``, as the README has it), for a
    command the reader can paste; ``reverie`` where that is not a path to it."""
    started = sys.argv[0] if sys.argv else ""
    return shlex.quote(started) if os.path.basename(started) == "reverie" and os.sep in started else "reverie"
