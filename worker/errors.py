"""One root exception; subclasses carry their context in the constructor."""

from __future__ import annotations

import os
import re
from types import TracebackType


class ReverieError(Exception):
    """Root of every error Reverie raises on purpose."""


class ConfigError(ReverieError):
    """A setting or policy value is invalid."""


class DatabaseUnavailable(ReverieError):
    """The database at the configured URL cannot be reached."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"database unreachable at {url}: {reason}")


class SchemaMissing(ReverieError):
    """The database has not been migrated."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"database schema is missing or outdated ({detail}); run `reverie migrate`")


class MemoryTableMissing(SchemaMissing):
    """The memory table ``REVERIE_MEMORY_TABLE`` names does not exist (a migrated
    database: the setting names another table than the application's)."""

    def __init__(self, name: str) -> None:
        ReverieError.__init__(
            self,
            f"the memory table {name} does not exist: set REVERIE_MEMORY_TABLE to the memory table's name "
            "(reverie migrate creates one only for a new deployment)",
        )


class InvalidSignal(ReverieError):
    """A signal's kind, user or payload is not acceptable; ``field`` names the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class NotFound(ReverieError):
    """A row named by id does not exist."""

    def __init__(self, what: str, ident: object) -> None:
        self.what = what
        self.ident = ident
        super().__init__(f"{what} {ident!r} not found")


class ArchiveExpired(ReverieError):
    """A restore of a run or signal whose archived rows are past the archive's retention."""

    def __init__(self, what: str, changed: int) -> None:
        self.what = what
        self.changed = changed
        super().__init__(
            f"{what}: nothing put back: the {changed} entries it removed or overwrote were archived longer ago "
            "than REVERIE_ARCHIVE_RETENTION_DAYS, and the archive no longer holds them (nothing was changed)"
        )


class TransientError(ReverieError):
    """Worth retrying: a timeout, a rate limit, a lost connection."""


class PermanentError(ReverieError):
    """Not worth retrying: bad credentials, an unknown or unpriced model."""


class Interrupted(TransientError):
    """The task's soft time limit fired during a model call: the work stops here (no
    other call starts), and what is left waits for the next pass."""


class StoredValueUnreadable(ReverieError):
    """A JSON value in the database that Reverie cannot read: text that is not JSON
    (SQLite does not check a ``JSON`` column), or a value nested deeper than Python
    reads. The work that reads it fails, and is tried again as any failed work is,
    rather than rewrite or archive a value other than the one stored."""

    def __init__(self, why: str, hint: str = "") -> None:
        super().__init__(
            f"a value in the database {why} (a host's row in the memory table, most likely); "
            f"this user's work waits until that row is mended or removed{hint}"
        )


class ContextWindowExceeded(PermanentError):
    """The prompt is longer than the model's context window: the same prompt never fits."""


class BudgetExhausted(ReverieError):
    """A model call's reservation does not fit one of its budgets (``scope``: ``run``,
    ``day``, ``user``: the user's signals for the day, or ``signal``: the signal's own)."""

    def __init__(self, scope: str, needed: float, remaining: float) -> None:
        self.scope = scope
        self.needed = needed
        self.remaining = remaining
        super().__init__(f"{scope} budget exhausted: needed {needed:.6f} USD, {remaining:.6f} USD left")


class UserBusy(ReverieError):
    """Another run holds this user's dream lock."""

    def __init__(self, user_hash: str) -> None:
        super().__init__(f"a dream for user {user_hash} is already running")


class BrokerUnavailable(TransientError):
    """The message broker refused or could not take a message; ``sent`` went out before."""

    def __init__(self, reason: str, sent: int = 0) -> None:
        self.reason = reason
        self.sent = sent
        super().__init__(f"message broker unavailable: {reason}")


class LeaseLost(ReverieError):
    """A run's lease on a user ran out and was taken over, or the user was erased:
    nothing more may be written for that user under it."""

    def __init__(self, user_hash: str) -> None:
        super().__init__(f"the lease on user {user_hash} was lost; nothing more was written for that user")


