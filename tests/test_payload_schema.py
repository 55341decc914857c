"""The compiled payload check says "valid" exactly where jsonschema does, for every kind's
published schema, on payloads generated from the schemas themselves: mostly close to
valid, with every keyword's bound and type crossed now and then."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from worker import payloads
from worker.errors import InvalidSignal
from worker.payloads import KINDS, schema
from worker.settings import Settings

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.just(1.0),
    st.text(max_size=4),
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
WRONG = 0.1  # how often a generated value ignores its schema


def _enum(node: dict[str, Any], strict: bool) -> st.SearchStrategy[Any]:
    valid = st.sampled_from(node["enum"])
    if strict:
        return valid
    return valid | st.sampled_from([str(v).upper() for v in node["enum"]] + ["", "x"])


def _string(node: dict[str, Any], strict: bool) -> st.SearchStrategy[str]:
    if "enum" in node:
        return _enum(node, strict)
    low, high = node.get("minLength", 0), node.get("maxLength", 20)
    if strict:
        return st.text(min_size=low, max_size=max(low, min(high, 8)))
    edges = [n for n in {0, low - 1, low, high, high + 1, min(high, 8)} if n >= 0]
    return st.sampled_from(edges).flatmap(lambda n: st.text(min_size=n, max_size=n)) | st.text(max_size=6)


def conforming(node: dict[str, Any], strict: bool = False) -> st.SearchStrategy[Any]:
    """Values for one schema node: ``strict``, always of its type and within its bounds;
    else nearly always, with each bound crossed now and then."""
    if "enum" in node and "type" not in node:
        return _enum(node, strict)
    types = node.get("type", "object")
    types = types if isinstance(types, list) else [types]
    options: list[st.SearchStrategy[Any]] = []
    for name in types:
        if name == "string":
            options.append(_string(node, strict))
        elif name == "null":
            options.append(st.none())
        elif name == "array":
            high = min(node.get("maxItems", 4), 4)
            item = conforming(node.get("items", {}), strict)
            options.append(st.lists(item, min_size=node.get("minItems", 0), max_size=high))
            if not strict:
                options.append(st.lists(item, min_size=high + 1, max_size=high + 1))
        elif name == "object":
            options.append(_object(node, strict))
    return st.one_of(*options)


def _object(node: dict[str, Any], strict: bool) -> st.SearchStrategy[dict[str, Any]]:
    properties = node.get("properties", {})
    required = set(node.get("required", []))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for name, sub in properties.items():
            present = name in required if strict else draw(st.floats(0, 1)) < (0.95 if name in required else 0.5)
            if present or (strict and draw(st.booleans())):
                wrong = not strict and draw(st.floats(0, 1)) < WRONG
                value[name] = draw(ANY_JSON if wrong else conforming(sub, strict))
        if not strict or node.get("additionalProperties", True) is not False:
            value.update(draw(st.dictionaries(st.sampled_from(["extra", "more"]), ANY_JSON, max_size=1)))
        return value

    return build()


def payloads_of(kind: str) -> st.SearchStrategy[Any]:
    """A kind's payloads: half drawn strictly within its schema, half close to it."""
    return st.booleans().flatmap(lambda strict: conforming(schema(kind), strict))


@pytest.mark.parametrize("kind", KINDS)
def test_every_published_schema_compiles(kind: str) -> None:
    payloads._compile(schema(kind))  # raises for a keyword it does not know


@pytest.mark.parametrize("kind", KINDS)
@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_compiled_check_agrees_with_jsonschema(kind: str, data: st.DataObject) -> None:
    payload = data.draw(payloads_of(kind) | ANY_JSON)
    assert payloads._accepts(kind)(payload) == payloads._validator(kind).is_valid(payload), payload


def test_the_generated_payloads_are_both_valid_and_invalid() -> None:
    # The property above is worth something only if it sees both answers for each kind.
    seen: dict[str, set[bool]] = {kind: set() for kind in KINDS}

    @hsettings(max_examples=300, deadline=None)
    @given(data=st.data())
    def sample(data: st.DataObject) -> None:
        for kind in KINDS:
            seen[kind].add(payloads._validator(kind).is_valid(data.draw(payloads_of(kind))))

    sample()
    assert seen == {kind: {True, False} for kind in KINDS}


def test_a_schema_with_a_keyword_it_does_not_know_is_left_to_jsonschema() -> None:
    with pytest.raises(NotImplementedError):
        payloads._compile({"type": "object", "minProperties": 1})
    with pytest.raises(NotImplementedError):
        payloads._compile({"type": "object", "additionalProperties": False})


def test_errors_still_name_the_field() -> None:
    settings = Settings(_env_file=None)
    with pytest.raises(InvalidSignal) as caught:
        payloads.validate_payload("activity", {"events": [{"action": "", "at": "2026-01-05T09:00:00Z"}]}, settings)
    assert caught.value.field == "payload.events[0].action"
