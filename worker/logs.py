"""Logging helpers every module may use without configuring anything.

User ids appear in logs only as :func:`user_ref`, a keyed hash. Memory values,
transcripts and payloads never go into a log line.
"""

from __future__ import annotations

import hashlib
import hmac

import structlog

from worker.settings import get_settings


def user_ref(user_id: str, key: str | None = None) -> str:
    """A stable, keyed, non-reversible stand-in for a user id (12 hex characters)."""
    secret = (key if key is not None else get_settings().log_hash_key).encode("utf-8")
    return hmac.new(secret, user_id.encode("utf-8"), hashlib.sha256).hexdigest()[:12]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger
