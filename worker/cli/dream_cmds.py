"""``reverie run``, ``reverie restore`` and ``reverie policy set|show``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from worker.cli.common import Terminated, app, fail, load_settings, require_current_schema, sigterm_as_interrupt

if TYPE_CHECKING:
    from schedules.cron import PassReport
    from worker.settings import Settings

policy_app = typer.Typer(help="Per-agent dream policy (EDDI dreamConfig field names).", no_args_is_help=True)
app.add_typer(policy_app, name="policy")


@app.command()
def run(
    user: Annotated[
        list[str] | None, typer.Option("--user", metavar="USER", help="Dream this user (repeatable).")
    ] = None,
    all_users: Annotated[bool, typer.Option("--all", help="Dream every user, due or not.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    metrics_textfile: Annotated[
        Path | None, typer.Option("--metrics-textfile", help="Write the metrics here for node-exporter.")
    ] = None,
) -> None:
    """One pass in this process: pending signals, then the users that are due."""
    from store.db import check_connection
    from store.memories import check_memory_table

    if user and all_users:
        fail("--user and --all exclude each other", code=2)
    from worker.errors import InvalidSignal
    from worker.payloads import check_lookup

    try:
        for name in user or ():
            check_lookup("--user", name)
    except InvalidSignal as exc:
        fail(str(exc), code=2)
    if metrics_textfile is not None:
        from worker.metrics_textfile import unwritable

        why = unwritable(metrics_textfile)
        if why is not None:
            fail(f"--metrics-textfile {metrics_textfile}: {why}", code=2)
    from worker.heap import freeze_loaded
    from worker.logs import warn_if_public_hash_key, warn_of_unknown_settings

    settings = load_settings()  # logging to stderr too: --json output stays one JSON object
    check_connection(settings)
    require_current_schema(settings)
    check_memory_table(settings)
    # After the connection check, so a database that is not there is still one line.
    warn_if_public_hash_key(settings, process="run")
    warn_of_unknown_settings(process="run")
    # What is loaded by now lives as long as the process: the collector is kept off it
    # (a pass over 1,000 users: 2.4 s to 2.1 s).
    freeze_loaded()
    show_progress = not as_json and sys.stderr.isatty()
    try:
        with sigterm_as_interrupt():
            report = _one_pass(settings, user or (), all_users=all_users, show_progress=show_progress)
    except KeyboardInterrupt as stopped:
        # Ctrl-C or SIGTERM: the chunks under way have closed their runs. What the pass
        # did is counted in the file all the same (its counters add up across passes).
        if metrics_textfile is not None:
            _write_metrics(settings, metrics_textfile)
        if isinstance(stopped, Terminated):
            fail("terminated (SIGTERM): the runs under way are closed, their users left to the next pass", code=143)
        raise
    data = report.as_dict()
    if as_json:
        print(json.dumps(data, sort_keys=True), flush=True)
    else:
        _print_report(data)
    # Before the metrics are written: a failure to write them ends the command.
    needs_a_look = _say_what_needs_a_look(report, named=user or ())
    if metrics_textfile is not None:
        _write_metrics(settings, metrics_textfile)
    if report.users_failed or needs_a_look:
        raise typer.Exit(1)


def _one_pass(settings: Settings, users: Sequence[str], *, all_users: bool, show_progress: bool) -> PassReport:
    """The pass, with a progress bar on stderr where asked."""
    from schedules.cron import run_once

    if not show_progress:
        return run_once(settings, users=users, all_users=all_users)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("dreaming", total=None)
        return run_once(
            settings,
            users=users,
            all_users=all_users,
            on_user=lambda done, total: progress.update(task, completed=done, total=total),
        )


def _say_what_needs_a_look(report: PassReport, *, named: Sequence[str] = ()) -> bool:
    """One line on stderr for each thing of the pass nothing will mend on its own:
    named users not dreamed, signals that ended dead. Whether there was any."""
    busy = [u for u in dict.fromkeys(named) if u in set(report.busy)]
    if busy:
        # Asked for by name, not dreamed: another run (a worker's, another pass) holds them.
        print(
            f"reverie: not dreamed, another run holds --user {', '.join(busy)} "
            "(it dreams them; try again once it ends)",
            file=sys.stderr,
        )
    if report.users_unknown:
        named = ", ".join(report.users_unknown)
        print(
            f"reverie: not dreamed, no entries and no schedule for --user {named} "
            "(a user's first entries come from the application or a signal)",
            file=sys.stderr,
        )
    if report.signals_dead:
        # Out of attempts, a permanent model error or a spent ceiling: none is tried again
        # until someone looks, so a cron job must not look green.
        print(
            f"reverie: {report.signals_dead} signal(s) ended dead in this pass "
            "(`reverie signals list --status dead` says why; `reverie signals retry` once mended)",
            file=sys.stderr,
        )
    return bool(busy or report.users_unknown or report.signals_dead)


def _write_metrics(settings: Settings, path: Path) -> None:
    """Every metric family to ``path`` for node-exporter, after a pass."""
    from worker.metrics_server import refresh_pending_gauge
    from worker.metrics_textfile import write_textfile

    # The queue gauges as the database has them now, as the worker's page shows them.
    refresh_pending_gauge(settings)
    try:
        write_textfile(path, model=settings.llm_model)
    except OSError as exc:
        # The pass is committed and its summary printed: say what did not happen.
        fail(f"the pass is done, but its metrics were not written to {path}: {exc.strerror or exc}")


def _print_report(data: dict[str, Any]) -> None:
    print(
        f"signals: {data['signals_processed']} processed, {data['signals_rejected']} rejected, "
        f"{data['signals_failed']} failed, {data['signals_dead']} dead"
    )
    print(
        f"users: {data['users_processed']} dreamed, {data['users_skipped']} skipped (busy), "
        f"{data['users_failed']} failed"
    )
    print(
        f"entries: {data['entries_pruned']} pruned, {data['entries_summarized']} summarized; "
        f"{data['contradictions_found']} new contradictions; {data['groups_deferred']} groups deferred; "
        f"{data['profiles_built']} profiles built"
    )
    print(f"cost: {data['cost_usd']:.6f} USD; ledger run ids: {', '.join(map(str, sorted(data['run_ids']))) or 'none'}")
    for error in data["errors"]:
        print(f"failed: {error}", file=sys.stderr)


#: The largest id a ledger run or a signal can have (a BIGINT).
MAX_ID = 2**63 - 1


@app.command()
def restore(
    run_id: Annotated[
        int | None, typer.Option("--run", help="The ledger id of the run to undo.", min=1, max=MAX_ID)
    ] = None,
    signal_id: Annotated[
        int | None, typer.Option("--signal", help="The id of a signal whose writes to undo.", min=1, max=MAX_ID)
    ] = None,
) -> None:
    """Put back every row a run or a signal archived (and take out the entries it wrote)."""
    from store import schedule
    from store.archive import restore_run, restore_signal
    from store.db import session_scope
    from store.memories import table_for

    if (run_id is None) == (signal_id is None):
        fail("give exactly one of --run and --signal", code=2)
    settings = load_settings()
    require_current_schema(settings)
    with session_scope(settings) as session:
        if run_id is not None:
            result = restore_run(session, table_for(settings), run_id)
        else:
            assert signal_id is not None
            result = restore_signal(session, table_for(settings), signal_id)
        # Marked changed with the restore itself: a dream after the dirty delay looks at
        # them again (it summarizes nothing a restore put back), and rebuilds the
        # profiles if this process dies before they are rebuilt below.
        # (A run that holds a user now may have read their rows before: the mark is
        # then moved past its start, so its end leaves it.)
        schedule.mark_dirty_many(session, settings, result.users)
    rebuilt, left = _rebuild_profiles(settings, result.users)
    what = f"run {run_id}" if run_id is not None else f"signal {signal_id}"
    print(
        f"{what}: restored {result.restored} entries, took out {result.removed_inserts} it wrote"
        + (f", {result.conflicts} left archived (their key is taken again)" if result.conflicts else "")
        + (
            f", {result.changed_since} it wrote left in place (changed by the application since)"
            if result.changed_since
            else ""
        )
        + (f"; {rebuilt} profiles rebuilt" if rebuilt else "")
        + (f"; the profiles of {len(left)} users are left to their next dream (one held them)" if left else "")
    )


def _rebuild_profiles(settings: Settings, users: Sequence[str]) -> tuple[int, list[str]]:
    """The profiles of users a restore changed, rebuilt now rather than at their next
    dream: how many, and the users a dream holds now (marked for the next one)."""
    from tasks.dream import rebuild_profiles

    return rebuild_profiles(settings, users)


@policy_app.command("set")
def policy_set(
    agent: Annotated[str, typer.Argument(metavar="AGENT", help="The agent id.")],
    assignments: Annotated[list[str], typer.Argument(metavar="KEY=VALUE", help="e.g. pruneStaleAfterDays=30")],
) -> None:
    """Set fields of an agent's dream policy; unset fields keep the defaults."""
    from store import policies
    from store.db import session_scope
    from worker.errors import ConfigError, InvalidSignal
    from worker.payloads import check_lookup
    from worker.policy import parse_assignments

    try:
        check_lookup("agent", agent)
        changes = parse_assignments(assignments)
    except (ConfigError, InvalidSignal) as exc:
        fail(str(exc), code=2)
    if agent == "*":
        # Where `policy show` lists the defaults; they come from the REVERIE_* settings.
        fail("'*' is not an agent: the defaults are the REVERIE_* settings (see reverie policy show)", code=2)
    settings = load_settings()
    with session_scope(settings) as session:
        stored = policies.merge_config(session, agent, changes)
    # What `policy show AGENT` prints now.
    _print_policies(settings, {agent: stored})


