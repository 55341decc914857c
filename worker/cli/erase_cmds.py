"""``reverie erase-user``."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from worker.cli.common import app, fail, load_settings, require_current_schema


@app.command("erase-user")
def erase_user(
    user: Annotated[str, typer.Argument(metavar="USER", help="The user whose rows are removed everywhere.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows removed per table as JSON.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation on a terminal.")] = False,
    wait: Annotated[
        float | None,
        typer.Option(
            "--wait",
            min=0,
            max=86_400,
            metavar="SECONDS",
            help="How long to wait for a dream of the user under way (default: the longest one can run).",
        ),
    ] = None,
) -> None:
    """Right to erasure: remove the user's rows from the memory table and every dream_ table.

    Signals for the user enqueued before the erasure are dropped; later ones are processed.
    """
    from tasks.erase import erase_user as erase
    from worker.errors import InvalidSignal
    from worker.payloads import check_lookup

    # Any name is taken as it is, whatever Reverie would refuse to write (spaces alone:
    # a host's own rows may name a user so, and are erased all the same), but one no
    # user can have.
    try:
        check_lookup("user", user)
    except InvalidSignal as exc:
        fail(str(exc), code=2)
    settings = load_settings()
    require_current_schema(settings)
    if not yes and sys.stdin.isatty():
        _confirm(f"Erase every row of user {user!r} everywhere? This cannot be undone")
    from tasks.erase import lease_wait
    from worker.errors import UserBusy

    waited = lease_wait(settings) if wait is None else wait
    try:
        counts = erase(settings, user, wait_seconds=waited, on_wait=lambda: _waiting(user, waited))
    except UserBusy:
        fail(f"a dream of user {user!r} was still running after {waited:.0f} s: nothing erased; try again later")
    removed = {table: count for table, count in sorted(counts.items()) if count}
    if as_json:
        print(json.dumps({"user": user, "rows_removed": removed, "total": sum(removed.values())}))
        return
    detail = ", ".join(f"{table}: {count}" for table, count in removed.items()) or "no rows held"
    print(f"erased user {user}: {sum(removed.values())} row(s) removed ({detail})")


def _waiting(user: str, seconds: float) -> None:
    print(f"waiting for the dream of user {user!r} under way to end (up to {seconds:.0f} s)...", file=sys.stderr)


def _confirm(question: str) -> None:
    """Ask on the terminal; anything but yes ends the command (exit 1), and Ctrl-C is
    an interruption (exit 130), as everywhere else: ``typer.confirm`` makes both exit 1."""
    print(f"{question} [y/N]: ", end="", flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        print()
        raise
    if answer.strip().lower() not in ("y", "yes"):
        fail("not erased: the question was not answered yes")
