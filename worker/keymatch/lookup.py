"""Embedding tables looked up before they are scaled, not after: the same numbers for a
fraction of the memory.

The model file keeps each embedding table as int8 codes and one float32 scale per row,
turned back into float32 by a ``Cast`` and a ``Mul`` in the graph. Run as written, every
inference first rebuilds the whole word table in float32 (30,522 rows x 384, about
47 MB, twice over: the cast and the product) only to pick the few rows of the phrase's
tokens. :func:`look_up_first` rewrites ``Gather(Mul(Cast(codes), scale), ids)`` into
``Mul(Cast(Gather(codes, ids)), Gather(scale, ids))``: each picked element is the same
int8 code times the same float32 scale, so the result is identical, bit for bit.

The rewrite works on the ONNX protobuf's wire format directly (the ``onnx`` package is
not needed at run time); every part of the file it does not rewrite is kept byte for
byte. A graph without the pattern is returned unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Field numbers of onnx.proto3 that the rewrite reads or writes.
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO = 1, 5, 12, 13
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 2, 3, 4, 5, 7
_ATTR_NAME, _ATTR_I, _ATTR_TYPE = 1, 3, 20
_ATTR_TYPE_INT = 2
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME = 1, 2, 8
_VALUE_INFO_NAME = 1
_FLOAT, _INT8 = 1, 3

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a protobuf message this reader understands."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


@dataclass(frozen=True)
class _Field:
    number: int
    wire: int
    value: int | memoryview  # a varint's value, or the payload of the other wire types
    raw: memoryview  # the field as it was encoded, key included


def _fields(data: memoryview) -> list[_Field]:
    """The fields of one message, as views into ``data`` (nothing is copied)."""
    out: list[_Field] = []
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | memoryview
        if wire == _VARINT:
            value, pos = _varint(data, pos)
        elif wire == _BYTES:
            size, pos = _varint(data, pos)
            value = data[pos : pos + size]
            pos += size
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            value = data[pos : pos + size]
            pos += size
        else:
            raise WireError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise WireError("truncated field")
        out.append(_Field(number, wire, value, data[start:pos]))
    return out


def _payload(f: _Field) -> memoryview:
    if isinstance(f.value, int):
        raise WireError(f"field {f.number} is not length-delimited")
    return f.value


def _strings(fields: list[_Field], number: int) -> list[str]:
    return [bytes(_payload(f)).decode("utf-8") for f in fields if f.number == number]


def _string(fields: list[_Field], number: int) -> str:
    found = _strings(fields, number)
    return found[-1] if found else ""


def _ints(fields: list[_Field], number: int) -> list[int]:
    """A repeated int64, packed or not."""
    out: list[int] = []
    for f in fields:
        if f.number != number:
            continue
        if isinstance(f.value, int):
            out.append(f.value)
            continue
        pos = 0
        while pos < len(f.value):
            value, pos = _varint(f.value, pos)
            out.append(value)
    return out


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _BYTES) + _encode_varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _encode_varint(number << 3 | _VARINT) + _encode_varint(value)


@dataclass
class _Node:
    fields: list[_Field]
    name: str = field(init=False)
    inputs: list[str] = field(init=False)
    outputs: list[str] = field(init=False)
    op_type: str = field(init=False)
    domain: str = field(init=False)
    ints: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.name = _string(self.fields, _NODE_NAME)
        self.inputs = _strings(self.fields, _NODE_INPUT)
        self.outputs = _strings(self.fields, _NODE_OUTPUT)
        self.op_type = _string(self.fields, _NODE_OP_TYPE)
        self.domain = _string(self.fields, _NODE_DOMAIN)
        self.ints = {}
        for f in self.fields:
            if f.number == _NODE_ATTRIBUTE:
                attr = _fields(_payload(f))
                values = _ints(attr, _ATTR_I)
                if values:
                    self.ints[_string(attr, _ATTR_NAME)] = values[-1]

    def is_op(self, op_type: str) -> bool:
        return self.op_type == op_type and self.domain in ("", "ai.onnx")


def _node(op_type: str, inputs: list[str], outputs: list[str], name: str, ints: dict[str, int]) -> bytes:
    body = b"".join(_bytes_field(_NODE_INPUT, i.encode()) for i in inputs)
    body += b"".join(_bytes_field(_NODE_OUTPUT, o.encode()) for o in outputs)
    body += _bytes_field(_NODE_NAME, name.encode()) + _bytes_field(_NODE_OP_TYPE, op_type.encode())
    for key, value in ints.items():
        attr = _bytes_field(_ATTR_NAME, key.encode()) + _varint_field(_ATTR_I, value)
        body += _bytes_field(_NODE_ATTRIBUTE, attr + _varint_field(_ATTR_TYPE, _ATTR_TYPE_INT))
    return _bytes_field(_GRAPH_NODE, body)


@dataclass(frozen=True)
class _Table:
    """One embedding table to look up first: the nodes it replaces and the new ones."""

    gather: int  # index of the Gather node, where the new nodes go
    removed: tuple[int, int]  # indexes of the Cast and the Mul
    names: tuple[str, str]  # the tensors that are no longer computed
    nodes: bytes


def _tables(nodes: list[_Node], initializers: dict[str, tuple[int, list[int]]], outputs: set[str]) -> list[_Table]:
    producer = {out: i for i, n in enumerate(nodes) for out in n.outputs}
    uses: dict[str, int] = {}
    for n in nodes:
        for name in n.inputs:
            uses[name] = uses.get(name, 0) + 1
    taken = set(producer) | set(initializers) | {i for n in nodes for i in n.inputs}
    found: list[_Table] = []
    for index, gather in enumerate(nodes):
        if not gather.is_op("Gather") or len(gather.inputs) != 2 or gather.ints.get("axis", 0) != 0:
            continue
        table, ids = gather.inputs
        mul_at = producer.get(table)
        if mul_at is None or not nodes[mul_at].is_op("Mul") or len(nodes[mul_at].inputs) != 2:
            continue
        scaled, scale = nodes[mul_at].inputs
        cast_at = producer.get(scaled)
        if cast_at is None or not nodes[cast_at].is_op("Cast") or nodes[cast_at].ints.get("to") != _FLOAT:
            continue
        codes = nodes[cast_at].inputs[0]
        if codes not in initializers or scale not in initializers:
            continue
        (codes_type, codes_dims), (scale_type, scale_dims) = initializers[codes], initializers[scale]
        # One scale per row: then the picked rows' scales are the scales of the picked rows.
        if codes_type != _INT8 or scale_type != _FLOAT or len(codes_dims) != 2 or scale_dims != [codes_dims[0], 1]:
            continue
        if uses.get(table) != 1 or uses.get(scaled) != 1 or {table, scaled} & outputs:
            continue
        out = gather.outputs[0]
        picked, as_float, picked_scale = (f"{out}/looked_up_{part}" for part in ("codes", "float", "scale"))
        if {picked, as_float, picked_scale} & taken:
            continue
        name = gather.name or out
        new = _node("Gather", [codes, ids], [picked], f"{name}/codes", {"axis": 0})
        new += _node("Cast", [picked], [as_float], f"{name}/cast", {"to": _FLOAT})
        new += _node("Gather", [scale, ids], [picked_scale], f"{name}/scale", {"axis": 0})
        new += _node("Mul", [as_float, picked_scale], [out], f"{name}/mul", {})
        found.append(_Table(index, (cast_at, mul_at), (table, scaled), new))
    return found


def _initializers(graph: list[_Field]) -> dict[str, tuple[int, list[int]]]:
    """Each initializer's name -> (data type, dims)."""
    out: dict[str, tuple[int, list[int]]] = {}
    for f in graph:
        if f.number == _GRAPH_INITIALIZER:
            tensor = _fields(_payload(f))
            data_type = _ints(tensor, _TENSOR_DATA_TYPE)
            out[_string(tensor, _TENSOR_NAME)] = (data_type[-1] if data_type else 0, _ints(tensor, _TENSOR_DIMS))
    return out