class KeyModelUnavailable(ReverieError):
    """The key-matching model cannot be used (``reason``: missing, checksum, runtime, broken);
    the rules alone match keys."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"key-matching model unavailable ({reason}): {detail}")


class LexiconInvalid(ConfigError):
    """The key lexicon file cannot be read or is not laid out as documented."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"key lexicon {path}: {reason}")


#: Where Reverie's own code lives: a traceback's frames under it are ours.
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = tuple(os.path.join(_PROJECT, name) + os.sep for name in ("worker", "tasks", "store", "schedules"))


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame of Reverie's own code (relative to
    the project), and the innermost frame of all where that is a library's."""
    ours = last = None
    frame = exc.__traceback__
    while frame is not None:
        last = frame
        if frame.tb_frame.f_code.co_filename.startswith(_PACKAGES):
            ours = frame
        frame = frame.tb_next
    if last is None:
        return "?"
    where = [] if ours is None else [_frame_text(ours)]
    if last is not ours:
        where.append(("in " if where else "") + _frame_text(last))
    return " ".join(where)


def _frame_text(frame: TracebackType) -> str:
    name = frame.tb_frame.f_code.co_filename
    if name.startswith(_PACKAGES):
        name = os.path.relpath(name, _PROJECT)
    else:
        parts = name.split(os.sep)
        # A library's file from its package on (site-packages/<package>/...); the
        # standard library's as <package>/<file>.
        markers = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
        name = os.sep.join(parts[markers[-1] + 1 :] if markers else parts[-2:])
    return f"{name}:{frame.tb_lineno}"


#: A quoted span of a database's message (the value it could not take: ``invalid input
#: syntax for type integer: "abc"``), to its closing quote or the message's end; an
#: apostrophe within a word (``Session's``) opens none.
_QUOTED = re.compile(r"\"[^\"]*(?:\"|$)|(?<!\w)'[^']*(?:'|$)", re.DOTALL)


def describe(exc: BaseException) -> str:
    """One line on an error that may be kept and logged: no memory value in it.

    - Reverie's own errors are written to be safe and say what is wrong.
    - A database's error (PostgreSQL's through psycopg) is named by its class, its
      SQLSTATE and the names of the constraint, table, column and type it concerns:
      what an operator needs, never the message, whose text and detail lines can quote
      the rows (``Failing row contains ...``, ``Key (...)=(...)``, the value a type
      refused). Another driver's message is kept with every quoted span taken out.
    - SQLAlchemy's own errors (a pool timeout) keep their first line without its quoted
      spans (one may repeat a driver's message); the operating system's keep theirs.
    - Anything else (a bug, input nothing foresaw) is named by its type and where it was
      raised: its message may quote the values it was handed."""
    if isinstance(exc, ReverieError):
        return str(exc)
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        diag = getattr(orig, "diag", None)
        sqlstate = getattr(orig, "sqlstate", None)
        if diag is not None and sqlstate:
            names = [
                f"{label} {value}"
                for label, value in (
                    ("constraint", diag.constraint_name),
                    ("table", diag.table_name),
                    ("column", diag.column_name),
                    ("type", diag.datatype_name),
                )
                if value
            ]
            said = ", ".join([f"SQLSTATE {sqlstate}", *names])
            return f"{type(exc).__name__}: {type(orig).__name__} ({said})"
        if _is_driver_error(orig):
            first = _first_line(orig)
            return f"{type(exc).__name__}: {type(orig).__name__}: {_QUOTED.sub('…', first)}".rstrip(": ")
        return f"{type(exc).__name__}: {type(orig).__name__} at {raised_at(orig)}"
    if type(exc).__module__.startswith("sqlalchemy"):
        # Its own words, but one may quote a driver's message (``PendingRollbackError``:
        # "Original exception was: ..."): quoted spans are taken out too.
        return f"{type(exc).__name__}: {_QUOTED.sub('…', _first_line(exc))}".rstrip(": ")
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {_first_line(exc)}".rstrip(": ")
    return f"{type(exc).__name__} at {raised_at(exc)}"


def _is_driver_error(exc: BaseException) -> bool:
    """A DB-API driver's error (sqlite3's, psycopg's): its message is the database's."""
    return type(exc).__module__.split(".")[0] in ("sqlite3", "psycopg")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
