"""``reverie enqueue`` and ``reverie signals list|retry``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from worker.cli.common import app, fail, load_settings
from worker.url_secrets import mask_secrets

if TYPE_CHECKING:
    from worker.settings import Settings

signals_app = typer.Typer(help="Inspect and replay queued signals.", no_args_is_help=True)
app.add_typer(signals_app, name="signals")

STATUSES = ("pending", "processing", "done", "rejected", "failed", "dead")


def _read_payload(source: str, limit: int) -> str:
    """The payload's text (whether it is JSON is for the producer to say), read no
    further than one byte past ``limit``: a larger one is refused without holding it
    (a payload file of /dev/zero would otherwise take every byte of memory)."""
    try:
        if source == "-":
            raw = sys.stdin.buffer.read(limit + 1)
        else:
            with Path(source).open("rb") as handle:
                raw = handle.read(limit + 1)
        if len(raw) > limit:
            from worker.errors import InvalidSignal

            raise InvalidSignal("payload", f"is over {limit} bytes; at most {limit} allowed")
        return raw.decode("utf-8")
    except OSError as exc:
        fail(f"cannot read payload file {source}: {exc.strerror}")
    except UnicodeDecodeError:
        fail(f"payload {source} is not UTF-8 text")


@app.command()
def enqueue(
    kind: Annotated[str, typer.Argument(metavar="KIND", help="session_end, feedback or activity")],
    user: Annotated[str, typer.Option("--user", help="The user the signal is about.")],
    payload: Annotated[str, typer.Option("--payload", help="A JSON file, or - for standard input.")],
    agent: Annotated[str | None, typer.Option("--agent", help="The agent that produced it.")] = None,
    idempotency_key: Annotated[
        str | None, typer.Option("--idempotency-key", help="Defaults to a hash of kind, user and payload.")
    ] = None,
) -> None:
    """Queue one signal for one user (session_end, feedback or activity)."""
    from worker.payloads import check_kind
    from worker.producer import enqueue_signal_json

    check_kind(kind)  # before reading stdin, so a typo fails at once
    settings = load_settings()
    text = _read_payload(payload, settings.max_payload_bytes)
    result = enqueue_signal_json(kind, user, text, agent_id=agent, idempotency_key=idempotency_key, settings=settings)
    if result.created:
        print(f"enqueued signal {result.signal_id} ({kind}), idempotency key {result.idempotency_key}")
    else:
        print(
            f"duplicate: signal {result.signal_id} already has idempotency key "
            f"{result.idempotency_key}; nothing written"
        )


@signals_app.command("list")
def list_(
    status: Annotated[str | None, typer.Option("--status", help="Only signals in this status.")] = None,
    kind: Annotated[str | None, typer.Option("--kind", help="Only signals of this kind.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10000)] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Show the newest signals, with status, attempts and the last error."""
    if status is not None and status not in STATUSES:
        fail(f"unknown status {status!r}; expected one of {', '.join(STATUSES)}", code=2)
    from store import signals as signal_store
    from store.db import session_scope

    settings = load_settings()
    with session_scope(settings) as session:
        rows = signal_store.list_signals(session, status=status, kind=kind, limit=limit)
        records = [
            {
                "id": row.id,
                "kind": row.kind,
                "user": row.user_id,
                "agent": row.agent_id,
                "status": row.status,
                "attempts": row.attempts,
                "enqueued_at": row.enqueued_at.isoformat(sep=" ", timespec="seconds"),
                "processed_at": row.processed_at.isoformat(sep=" ", timespec="seconds") if row.processed_at else None,
                "last_error": row.last_error,
            }
            for row in rows
        ]
    if as_json:
        for record in records:
            print(json.dumps(record))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"signals ({len(records)} shown, newest first)")
    for column in ("id", "kind", "user", "agent", "status", "attempts", "enqueued_at", "last_error"):
        table.add_column(column, overflow="fold")
    for r in records:
        table.add_row(
            *(
                str(r[c]) if r[c] is not None else ""
                for c in ("id", "kind", "user", "agent", "status", "attempts", "enqueued_at", "last_error")
            )
        )
    Console().print(table)


@signals_app.command("retry")
def retry(
    signal_id: Annotated[
        int | None, typer.Argument(metavar="SIGNAL_ID", help="The signal to put back.", min=1, max=2**63 - 1)
    ] = None,
    all_dead: Annotated[bool, typer.Option("--all-dead", help="Put back every dead signal.")] = False,
) -> None:
    """Put dead (or failed) signals back to pending with fresh attempts."""
    if (signal_id is None) == (not all_dead):
        fail("give exactly one of: a signal ID, or --all-dead", code=2)
    from store import signals as signal_store
    from store.db import session_scope

    settings = load_settings()
    with session_scope(settings) as session:
        ids = signal_store.retry_signals(session, signal_id=signal_id, all_dead=all_dead)
    if signal_id is not None and not ids:
        fail(f"signal {signal_id} is not dead or failed (or does not exist); nothing changed")
    if not ids:
        print("no dead signal; nothing changed")
        return
    print(f"put back {len(ids)} signal(s): {', '.join(map(str, ids[:20]))}{' ...' if len(ids) > 20 else ''}")
    _wake_retried(settings, ids)


def _wake_retried(settings: Settings, ids: list[int]) -> None:
    """Wake-ups for signals put back (committed): no row is inserted, so PostgreSQL sends
    no notice, and without a wake-up they would wait for the sweeper."""
    if not settings.broker_url:
        return  # no broker: the next `reverie run` takes them
    from worker.errors import BrokerUnavailable
    from worker.wakeup import wake_signals

    try:
        wake_signals(settings, ids)
    except BrokerUnavailable as exc:
        print(f"reverie: no wake-up sent ({mask_secrets(exc.reason)}); the sweeper delivers them", file=sys.stderr)
