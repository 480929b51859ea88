"""A fuzz case's gRPC bytes: a ``GenerateRequest`` held as a JSON tree, and raw fields for the
values the proto cannot hold.

``proto_bytes(tree)`` is the serialized request (``json_format``), or None when the tree holds a
value no ``GenerateRequest`` field takes (an int past int32, a string in an int field, a lone
surrogate, an unknown field). ``raw_field(path, value)`` is such a value as the field its Python
type would be on the wire, wrapped in its parent messages: appended to a valid message, it
reaches the server's parser as is (a scalar's last occurrence wins; a wire type that does not
match the field makes it an unknown field; an int is cut to the field's width). ``varint`` and
``field`` are the wire format's two pieces, shared with ``tests/unit/test_gateway_fuzz.py``.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from protos.baton.v1 import inference_pb2 as pb

Path = tuple[str | int, ...]
"""Where a node sits in a JSON tree: object keys and list indices."""
UNKNOWN_FIELD_NUMBER = 99
"""The field number an unknown field is sent under (``GenerateRequest`` has 1 to 7)."""
VARINT, FIXED64, LENGTH_DELIMITED = 0, 1, 2


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (a negative one as its 64-bit two's complement)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One field: its tag, then ``payload`` (length-prefixed for ``LENGTH_DELIMITED``)."""
    tag = varint(number << 3 | wire_type)
    if wire_type == LENGTH_DELIMITED:
        return tag + varint(len(payload)) + payload
    return tag + payload


def _proto_json(value: Any) -> Any:
    """A tree as ``json_format`` takes it: non-finite floats as its quoted names."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _proto_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_proto_json(v) for v in value]
    return value


def proto_bytes(tree: dict) -> bytes | None:
    """The serialized ``GenerateRequest`` of ``tree``, or None when the proto cannot hold it."""
    try:
        return json_format.ParseDict(_proto_json(tree), pb.GenerateRequest()).SerializeToString()
    except (json_format.ParseError, TypeError, ValueError):
        return None


def _raw_value(number: int, value: Any) -> bytes:
    """``value`` as the field(s) numbered ``number`` its Python type would be on the wire."""
    if value is None:
        return b""
    if isinstance(value, list):
        return b"".join(_raw_value(number, item) for item in value)
    if isinstance(value, (bool, int)):
        return field(number, VARINT, varint(int(value)))
    if isinstance(value, float):
        return field(number, FIXED64, struct.pack("<d", value))
    data = (value.encode("utf-8", "surrogatepass") if isinstance(value, str)
            else json.dumps(value).encode())
    return field(number, LENGTH_DELIMITED, data)


def raw_field(path: Path, value: Any) -> bytes:
    """``value`` at ``path`` as raw bytes, parent messages wrapped around it. A list index in the
    path adds one more element; a path through an unknown field ends there, as an unknown field
    holding the rest as JSON."""
    descriptor = pb.GenerateRequest.DESCRIPTOR
    numbers: list[int] = []
    keys = [key for key in path if isinstance(key, str)]
    for depth, key in enumerate(keys):
        known = descriptor.fields_by_name.get(key) if descriptor is not None else None
        if known is None:
            numbers.append(UNKNOWN_FIELD_NUMBER)
            if depth + 1 < len(keys):
                value = {".".join(keys[depth + 1:]): value}
            break
        numbers.append(known.number)
        descriptor = known.message_type if known.type == FieldDescriptor.TYPE_MESSAGE else None
    data = _raw_value(numbers[-1], value)
    for number in reversed(numbers[:-1]):
        data = field(number, LENGTH_DELIMITED, data)
    return data
