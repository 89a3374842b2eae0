"""Reading an ONNX file's protobuf wire format, for the reader that serving needs without the
``onnx`` package: the tree walk's (``onnx_forest``).

``fields`` gives each field's value (a copy of its bytes); ``spans`` gives where each value lies in
the buffer instead, so that a large message is read without copying and can be patched in place.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["fields", "signed", "spans", "varint"]


def varint(data: bytes | bytearray | memoryview, at: int) -> tuple[int, int]:
    """The varint at ``at``: (value, the offset after it)."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def spans(
    data: bytes | bytearray | memoryview, start: int = 0, end: int | None = None
) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each field of the message in
    ``data[start:end]``, as offsets into ``data``. A varint's span is its encoded bytes."""
    at, end = start, len(data) if end is None else end
    while at < end:
        key, at = varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, after = varint(data, at)
        elif wire == 2:
            size, at = varint(data, at)
            after = at + size
        elif wire in (1, 5):
            after = at + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if after > end:
            raise ValueError("truncated field")
        yield number, wire, at, after
        at = after


def fields(data: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """(field number, wire type, value) of each field of one protobuf message: an int for varints,
    the raw bytes for the other wire types."""
    for number, wire, start, end in spans(data):
        yield number, wire, varint(data, start)[0] if wire == 0 else data[start:end]


def signed(value: int) -> int:
    """A varint read as the int64 it encodes."""
    return value - (1 << 64) if value >= 1 << 63 else value
