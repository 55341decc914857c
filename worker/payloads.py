"""Validation of signal kinds, users and payloads (docs/reference.md, Signals).

The JSON Schemas in ``worker/schemas/`` are the published shape; this module applies
them plus the limits a schema cannot express (byte size, depth, NUL bytes, real
ISO-8601 timestamps, the settings' item cap). Every failure is an
:class:`~worker.errors.InvalidSignal` whose ``field`` is a path such as
``payload.messages[3].role``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from worker.errors import InvalidSignal
from worker.settings import Settings

KINDS = ("session_end", "feedback", "activity")
ITEM_FIELDS = {"session_end": "messages", "activity": "events"}
MAX_DEPTH = 32
MAX_ID_LENGTH = 255


@cache
def schema(kind: str) -> dict[str, Any]:
    """The published JSON Schema for one payload kind."""
    text = resources.files("worker.schemas").joinpath(f"{kind}.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@cache
def _validator(kind: str) -> Draft202012Validator:
    return Draft202012Validator(schema(kind))


Check = Callable[[Any], bool]

#: Keywords that only describe: they never make a payload invalid (``format`` is an
#: annotation in draft 2020-12 unless a format checker is given, and none is).
_ANNOTATIONS = frozenset({"$schema", "$id", "title", "description", "format"})
#: JSON types as draft 2020-12 tells them apart (``True`` is no integer; ``1.0`` is).
_TYPES: dict[str, Check] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}


@cache
def _accepts(kind: str) -> Check:
    """A check of the payload against its kind's schema, compiled once into plain Python:
    True only where jsonschema finds no error (``tests/test_payload_schema.py`` holds the
    two to the same answer). A schema using a keyword it does not know compiles to a
    check that accepts nothing, so jsonschema alone decides."""
    try:
        return _compile(schema(kind))
    except NotImplementedError:
        return lambda _payload: False


_KEYWORDS = frozenset(
    {"type", "enum", "minLength", "maxLength", "maxItems", "required", "properties", "additionalProperties", "items"}
)


def _compile(node: dict[str, Any]) -> Check:
    unknown = set(node) - _ANNOTATIONS - _KEYWORDS
    if unknown or node.get("additionalProperties", True) is not True:
        raise NotImplementedError(", ".join(sorted(unknown)) or "additionalProperties")
    checks = [*_value_checks(node), *_container_checks(node)]
    return lambda v: all(check(v) for check in checks)


def _value_checks(node: dict[str, Any]) -> Iterator[Check]:
    if "type" in node:
        names = node["type"] if isinstance(node["type"], list) else [node["type"]]
        kinds = [_TYPES[name] for name in names]
        yield lambda v: any(is_kind(v) for is_kind in kinds)
    if "enum" in node:
        allowed = list(node["enum"])
        if not all(isinstance(value, str) for value in allowed):
            raise NotImplementedError("enum of other than strings")
        yield lambda v: isinstance(v, str) and v in allowed
    if "minLength" in node:
        low = int(node["minLength"])
        yield lambda v: not isinstance(v, str) or len(v) >= low
    if "maxLength" in node:
        high = int(node["maxLength"])
        yield lambda v: not isinstance(v, str) or len(v) <= high


def _container_checks(node: dict[str, Any]) -> Iterator[Check]:
    if "maxItems" in node:
        most = int(node["maxItems"])
        yield lambda v: not isinstance(v, list) or len(v) <= most
    if "required" in node:
        required = list(node["required"])
        yield lambda v: not isinstance(v, dict) or all(name in v for name in required)
    if "properties" in node:
        fields = {name: _compile(sub) for name, sub in node["properties"].items()}
        yield lambda v: not isinstance(v, dict) or all(check(v[name]) for name, check in fields.items() if name in v)
    if "items" in node:
        if not isinstance(node["items"], dict):
            raise NotImplementedError("items that is not one schema")
        item = _compile(node["items"])
        yield lambda v: not isinstance(v, list) or all(item(x) for x in v)


def canonical_json(payload: Any) -> str:
    """The payload as compact JSON with sorted keys (hashing and size checks)."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def default_idempotency_key(kind: str, user_id: str, payload: Any) -> str:
    """sha256 over kind, user and canonical payload (used where the database cannot)."""
    material = f"{kind}\n{user_id}\n{canonical_json(payload)}"
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


def check_identifier(field: str, value: Any, *, required: bool) -> str | None:
    if value is None:
        if required:
            raise InvalidSignal(field, "is required")
        return None
    if not isinstance(value, str):
        raise InvalidSignal(field, f"must be a string, not {type(value).__name__}")
    if not value.strip():
        raise InvalidSignal(field, "must not be empty")
    return check_lookup(field, value)


