"""The structure of a JSON text outside its strings, scanned in slices: how many values it holds
and how deep it nests, known before anything is decoded.

msgspec decodes a body in one C call that holds the GIL throughout (~200 ms for 6 MB of small
objects), and a single C pass over megabytes does too; a worker thread doing either freezes the
event loop as surely as the loop doing it itself. Here every C call works on at most
`SLICE_BYTES`, so a thread scanning megabytes lets the event loop in between slices (the GIL
changes hands every 5 ms of Python-level work), and the body's cost is known before msgspec
would build it (server/limits.py refuses one over `MAX_JSON_VALUES`).

`data` need not be valid JSON (the scan runs before msgspec checks it); then the counts mean
little, and whatever is refused for them is still a 400.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate

SLICE_BYTES = 256 << 10

_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1 / -1
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{},"')


@dataclass(frozen=True)
class Shape:
    values: int  # commas + opening brackets outside strings: an upper bound on the values, less one
    depth: int  # the deepest nesting of arrays / objects


def shape(data: bytes | bytearray | memoryview | str) -> Shape:
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    view = memoryview(data).cast("B")
    values = depth = deepest = 0
    in_string = False
    carry = b""
    for start in range(0, len(view), SLICE_BYTES):
        piece = carry + bytes(view[start:start + SLICE_BYTES])
        # A backslash run at the end may escape the next slice's first byte: it moves there whole,
        # so pairs are still removed left to right, as JSON reads them.
        kept = len(piece.rstrip(b"\\"))
        piece, carry = piece[:kept], piece[kept:]
        # Without escaped backslashes and quotes, every quote left opens or closes a string.
        piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
        parts = piece.split(b'"')
        outside = b"".join(parts[1 if in_string else 0::2])
        in_string ^= (len(parts) - 1) % 2 == 1
        values += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        steps = array("b", outside.translate(_STEP, _NOT_BRACKET))
        if steps:
            deepest = max(deepest, max(accumulate(steps, initial=depth)))
            depth += sum(steps)
    return Shape(values, deepest)
