"""``reverie demo``: the whole pipeline once, on an embedded SQLite file.

No broker, no network: the offline model stands in for a real one, with a nominal
price so the cost cap is exercised exactly as in production.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from store import report, seed
from store.db import dispose_engines, session_scope
from store.memories import table_for
from store.migrate import upgrade
from store.types import nano_to_usd, now
from worker import demo_world
from worker.producer import enqueue_signal
from worker.settings import Settings


def demo_settings(path: Path) -> Settings:
    # Whatever REVERIE_* or .env say, the demo's store, model and broker are embedded.
    return Settings(
        _env_file=None,
        database_url=f"sqlite:///{path.resolve()}",
        llm_model="offline",
        broker_url="memory://",
    )


def run_demo(path: Path, console: Console | None = None) -> dict[str, Any]:
    """Create a store at ``path``, seed it, run one pass, print what happened."""
    out = console or Console()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    settings = demo_settings(path)
    upgrade(settings)
    seeded = _seed(settings)
    out.print(f"[bold]Reverie demo[/bold]  store: {path}  model: offline  broker: none")
    out.print(
        f"seeded {seeded['entries']} memory entries for {len(demo_world.USERS)} users and "
        f"{len(demo_world.AGENTS)} agents, and {seeded['signals']} signals (all three kinds, two malformed)"
    )
    from schedules.cron import run_once

    result = run_once(settings, users=(), all_users=True)
    summary = _summarize(settings, result)
    _print(out, summary)
    dispose_engines()
    return summary


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


def _print(out: Console, s: dict[str, Any]) -> None:
    signals = Table(title="Signals: what each one became")
    for column in ("id", "kind", "user", "status", "why"):
        signals.add_column(column, overflow="fold")
    for sid, kind, user, status, error in s["signals"]:
        signals.add_row(str(sid), kind, user, status, error or "")
    out.print(signals)

    written = Table(title="Memories written from signals and summaries")
    for column in ("user", "key", "value", "category", "source", "action"):
        written.add_column(column, overflow="fold")
    for w in s["written"]:
        written.add_row(w["user_id"], w["key"], json.dumps(w["value"])[:60], w["category"], w["source"], w["action"])
    out.print(written)

    removed = Table(title="Archived and removed (restorable with `reverie restore --run ID`)")
    for column in ("user", "reason", "key", "run"):
        removed.add_column(column)
    for user, reason, key, run_id in s["archived"]:
        removed.add_row(user, reason, key, str(run_id or ""))
    out.print(removed)

    flagged = Table(title="Contradictions flagged (conflicted = true)")
    for column in ("user", "normalised key", "entries"):
        flagged.add_column(column)
    for user, key, n in s["contradictions"]:
        flagged.add_row(user, key, str(n))
    out.print(flagged)

    runs = Table(title="Dream runs (the ledger)")
    for column in ("run", "user", "status", "pruned", "contradictions", "summarized", "cost USD"):
        runs.add_column(column)
    for run_id, user, status, pruned, found, summarized, cost in s["runs"]:
        runs.add_row(str(run_id), user, status, str(pruned), str(found), str(summarized), f"{cost:.6f}")
    out.print(runs)
    p = s["pass"]
    out.print(
        f"[bold]pass:[/bold] users {p.get('users_processed')}, pruned {p.get('entries_pruned')}, "
        f"contradictions {p.get('contradictions_found')}, summarized {p.get('entries_summarized')}, "
        f"signals done {p.get('signals_processed')} / rejected {p.get('signals_rejected')} / "
        f"failed {p.get('signals_failed')}, spent {float(p.get('cost_usd', 0)):.6f} USD"
    )
