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
#: The user-info's start: scheme, user and the colon before a password.
_USERINFO = re.compile(r"^(?P<scheme>[^:/]+://)(?P<user>[^:@/]*):", re.IGNORECASE)
# libpq's key=value form ("host=db password=x"), outside any URL.
_KEYWORD = re.compile(r"(?i)\b(\w*(?:password|passwd|pwd|secret|token)\w*)(\s*=\s*)(?!\*\*\*)[^\s&'\"]+")


def is_secret_param(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in _SECRET_PARAM_PARTS)


def mask_url(url: str) -> str:
    """``url`` with its user-info password and every secret query parameter masked."""
    masked = _mask_password(url)
    head, sep, rest = masked.partition("?")
    if not sep:
        return masked
    query, hash_sep, fragment = rest.partition("#")
    params = []
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        params.append(f"{name}={MASK}" if eq and value and is_secret_param(name) else part)
    return f"{head}?{'&'.join(params)}{hash_sep}{fragment}"


def _mask_password(url: str) -> str:
    """``url`` with its user-info password masked. A password may hold ``/``, ``@``, ``?``
    and ``#`` (drivers take them unescaped): it runs to the last ``@`` before the query,
    or, where none is there, to the first ``@`` with no ``/`` before it (a ``?`` in the
    password), never short of a character that could still be the password's."""
    found = _USERINFO.match(url)
    if found is None:
        return url
    start = found.end()
    at = url.partition("?")[0].rfind("@")
    if at < start:
        at = url.find("@", start)
        if at < 0 or "/" in url[start:at]:
            return url  # a host and port (``redis://host:6379/0``): no password
    if at == start:
        return url  # an empty password
    return f"{found['scheme']}{found['user']}:{MASK}{url[at:]}"


def mask_secrets(text: str) -> str:
    """``text`` with every URL in it masked, and libpq ``password=...`` keywords too."""
    return _KEYWORD.sub(lambda m: f"{m[1]}{m[2]}{MASK}", _URL.sub(_mask_match, text))


def _mask_match(match: re.Match[str]) -> str:
    # Punctuation right after a URL belongs to the sentence ("... at URL: refused").
    found = match.group(0)
    url = found.rstrip(".,:;)]")
    return mask_url(url) + found[len(url) :]