def check_lookup(field: str, value: str) -> str:
    """A user or agent named to look up, erase or dream: as the application's rows may
    name them, so anything but empty (spaces alone included, which a signal may not
    write), with no NUL byte and no longer than Reverie's tables hold."""
    if not value:
        raise InvalidSignal(field, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidSignal(field, f"is {len(value)} characters long; at most {MAX_ID_LENGTH} allowed")
    if "\x00" in value:
        raise InvalidSignal(field, "contains a NUL byte")
    return value


def check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise InvalidSignal("kind", f"unknown kind {str(kind)[:40]!r}; expected one of {', '.join(KINDS)}")
    return str(kind)


def validate_signal(
    kind: Any,
    user_id: Any,
    payload: Any,
    settings: Settings,
    *,
    agent_id: Any = None,
    idempotency_key: Any = None,
) -> None:
    """Raise :class:`InvalidSignal` naming the first bad field; return if all is well."""
    check_kind(kind)
    check_identifier("user_id", user_id, required=True)
    check_identifier("agent_id", agent_id, required=False)
    check_identifier("idempotency_key", idempotency_key, required=False)
    validate_payload(kind, payload, settings)


def validate_payload(kind: str, payload: Any, settings: Settings) -> None:
    if not isinstance(payload, dict):
        raise InvalidSignal("payload", f"must be a JSON object, not {_json_type(payload)}")
    _check_depth_and_nul(payload, "payload", 0)
    try:
        size = len(canonical_json(payload).encode("utf-8"))
    except (ValueError, TypeError) as exc:  # NaN/inf or a non-JSON Python value
        raise InvalidSignal("payload", f"is not valid JSON: {exc}") from exc
    if size > settings.max_payload_bytes:
        raise InvalidSignal("payload", f"is {size} bytes; at most {settings.max_payload_bytes} allowed")
    items_field = ITEM_FIELDS.get(kind)
    if items_field is not None:
        items = payload.get(items_field)
        if isinstance(items, list) and len(items) > settings.max_items_per_signal:
            raise InvalidSignal(
                f"payload.{items_field}",
                f"has {len(items)} items; at most {settings.max_items_per_signal} allowed",
            )
    error = _first_error(kind, payload)
    if error is not None:
        raise InvalidSignal(_path("payload", error.absolute_path), _describe(error))
    for path, value in _timestamps(kind, payload):
        if value is not None:
            parse_timestamp(path, value)


def parse_timestamp(field: str, value: Any) -> datetime:
    """An ISO-8601 timestamp as naive UTC; a time without zone is taken as UTC."""
    if not isinstance(value, str):
        raise InvalidSignal(field, "must be an ISO-8601 timestamp string")
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError as exc:
        # Not quoted: the error is kept with the signal after retention empties its
        # payload, and a producer may have put anything in this field.
        raise InvalidSignal(field, f"is not an ISO-8601 timestamp (a string of {len(value)} characters)") from exc
    if not 1970 <= parsed.year <= 9998:
        raise InvalidSignal(field, "is out of range: years 1970 to 9998")
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC).replace(tzinfo=None)
    return parsed


def _timestamps(kind: str, payload: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    if kind == "session_end":
        yield "payload.ended_at", payload.get("ended_at")
        for i, message in enumerate(payload.get("messages", [])):
            yield f"payload.messages[{i}].at", message.get("at")
    elif kind == "feedback":
        yield "payload.at", payload.get("at")
    elif kind == "activity":
        for i, item in enumerate(payload.get("events", [])):
            yield f"payload.events[{i}].at", item.get("at")


def _first_error(kind: str, payload: dict[str, Any]) -> ValidationError | None:
    if _accepts(kind)(payload):
        # Valid, decided by the compiled check (most payloads): jsonschema walks the
        # payload again only to name what is wrong with it.
        return None
    # The shallowest error first: "messages is missing" before "messages[3].role is wrong".
    errors = sorted(
        _validator(kind).iter_errors(payload),
        key=lambda e: (e.json_path.count(".") + e.json_path.count("["), e.json_path),
    )
    return errors[0] if errors else None


def _describe(error: ValidationError) -> str:
    validator = error.validator
    if validator == "required":
        missing = str(error.message).split("'")[1] if "'" in error.message else "a field"
        return f"is missing required field {missing!r}"
    if validator == "type":
        return f"must be {_type_words(error.validator_value)}, not {_json_type(error.instance)}"
    if validator == "enum":
        allowed: Any = error.validator_value
        return f"must be one of {', '.join(str(v) for v in allowed)}"
    if validator == "minLength":
        return "must not be empty"
    if validator == "maxLength":
        return f"is longer than {error.validator_value} characters"
    if validator == "maxItems":
        return f"has more than {error.validator_value} items"
    return str(error.message)[:200]


def _type_words(expected: Any) -> str:
    names = [expected] if isinstance(expected, str) else list(expected)
    words = {"object": "a JSON object", "array": "an array", "string": "a string", "null": "null"}
    return " or ".join(words.get(n, n) for n in names)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _path(root: str, parts: Any) -> str:
    out = root
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


#: The largest finite double, as an integer: a JSON integer past it is beyond a double's range.
_LARGEST_DOUBLE = int(sys.float_info.max)


def _check_depth_and_nul(value: Any, path: str, depth: int) -> None:
    # Iterative enough for our cap: recursion stops at MAX_DEPTH, so no RecursionError.
    if depth > MAX_DEPTH:
        raise InvalidSignal(path, f"is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidSignal(path, "contains a NUL byte")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidSignal(path, "has a non-string key")
            if "\x00" in key:
                raise InvalidSignal(path, "has a key containing a NUL byte")
            _check_depth_and_nul(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_depth_and_nul(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        _check_number(value, path)


def _check_number(value: float, path: str) -> None:
    # An integer is compared as one (a float of it may overflow).
    if not isinstance(value, int) and math.isnan(value):
        raise InvalidSignal(path, "is NaN, which JSON does not allow")
    # ``Infinity``, a number past a double's range (1e400) that Python reads as it, or
    # the same written as an integer: PostgreSQL's ``jsonb`` gives ``1e400`` back as its
    # 401 digits, and a producer may write them so.
    if abs(value) > _LARGEST_DOUBLE if isinstance(value, int) else math.isinf(value):
        raise InvalidSignal(path, "is infinite or beyond a double's range (about 1.8e308), which Reverie does not take")
