"""JSON values as the database hands them to Python, and back.

A value nested deeper than Python's ``json`` reads (a few thousand levels: an
application may store one) is read as :class:`TooDeep` instead of failing the read, and
with it every run of that user's on every pass. It stands in for the value wherever the
value is only compared or shown, and can never be written back: :func:`write_json`
refuses it, so the stored value is never replaced by its stand-in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: What a line or a prompt shows of a value nested too deep to read.
TOO_DEEP_TEXT = "(a value nested too deep to show)"


class TooDeep(str):
    """A value nested too deep to read, as a text: the same for two reads of the same
    stored text (its digest is part of it), different for any other."""

    def __new__(cls, stored: str) -> TooDeep:
        digest = hashlib.sha256(stored.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return super().__new__(cls, f"{TOO_DEEP_TEXT[:-1]}, {digest})")


def read_json(text: str | bytes) -> Any:
    """``json.loads``, with a value nested too deep read as :class:`TooDeep`."""
    try:
        return json.loads(text)
    except RecursionError:
        return TooDeep(text if isinstance(text, str) else text.decode("utf-8", "replace"))


def write_json(value: Any) -> str:
    """``json.dumps``; a :class:`TooDeep` stand-in is refused (it is not the value)."""
    if isinstance(value, TooDeep):
        raise ValueError("a value nested too deep to read cannot be written back")
    return json.dumps(value)
