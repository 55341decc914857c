"""Logging helpers every module may use without configuring anything.

User ids appear in logs only as :func:`user_ref`, a keyed hash. Memory values,
transcripts and payloads never go into a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

import structlog

from worker.settings import PUBLIC_LOG_HASH_KEY, Settings, get_settings

_warned: set[str] = set()


def user_ref(user_id: str, key: str | None = None) -> str:
    """A stable, keyed, non-reversible stand-in for a user id (12 hex characters)."""
    secret = (key if key is not None else get_settings().log_hash_key).encode("utf-8")
    return hmac.new(secret, user_id.encode("utf-8"), hashlib.sha256).hexdigest()[:12]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger


def warn_if_public_hash_key(settings: Settings, *, process: str) -> bool:
    """Warn (once per process) that user ids in logs are hashed with the public default
    key; returns whether it warned. For the long-running services and cron passes:
    with a key anyone knows, a known user id can be hashed and found in the logs."""
    if settings.log_hash_key != PUBLIC_LOG_HASH_KEY or process in _warned:
        return False
    _warned.add(process)
    get_logger("reverie.settings").warning(
        "log_hash_key_is_public",
        process=process,
        hint="set REVERIE_LOG_HASH_KEY to a secret value of your own; user ids in logs are hashed with it",
    )
    return True


def warn_of_unknown_settings(*, process: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn (once per process) of the ``REVERIE_*`` environment variables no setting reads:
    a misspelled cap (``REVERIE_MAX_COST_PER_DAYY``) leaves the cap at its default.
    Returns the names (never their values: one may hold a secret)."""
    from worker.settings import settings_file_names, unknown_settings

    key = f"unknown:{process}"
    if environ is None:
        # The environment and the settings file (``.env``) alike: both set settings.
        environ = {**dict.fromkeys(settings_file_names(), ""), **os.environ}
    names = unknown_settings(environ)
    if not names or key in _warned:
        return names
    _warned.add(key)
    get_logger("reverie.settings").warning(
        "unknown_settings",
        process=process,
        names=names,
        hint="no setting reads these: a misspelled one keeps its default (see docs/reference.md, Settings)",
    )
    return names
