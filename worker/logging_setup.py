"""One logging pipeline for Reverie and the libraries it runs on.

:func:`configure_logging` makes structlog and the standard library write through the
same formatter to stderr: JSON lines by default, a readable console format when
stderr is a terminal (``REVERIE_LOG_FORMAT`` = ``auto`` | ``json`` | ``console``).
Celery's, kombu's, SQLAlchemy's and litellm's records pass through the same
:func:`redact` step as Reverie's own, so what callers may rely on holds for every
line: no memory value, transcript, payload, message content, e-mail address or
secret-looking string is written, and a user id appears only as
:func:`worker.logs.user_ref`.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from worker.logs import user_ref
from worker.settings import Settings
from worker.url_secrets import mask_secrets

__all__ = ["REDACTED", "configure_logging", "redact", "redact_text", "route_litellm_logging"]

REDACTED = "[redacted]"

# Fields whose value is user content whatever it looks like: dropped, never scanned.
_CONTENT_KEYS = frozenset(
    {
        "value",
        "values",
        "old_value",
        "new_value",
        "memory_value",
        "memory",
        "memories",
        "transcript",
        "message",
        "messages",
        "message_content",
        "content",
        "contents",
        "payload",
        "original",
        "edited",
        "evidence",
        "prompt",
        "prompts",
        "completion",
        "response",
        "body",
        "text",
        "summary",
        "attributes",
        "events",
        "args",
        "kwargs",
        "return_value",
        "retval",
        "result",
        "data",
    }
)
# Fields named like credentials: their string values are dropped.
_SECRET_KEY_PARTS = (
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "cookie",
    "credential",
)
_USER_KEYS = frozenset({"user_id", "user", "userid", "uid", "user_ref"})
_USER_REF = re.compile(r"[0-9a-f]{12}")
# Structure the renderer needs, and nothing a caller can put user text into.
_PASSTHROUGH_KEYS = frozenset({"level", "logger", "timestamp", "task_id", "task_name", "run_id", "signal_id"})

_TEXT_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # Celery's error lines about a message it cannot run quote the message whole (its
    # arguments name users; its headers carry them too).
    (
        re.compile(r"(The full contents of the message (?:body was|headers):)\s.*?(?=\n\n|\Z)", re.DOTALL),
        r"\1 " + REDACTED,
    ),
    (re.compile(r"(Can't decode message body: ).*", re.DOTALL), r"\1" + REDACTED),
    # SQLAlchemy appends bound parameters (memory values) to its error messages.
    (re.compile(r"\[parameters: .*?\](?=\s*(?:\(|\[|$))", re.DOTALL), "[parameters: " + REDACTED + "]"),
    # PostgreSQL echoes the offending row's values in DETAIL lines.
    (re.compile(r"(Key \([^)]*\))=\(.*?\)(?= already exists| is not present|\.|$)", re.MULTILINE), r"\1=(...)"),
    (re.compile(r"(DETAIL:\s*Failing row contains) \(.*\)"), r"\1 (...)"),
    (re.compile(r"(\b[a-z][a-z0-9+.\-]*://[^\s:/@]+:)[^\s@/]+@", re.IGNORECASE), r"\1***@"),
    (re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}"), "[email]"),
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]+=*"), "Bearer " + REDACTED),
    (re.compile(r"(?i)\bbasic\s+[A-Za-z0-9+/]{8,}=*"), "Basic " + REDACTED),
    (
        re.compile(
            r"(?i)\b((?:api|access|secret|private|client)[_\-]?key|api[_\-]?token|access[_\-]?token|"
            r"refresh[_\-]?token|auth[_\-]?token|client[_\-]?secret|secret|token|password|passwd|pwd)"
            r"(\"?'?\s*[:=]\s*\"?'?)[^\s,;\"'&]+"
        ),
        r"\1\2" + REDACTED,
    ),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), REDACTED),
    (re.compile(r"\b(?:sk|pk|rk)[-_](?:[A-Za-z0-9]+[-_])*[A-Za-z0-9]{12,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), REDACTED),
)
# Long random-looking words (mixed case and digits) are treated as secrets; ids, hex
# digests and UUIDs are single-case and stay readable.
_WORD = re.compile(r"[A-Za-z0-9_\-]{24,}")

# Loggers whose records can carry prompts or bound SQL parameters below WARNING.
# (SQLAlchemy's INFO is per-statement parameters and mapper chatter: never wanted.)
# Alembic's INFO is its migration context's chatter, on every revision check: a command
# that fails says so in one line, and ``reverie migrate`` says what it did itself.
_WARNING_FLOOR = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm", "sqlalchemy", "httpx", "openai", "alembic")
# Celery's pool writes each task's whole request and message body (its arguments: user
# ids) in a debug line: never below INFO, whatever ``REVERIE_LOG_LEVEL`` says.
_INFO_FLOOR = ("celery.pool",)
_ROUTED = ("celery", "kombu", "amqp", "billiard", "redis", *_WARNING_FLOOR, *_INFO_FLOOR)
_LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")


def _looks_random(word: str) -> bool:
    return any(c.isupper() for c in word) and any(c.islower() for c in word) and any(c.isdigit() for c in word)


def redact_text(text: str) -> str:
    """``text`` with e-mail addresses, credentials and secret-looking words replaced."""
    text = mask_secrets(text)
    for pattern, replacement in _TEXT_RULES:
        text = pattern.sub(replacement, text)
    return _WORD.sub(lambda m: REDACTED if _looks_random(m.group(0)) else m.group(0), text)


def _is_secret_key(key: str) -> bool:
    lowered = key.lower()
    return any(part in lowered for part in _SECRET_KEY_PARTS) and not lowered.endswith(("_tokens", "tokens"))


def _redact_value(key: str, value: Any, hash_key: str) -> Any:
    lowered = key.lower()
    if lowered in _CONTENT_KEYS:
        return REDACTED
    if lowered in _USER_KEYS and isinstance(value, str | int):
        # Callers are asked to log user_ref(user_id) already; hashing that again would
        # give a value an operator can no longer match.
        return value if _USER_REF.fullmatch(str(value)) else user_ref(str(value), hash_key)
    if _is_secret_key(lowered) and not isinstance(value, int | float | bool):
        return REDACTED
    return _scrub(value, hash_key)


def _scrub(value: Any, hash_key: str) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {str(k): _redact_value(str(k), v, hash_key) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_scrub(item, hash_key) for item in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    # Anything else would be rendered with repr(), which can hold anything.
    return redact_text(repr(value))


def redact(hash_key: str) -> Processor:
    """A structlog processor applying the redaction rules to every field of an event."""

    def processor(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
        for key in list(event_dict):
            if key in _PASSTHROUGH_KEYS or key.startswith("_"):
                continue
            event_dict[key] = _redact_value(key, event_dict[key], hash_key)
        return event_dict

    return processor


def _drop_color_message(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    # uvicorn-style duplicates of the message; never needed, may hold the same content.
    event_dict.pop("color_message", None)
    return event_dict


def _use_console(settings: Settings, stream: TextIO) -> bool:
    if settings.log_format == "console":
        return True
    if settings.log_format == "json":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _level(settings: Settings) -> int:
    level = logging.getLevelName(settings.log_level.strip().upper())
    return level if isinstance(level, int) else logging.INFO


#: Periodic housekeeping tasks that run every few seconds. Celery's own lines about
#: them (received, succeeded, beat's "Sending due task") are debug detail: at INFO an
#: idle deployment would log tens of thousands of them a day. The tasks log a line of
#: their own when they did something, and failures are logged as always.
QUIET_TASKS = ("schedules.dispatch", "schedules.sweep", "metrics.refresh_pending")
_QUIET_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


class _QuietHousekeeping(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or record.name not in _QUIET_LOGGERS:
            return True
        message = record.getMessage()
        return not any(name in message for name in QUIET_TASKS)


def configure_logging(settings: Settings, *, stream: TextIO | None = None) -> None:
    """Route structlog and standard-library logging through one redacting formatter.

    Safe to call again (each call replaces the handler it installed before). Records go
    to ``stream`` (default: the current ``sys.stderr``). Loggers that can carry prompts
    or SQL parameters (litellm's, SQLAlchemy's) stay at WARNING or above
    whatever ``REVERIE_LOG_LEVEL`` says.
    """
    out = stream if stream is not None else sys.stderr
    level = _level(settings)
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    pre_chain: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        timestamper,
    ]
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
        if _use_console(settings, out)
        else structlog.processors.JSONRenderer()
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _drop_color_message,
            # Tracebacks become text here so that the redaction below sees them too.
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            redact(settings.log_hash_key),
            renderer,
        ],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.set_name("reverie")
    if level > logging.DEBUG:
        handler.addFilter(_QuietHousekeeping())

    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "reverie"]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)

    for name in _ROUTED:
        lib_logger = logging.getLogger(name)
        lib_logger.handlers.clear()
        lib_logger.propagate = True
        lib_logger.setLevel(_floor(name, level))
    if "litellm" in sys.modules:
        route_litellm_logging()

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            timestamper,
            structlog.processors.UnicodeDecoder(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Module-level loggers are created before this runs; they must pick it up.
        cache_logger_on_first_use=False,
    )


def _floor(name: str, level: int) -> int:
    """The level a routed library logger is set to (NOTSET: the root's)."""
    if name in _WARNING_FLOOR:
        return max(level, logging.WARNING)
    if name in _INFO_FLOOR:
        return max(level, logging.INFO)
    return logging.NOTSET


def route_litellm_logging() -> None:
    """Take litellm's loggers off the handler litellm installs at import.

    litellm writes to its own stream handler in its own format; after this its records
    reach the root handler (and :func:`redact`) like any other, at WARNING or above,
    so prompts and completions never reach the log. Call it right after importing
    litellm; it is idempotent and cheap.
    """
    root_level = logging.getLogger().level
    for name in _LITELLM_LOGGERS:
        lib_logger = logging.getLogger(name)
        for foreign in list(lib_logger.handlers):
            lib_logger.removeHandler(foreign)
        lib_logger.propagate = True
        lib_logger.setLevel(max(root_level, logging.WARNING))
