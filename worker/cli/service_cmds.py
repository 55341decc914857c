"""``reverie worker`` and ``reverie beat``: the Celery worker and beat of this app.

Each replaces this process with ``python -m celery -A worker.app worker|beat`` (so
signals from a supervisor reach Celery directly), adds sensible defaults, and passes
any further arguments through: ``reverie worker -- --pool solo``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from worker.cli.common import app, fail, load_settings

PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
ALL_QUEUES = "signals,dreams,housekeeping"


def celery_argv(command: str, options: list[str], extra: list[str]) -> list[str]:
    """The command line that runs Celery's ``command`` for this app."""
    return [sys.executable, "-m", "celery", "-A", "worker.app", command, *options, *extra]


NO_BROKER = (
    "REVERIE_BROKER_URL is empty: a worker and beat need a broker (a redis:// URL); "
    "without one, run `reverie run` from cron instead"
)


def _exec(argv: list[str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(argv[0], argv)  # noqa: S606 - our own interpreter, no shell
    except OSError as exc:
        fail(f"cannot start celery: {exc.strerror or exc}")


def _check_level(loglevel: str | None) -> None:
    """``--loglevel`` as ``REVERIE_LOG_LEVEL`` may be: a usage error otherwise."""
    from worker.settings import LOG_LEVELS

    if loglevel is not None and loglevel.strip().upper() not in LOG_LEVELS:
        fail(f"--loglevel {loglevel!r}: must be one of {', '.join(LOG_LEVELS)}", code=2)


@app.command(context_settings=PASS_THROUGH)
def worker(
    ctx: typer.Context,
    queues: Annotated[str, typer.Option("--queues", "-Q", help="Comma-separated queues to consume.")] = ALL_QUEUES,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", "-c", min=1, help="Worker processes (default REVERIE_WORKER_CONCURRENCY)."),
    ] = None,
    loglevel: Annotated[str | None, typer.Option("--loglevel", "-l", help="Default REVERIE_LOG_LEVEL.")] = None,
) -> None:
    """Run the Celery worker (the same as `celery -A worker.app worker`). Arguments after
    `--` go to Celery: `reverie worker -- --pool solo`."""
    from worker.metrics_server import prepare_multiprocess_dir

    names = [name.strip() for name in queues.split(",")]
    unknown = set(names) - set(ALL_QUEUES.split(","))
    if "" in unknown:
        fail(f"--queues {queues!r}: a queue name is empty; expected some of {ALL_QUEUES}", code=2)
    if unknown:
        fail(f"unknown queue(s) {', '.join(sorted(unknown))}; expected some of {ALL_QUEUES}", code=2)
    queues = ",".join(names)
    _check_level(loglevel)
    # A service waits for its database (it says so as it starts) rather than refuse to start.
    settings = load_settings(database_must_exist=False)
    if not settings.broker_url:
        fail(NO_BROKER)
    # The children's metrics are summed from files; the directory must be named before
    # anything in the worker imports prometheus_client.
    prepare_multiprocess_dir()
    options = [
        "--queues",
        queues,
        "--concurrency",
        str(concurrency or settings.worker_concurrency),
        "--loglevel",
        loglevel or settings.log_level,
    ]
    _exec(celery_argv("worker", options, list(ctx.args)))


@app.command(context_settings=PASS_THROUGH)
def beat(
    ctx: typer.Context,
    schedule: Annotated[
        str | None,
        typer.Option("--schedule", "-s", help="Beat's state file (default: celerybeat-schedule here)."),
    ] = None,
    loglevel: Annotated[str | None, typer.Option("--loglevel", "-l", help="Default REVERIE_LOG_LEVEL.")] = None,
) -> None:
    """Run Celery beat (the same as `celery -A worker.app beat`). Run exactly one."""
    from worker.metrics_textfile import unwritable

    _check_level(loglevel)
    if schedule is not None:
        why = unwritable(Path(schedule))
        if why is not None:
            fail(f"--schedule {schedule}: {why}", code=2)
    settings = load_settings(database_must_exist=False)
    if not settings.broker_url:
        fail(NO_BROKER)
    options = ["--loglevel", loglevel or settings.log_level]
    if schedule is not None:
        options += ["--schedule", schedule]
    _exec(celery_argv("beat", options, list(ctx.args)))
