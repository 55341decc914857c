"""Secrets in connection URLs, masked wherever a URL is shown (messages, logs, JSON).

A URL can carry a secret in two places: the password of its user-info
(``postgresql://user:secret@host/db``) and query parameters that libpq, Redis and
HTTP clients accept (``?password=``, ``?sslpassword=``, ``?token=``...). Both are
replaced by ``***``; everything else stays, so the message still says where.
Imports nothing heavy: the command line uses it before any driver is loaded.
"""

from __future__ import annotations

import re

MASK = "***"

#: A query parameter whose name contains one of these carries a secret.
_SECRET_PARAM_PARTS = ("pass", "pwd", "token", "secret", "key", "credential", "auth", "sig")
_URL = re.compile(r"\b[a-z][a-z0-9+.\-]*://[^\s'\"<>]+", re.IGNORECASE)
_USERINFO_PASSWORD = re.compile(r"^(?P<scheme>[^:/]+://)(?P<user>[^:@/]*):(?P<password>[^@/]*)@", re.IGNORECASE)
# libpq's key=value form ("host=db password=x"), outside any URL.
_KEYWORD = re.compile(r"(?i)\b(\w*(?:password|passwd|pwd|secret|token)\w*)(\s*=\s*)(?!\*\*\*)[^\s&'\"]+")


def is_secret_param(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in _SECRET_PARAM_PARTS)


def mask_url(url: str) -> str:
    """``url`` with its user-info password and every secret query parameter masked."""
    masked = _USERINFO_PASSWORD.sub(
        lambda m: f"{m['scheme']}{m['user']}:{MASK}@" if m["password"] else m.group(0), url, count=1
    )
    head, sep, rest = masked.partition("?")
    if not sep:
        return masked
    query, hash_sep, fragment = rest.partition("#")
    params = []
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        params.append(f"{name}={MASK}" if eq and value and is_secret_param(name) else part)
    return f"{head}?{'&'.join(params)}{hash_sep}{fragment}"


def mask_secrets(text: str) -> str:
    """``text`` with every URL in it masked, and libpq ``password=...`` keywords too."""
    return _KEYWORD.sub(lambda m: f"{m[1]}{m[2]}{MASK}", _URL.sub(_mask_match, text))


def _mask_match(match: re.Match[str]) -> str:
    # Punctuation right after a URL belongs to the sentence ("... at URL: refused").
    found = match.group(0)
    url = found.rstrip(".,:;)]")
    return mask_url(url) + found[len(url) :]