def _graph_pieces(graph: list[_Field], tables: list[_Table]) -> list[bytes | memoryview]:
    """The rewritten graph's fields, in their order: views of the old ones, and the new nodes."""
    replaced = {t.gather: t.nodes for t in tables}
    dropped = {i for t in tables for i in t.removed}
    gone = {name for t in tables for name in t.names}
    pieces: list[bytes | memoryview] = []
    index = 0
    for f in graph:
        if f.number == _GRAPH_NODE:
            if index in replaced:
                pieces.append(replaced[index])
            elif index not in dropped:
                pieces.append(f.raw)
            index += 1
        elif f.number != _GRAPH_VALUE_INFO or _string(_fields(_payload(f)), _VALUE_INFO_NAME) not in gone:
            pieces.append(f.raw)  # (value_info of a tensor no longer computed is left out)
    return pieces


def look_up_first(model: bytes) -> tuple[bytes, int]:
    """The model with each int8 embedding table looked up before it is scaled, and how
    many tables were rewritten (0: the model is returned as it was).

    Raises :class:`WireError` for bytes that are not a protobuf message."""
    top = _fields(memoryview(model))
    graphs = [f for f in top if f.number == _MODEL_GRAPH]
    if len(graphs) != 1:
        return model, 0
    graph = _fields(_payload(graphs[0]))
    nodes = [_Node(_fields(_payload(f))) for f in graph if f.number == _GRAPH_NODE]
    outputs = {_string(_fields(_payload(f)), _VALUE_INFO_NAME) for f in graph if f.number == _GRAPH_OUTPUT}
    tables = _tables(nodes, _initializers(graph), outputs)
    if not tables:
        return model, 0
    body = _graph_pieces(graph, tables)
    pieces: list[bytes | memoryview] = []
    for f in top:
        if f.number == _MODEL_GRAPH:
            size = sum(len(piece) for piece in body)
            pieces += [_encode_varint(_MODEL_GRAPH << 3 | _BYTES) + _encode_varint(size), *body]
        else:
            pieces.append(f.raw)
    # One copy, made once: the views above point into ``model``.
    return b"".join(pieces), len(tables)
