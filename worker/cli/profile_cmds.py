"""``reverie profile``."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from worker.cli.common import app, fail, load_settings


@app.command("profile")
def profile(
    user: Annotated[str, typer.Argument(metavar="USER", help="The user whose profile is shown.")],
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            help="As this agent sees it (default: the shared entries only: global, and self with no owner).",
        ),
    ] = None,
    budget: Annotated[int | None, typer.Option("--budget", help="At most this many tokens.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The user's prompt-ready memory as an agent sees it, under a token budget.

    A user with no profile yet prints one line saying so (exit 1); with --json, an
    empty profile (built_at null, exit 1). A built profile with nothing in it prints
    nothing, and a line on stderr saying why (exit 0).
    """
    from worker.errors import InvalidSignal
    from worker.payloads import check_lookup
    from worker.profiles_reader import get_for_prompt, is_known

    if budget is not None and budget < 0:
        fail("--budget must be at least 0", code=2)
    try:
        check_lookup("user", user)
        if agent is not None:
            check_lookup("--agent", agent)
    except InvalidSignal as exc:
        fail(str(exc), code=2)
    settings = load_settings()
    found = get_for_prompt(user, agent, budget, settings=settings)
    if as_json:
        print(json.dumps(found.to_json(), ensure_ascii=False))
        if found.built_at is None:
            raise SystemExit(1)
        return
    if found.built_at is None:
        if not is_known(user, settings=settings):
            fail(
                f"no profile for user {user}: no entries and no schedule for this user "
                "(a user's first entries come from the application or a signal)"
            )
        who = f" for agent {agent}" if agent else ""
        fail(
            f"no profile yet for user {user}{who}: it is built by the next dream of that user "
            f"(`{_run_user(user)}` dreams them now)"
        )
    print(found.text, end="")
    if not found.text:
        # Nothing for a prompt (standard output stays empty, as a pipe wants it): why, on stderr.
        print(f"reverie: {_why_empty(user, agent, found.entries_left_out, found.budget, budget)}", file=sys.stderr)


def _run_user(user: str) -> str:
    """The command that dreams ``user`` now, as a shell takes it (the id quoted where it must be)."""
    import shlex

    return f"reverie run --user {shlex.quote(user)}"


def _why_empty(user: str, agent: str | None, left_out: int, budget: int, asked: int | None) -> str:
    whose = f"user {user}'s profile" + (f" for agent {agent}" if agent else "")
    if left_out:
        entries = "its entry does not" if left_out == 1 else f"none of its {left_out} entries"
        fits = "fit" if left_out == 1 else "fits"
        if asked is not None and asked <= budget:  # (the reader gives the smaller of the two)
            return f"{whose} is empty: {entries} {fits} in {asked} tokens"
        # A reader only cuts what was built: more than the build's budget adds nothing.
        built = f"the {budget} tokens it was built with (REVERIE_PROFILE_TOKEN_BUDGET)"
        return f"{whose} is empty: {entries} {fits} in {built}"
    if agent:
        return (
            f"{whose} is empty: the last dream of this user found no entry agent {agent} may see "
            f"(`{_run_user(user)}` builds it again now)"
        )
    return (
        f"{whose} is empty: it shows the shared entries only (global, and self with no owner), and the last dream "
        "of this user found none (--agent A shows what agent A may see)"
    )
