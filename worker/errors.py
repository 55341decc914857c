"""One root exception; subclasses carry their context in the constructor."""

from __future__ import annotations

import re


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


class TransientError(ReverieError):
    """Worth retrying: a timeout, a rate limit, a lost connection."""


class PermanentError(ReverieError):
    """Not worth retrying: bad credentials, an unknown or unpriced model."""


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


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised (the innermost frame's file and line)."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else "?"


#: A value the database quotes at the end of its message (``invalid input syntax for
#: type integer: "abc"``).
_QUOTED_AT_END = re.compile(r':\s*"[^\n]*"\s*$')


def describe(exc: BaseException) -> str:
    """One line on an error that may be kept and logged: no memory value in it.

    Reverie's own errors are written to be safe and say what is wrong. A database's
    error keeps its driver's first line, which names the constraint, column or type
    (what an operator needs), without the detail lines under it (``Failing row
    contains ...``, ``Key (...)=(...)``), the statement's parameters, or a value quoted
    at its end. Anything else (a bug, input nothing foresaw) is named by its type and
    where it was raised: its message may quote the values it was handed."""
    if isinstance(exc, ReverieError):
        return str(exc)
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        lines = str(orig).strip().splitlines()
        first = _QUOTED_AT_END.sub(': "…"', lines[0]) if lines else ""
        return f"{type(exc).__name__}: {type(orig).__name__}: {first}".rstrip(": ")
    return f"{type(exc).__name__} at {raised_at(exc)}"
