"""``reverie health``: the check a container orchestrator or a supervisor runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from worker.cli.common import app, fail, load_settings, require_current_schema

if TYPE_CHECKING:
    from worker.settings import Settings

BROKER_TIMEOUT_SECONDS = 5.0


@app.command()
def health(
    broker: Annotated[bool, typer.Option("--broker", help="Also check that the broker answers.")] = False,
    metrics: Annotated[
        bool, typer.Option("--metrics", help="Also check that this host's /metrics endpoint answers (the worker).")
    ] = False,
) -> None:
    """Exit 0 when the database answers and is at the current schema (and, as asked,
    the broker answers and /metrics is served); otherwise one line and exit 1."""
    from store.db import check_connection, has_table
    from store.memories import check_memory_table
    from worker.errors import MemoryTableMissing

    settings = load_settings()
    check_connection(settings)
    head = require_current_schema(settings)
    if not has_table(settings, settings.memory_table):
        # Migrated, and still no work could run: REVERIE_MEMORY_TABLE names another table.
        fail(str(MemoryTableMissing(settings.memory_table)))
    check_memory_table(settings)
    _check_policies(settings)
    checked = [f"database at revision {head}"]
    if broker:
        if not settings.broker_url:
            fail("no broker: REVERIE_BROKER_URL is empty (cron mode, where nothing is sent)")
        _check_broker(settings.broker_url)
        checked.append("broker answers")
    if metrics:
        _check_metrics(settings.metrics_port)
        checked.append(f"metrics served on port {settings.metrics_port}")
    print("healthy: " + "; ".join(checked))


def _check_policies(settings: Settings) -> None:
    """Every stored policy reads under this release's limits: one that does not (stored
    by an earlier release, or by hand) stops every dream pass, so the probe says so."""
    from store import policies
    from store.db import session_scope
    from worker.policy import book

    with session_scope(settings) as session:
        book(settings, policies.all_configs(session))


def _check_broker(url: str) -> None:
    """The broker answers within ``BROKER_TIMEOUT_SECONDS``, whatever it does: a peer
    that takes the connection and never replies (or a TLS URL on a plain port, whose
    handshake waits forever) fails the check in time, not hangs the probe."""
    import threading

    from store.db import safe_url

    outcome: list[BaseException | None] = []
    checking = threading.Thread(target=_ping_broker, args=(url, outcome), daemon=True)
    checking.start()
    checking.join(BROKER_TIMEOUT_SECONDS + 1)
    if not outcome:
        fail(f"broker {safe_url(url)} does not answer: no reply within {BROKER_TIMEOUT_SECONDS:g} s")
    exc = outcome[0]
    if exc is not None:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"broker {safe_url(url)} does not answer: {reason}")


def _ping_broker(url: str, outcome: list[BaseException | None]) -> None:
    from kombu.connection import Connection
    from kombu.exceptions import OperationalError

    timeouts = {"socket_timeout": BROKER_TIMEOUT_SECONDS, "socket_connect_timeout": BROKER_TIMEOUT_SECONDS}
    try:
        with Connection(  # type: ignore[no-untyped-call]
            url, connect_timeout=BROKER_TIMEOUT_SECONDS, transport_options=timeouts
        ) as connection:
            connection.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT_SECONDS)
            connection.default_channel.client.ping()
        outcome.append(None)
    except (OperationalError, OSError, ValueError) as exc:
        outcome.append(exc)


def _check_metrics(port: int) -> None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            response.read(1)
    except (urllib.error.URLError, OSError) as exc:
        fail(f"no /metrics on 127.0.0.1:{port}: {getattr(exc, 'reason', exc)}")