@policy_app.command("show")
def policy_show(
    agent: Annotated[
        str | None, typer.Argument(metavar="AGENT", help="One agent; all agents with a policy if omitted.")
    ] = None,
) -> None:
    """Print effective policies as JSON, each agent's with the fields set for it (its
    "overrides"), and, for all agents, the defaults under "*"."""
    from store import policies
    from store.db import session_scope
    from worker.errors import InvalidSignal
    from worker.payloads import check_lookup

    if agent is not None:
        try:
            check_lookup("agent", agent)  # as `policy set` and every other command take it
        except InvalidSignal as exc:
            fail(str(exc), code=2)
    settings = load_settings()
    with session_scope(settings) as session:
        configs = policies.all_configs(session) if agent is None else {agent: policies.get_config(session, agent) or {}}
    _print_policies(settings, configs, with_defaults=agent is None)


def _print_policies(settings: Settings, configs: dict[str, Any], *, with_defaults: bool = False) -> None:
    """The effective policies of these agents (their stored fields: ``configs``) as JSON."""
    from worker.policy import defaults, stored_policy

    out: dict[str, Any] = {"*": defaults(settings).as_config()} if with_defaults else {}
    for name, config in sorted(configs.items()):
        out[name] = {**stored_policy(settings, name, config).as_config(), "overrides": sorted(config)}
    print(json.dumps(out, sort_keys=True, indent=2))
