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


def _string(node: dict[str, Any]) -> st.SearchStrategy[str]:
    if "enum" in node:
        return st.sampled_from(node["enum"]) | st.sampled_from([v.upper() for v in node["enum"]] + ["", "x"])
    low, high = node.get("minLength", 0), node.get("maxLength", 20)
    edges = [n for n in {0, low - 1, low, high, high + 1, min(high, 8)} if n >= 0]
    return st.sampled_from(edges).flatmap(lambda n: st.text(min_size=n, max_size=n)) | st.text(max_size=6)


def conforming(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values for one schema node, nearly always of its type and within its bounds."""
    types = node.get("type", "object")
    types = types if isinstance(types, list) else [types]
    options: list[st.SearchStrategy[Any]] = []
    for name in types:
        if name == "string":
            options.append(_string(node))
        elif name == "null":
            options.append(st.none())
        elif name == "array":
            high = min(node.get("maxItems", 4), 4)
            item = conforming(node.get("items", {}))
            options.append(st.lists(item, max_size=high) | st.lists(item, min_size=high + 1, max_size=high + 1))
        elif name == "object":
            options.append(_object(node))
    return st.one_of(*options)


def _object(node: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties = node.get("properties", {})
    required = set(node.get("required", []))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for name, sub in properties.items():
            present = draw(st.floats(0, 1)) < (0.95 if name in required else 0.5)
            if present:
                wrong = draw(st.floats(0, 1)) < WRONG
                value[name] = draw(ANY_JSON if wrong else conforming(sub))
        value.update(draw(st.dictionaries(st.sampled_from(["extra", "more"]), ANY_JSON, max_size=1)))
        return value

    return build()


@pytest.mark.parametrize("kind", KINDS)
def test_every_published_schema_compiles(kind: str) -> None:
    payloads._compile(schema(kind))  # raises for a keyword it does not know


@pytest.mark.parametrize("kind", KINDS)
@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_compiled_check_agrees_with_jsonschema(kind: str, data: st.DataObject) -> None:
    payload = data.draw(conforming(schema(kind)) | ANY_JSON)
    assert payloads._accepts(kind)(payload) == payloads._validator(kind).is_valid(payload), payload


def test_the_generated_payloads_are_both_valid_and_invalid() -> None:
    # The property above is worth something only if it sees both answers for each kind.
    seen: dict[str, set[bool]] = {kind: set() for kind in KINDS}

    @hsettings(max_examples=300, deadline=None)
    @given(data=st.data())
    def sample(data: st.DataObject) -> None:
        for kind in KINDS:
            seen[kind].add(payloads._validator(kind).is_valid(data.draw(conforming(schema(kind)))))

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
