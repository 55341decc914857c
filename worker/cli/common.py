"""The Typer app every command module registers on, and the error presentation."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from worker.settings import Settings

app = typer.Typer(
    name="reverie",
    help="Reverie keeps AI-agent long-term memory healthy: prune, reconcile, summarize, ingest signals.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, as a command that works on users raises it: the way Ctrl-C ends it
    (the work under way closes its runs and gives its leases back), exit 143."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (``timeout``, systemd, Kubernetes ending an overrunning
    cron pass) raises :class:`Terminated` in this thread instead of ending the process
    where it stands."""

    def terminated(signum: int, frame: Any) -> None:
        # Once: the pass is stopping, and a second SIGTERM must not cut short the
        # closing of the chunks under way (SIGKILL still ends the process).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``reverie: error: message`` (one line, secrets masked) and exit with ``code``."""
    from worker.url_secrets import mask_secrets

    first = mask_secrets(" ".join(str(message).split()))
    print(f"reverie: error: {first}", file=sys.stderr)
    raise SystemExit(code)


def describe_error(exc: BaseException) -> str:
    """One line for an error, with no memory value in it (a cron job's output is mailed
    and kept like a log): ours say what is wrong; a database's names its SQLSTATE and
    the constraint, table and column it concerns, not its message, which can quote a
    row (:func:`worker.errors.describe`); a failed connection keeps its first line,
    which names the server; anything else is named by its type and where it was raised."""
    from worker.errors import ReverieError, describe

    if isinstance(exc, ReverieError):
        return str(exc)
    try:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err.get("loc", ())) or "settings"
            return f"invalid setting REVERIE_{field.upper()}: {err.get('msg', 'invalid')}"
    except ImportError:  # pragma: no cover
        pass
    try:
        from sqlalchemy.exc import SQLAlchemyError

        if isinstance(exc, SQLAlchemyError):
            orig = getattr(exc, "orig", None)
            if _connection_failed(orig):
                lines = str(orig).strip().splitlines()
                return f"database error: {lines[0] if lines else type(orig).__name__}"
            option = _option_refused(orig)
            if option:
                return f"REVERIE_DATABASE_URL: {option}"
            return f"database error: {describe(exc)}"
    except ImportError:  # pragma: no cover
        pass
    return f"unexpected {describe(exc)}"


def _connection_failed(orig: object) -> bool:
    """A failed connection (the server could not be reached, or refused it): an error
    with no SQLSTATE whose message is libpq's about the connection, which names the
    server, the database or the role, never a row. Any other error without a SQLSTATE
    (the server's words mid-statement) is described like the rest."""
    import psycopg

    return (
        isinstance(orig, psycopg.OperationalError)
        and not getattr(orig, "sqlstate", None)
        and str(orig).lstrip().startswith(("connection failed:", "connection to server"))
    )


#: libpq's and psycopg's words for a connection option of the URL they refused, before
#: any connection: they quote the option's name or value, from the URL, never a row.
_OPTION_ERRORS = ("invalid connection option", "invalid uri query parameter", "connection is bad: invalid ")


def _option_refused(orig: object) -> str | None:
    """The first line of a psycopg error about the URL's options (its ``?name=value``)."""
    import psycopg

    if not isinstance(orig, psycopg.Error) or getattr(orig, "sqlstate", None):
        return None
    lines = str(orig).strip().splitlines()
    first = lines[0] if lines else ""
    if not first.lower().startswith(_OPTION_ERRORS):
        return None
    return first.removeprefix("connection is bad: ")


def load_settings(*, database_must_exist: bool = True) -> Settings:
    """The process settings; a bad value becomes one line, not a pydantic dump.

    With no database configured, say which SQLite file is used (on stderr, so ``--json``
    output stays clean): a silently created ``./reverie.db`` looks like an empty
    production database. Unless ``database_must_exist`` is False (``reverie migrate``,
    which creates it, and the services, which wait for their database), a SQLite file
    that is not there is said so, exit 1, instead of an empty file left behind. Logging
    is set up here, to stderr, for every command.
    """
    from worker.logging_setup import configure_logging
    from worker.settings import get_settings

    try:
        settings = get_settings()
    except UnicodeDecodeError:
        fail(f"the settings file {Path('.env').resolve()} is not UTF-8 text")
    # Every command's log lines go to stderr, in the configured format: on stdout they
    # would break ``--json``.
    configure_logging(settings)
    if "database_url" not in settings.model_fields_set and settings.is_sqlite:
        print(
            f"reverie: REVERIE_DATABASE_URL is not set; using the SQLite file {settings.sqlite_path()}",
            file=sys.stderr,
        )
    if settings.is_sqlite and database_must_exist:
        path = settings.sqlite_path()
        if path != ":memory:" and not path.startswith("file:") and not Path(path).exists():
            folder = Path(path).parent
            why = "`reverie migrate` creates it" if folder.is_dir() else f"its directory {folder} does not exist"
            fail(f"no database at {path}: {why} (or set REVERIE_DATABASE_URL to yours)")
    return settings


def require_current_schema(settings: Settings) -> str:
    """Fail (one line, exit 1) unless the database is at this release's schema: a
    command that writes on a schema an earlier release left (mid-rollout) or a later one
    made (after a rollback) would write with statements that do not match it. Returns
    the revision."""
    from store.db import safe_url
    from store.migrate import current_revision, head_revision, is_newer, newer_schema

    revision, head = current_revision(settings), head_revision()
    if is_newer(revision):
        fail(str(newer_schema(settings, str(revision))))
    if revision != head:
        where = safe_url(settings.database_url)
        fail(f"database {where} is at revision {revision or 'none'}, not {head}: run reverie migrate")
    return head
