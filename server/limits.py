"""Size limits on what one request may ask for, checked before any work is done for it.

- JSON nesting depth (`MAX_JSON_DEPTH`), on every HTTP body and WebSocket frame (protocol.decode).
  msgspec decodes up to Python's recursion limit (~1000 levels) and raises RecursionError past
  it; what does decode still reaches recursive code later (the schema pipeline, the chat
  template, encoding the response object that echoes `tools` and `text.format`), so nesting far
  past what any real request needs is refused up front, naming the field that holds it.
- Tools per request (`ServerConfig.max_tools`) and bytes of JSON schema per request
  (`ServerConfig.max_schema_bytes`: every tool's `parameters` plus the response format), which
  bound the prompt's tools block and the grammar compile a request can cost the server.
"""

from __future__ import annotations

from array import array
from itertools import accumulate

import msgspec

from prescient.server.errors import bad_request

# 128 levels is a JSON schema ~60 objects deep (each level is a schema and its `properties`);
# the schema walkers recurse a few frames per level, well inside Python's limit of 1000.
MAX_JSON_DEPTH = 128

_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1 / -1
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_encode = msgspec.json.Encoder().encode


def too_deep(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON `data` nests arrays / objects deeper than `limit`. Most requests hold fewer
    brackets than the limit and are answered by two counts; otherwise a few passes at C speed
    (`data` is valid JSON: decode checks the depth after msgspec accepted it)."""
    count = (data.count("[") + data.count("{")) if isinstance(data, str) else (data.count(b"[") + data.count(b"{"))
    if count <= limit:
        return False
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    # Brackets inside strings do not nest. Without its escaped backslashes and quotes (removed
    # pairwise left to right, as JSON reads them), every quote left delimits a string, so the
    # even pieces between quotes are what lies outside strings.
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    outside = b"".join(data.split(b'"')[::2])
    steps = array("b", outside.translate(_STEP, _NOT_BRACKET))
    return max(accumulate(steps), default=0) > limit


def deep_field(value, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The request field (`tools[0].function.parameters`) of a decoded request whose value nests
    deeper than `limit`; walked without recursion, as the value is that deep."""
    stack = [(value, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, msgspec.Struct):
            children = [(getattr(v, f), f"{path}.{f}" if path else f) for f in v.__struct_fields__]
        elif isinstance(v, dict):
            children = [(x, path) for x in v.values()]
        elif isinstance(v, list):  # index only lists of Structs: a field's own JSON is named as a whole
            children = [(x, f"{path}[{i}]" if isinstance(x, msgspec.Struct) else path) for i, x in enumerate(v)]
        else:
            continue
        if depth > limit:
            return path or None
        stack.extend((x, p, depth + 1) for x, p in children)
    return None


def depth_error(param: str | None, limit: int = MAX_JSON_DEPTH):
    where = f" in {param}" if param else ""
    return bad_request(f"JSON nested deeper than {limit} levels{where}; flatten it", param=param,
                       code="json_too_deep")


def check_schemas(tools, fmt: dict | None, fmt_param: str, max_tools: int, max_schema_bytes: int) -> None:
    """400 when a request declares more than `max_tools` tools, or when its tools' `parameters`
    and its response format (`fmt`, named `fmt_param`) together are over `max_schema_bytes` of
    JSON."""
    if len(tools) > max_tools:
        raise bad_request(f"{len(tools)} tools declared; the limit is {max_tools} per request", param="tools",
                          code="too_many_tools")
    tool_bytes = sum(len(_encode(t.parameters)) for t in tools if t.parameters is not None)
    fmt_bytes = len(_encode(fmt)) if fmt is not None else 0
    if tool_bytes + fmt_bytes > max_schema_bytes:
        raise bad_request(f"the request's JSON schemas are {tool_bytes + fmt_bytes} bytes (tools' parameters "
                          f"{tool_bytes}, {fmt_param} {fmt_bytes}); the limit is {max_schema_bytes}",
                          param="tools" if tool_bytes >= fmt_bytes else fmt_param, code="schema_too_large")
