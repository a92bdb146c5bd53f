"""Size limits on what one request may ask for, checked before any work is done for it.

- JSON nesting depth (`MAX_JSON_DEPTH`), on every HTTP body and WebSocket frame (protocol.decode).
  msgspec decodes up to Python's recursion limit (~1000 levels) and raises RecursionError past
  it; what does decode still reaches recursive code later (the schema pipeline, the chat
  template, encoding the response object that echoes `tools` and `text.format`), so nesting far
  past what any real request needs is refused up front, naming the field that holds it.
- Tools per request (`ServerConfig.max_tools`) and bytes of JSON schema per request
  (`ServerConfig.max_schema_bytes`: every tool's `parameters` plus the response format), which
  bound the prompt's tools block and the grammar compile a request can cost the server.
- Messages per conversation (`MAX_MESSAGES`) and their total characters (what the context can
  hold at the tokenizer's longest token: ChatRenderer.check_length), checked before the chat
  template renders: a template walks every message, ~13 us each, so 200,000 empty messages
  would cost seconds of rendering before a length check after it refused them.
- Client strings the server echoes on its events (`check_echoed`): a Responses `stream_id` goes
  out on every event of its response, `metadata` on three; unbounded, one request could make
  the server send megabytes per token. The caps are OpenAI's for metadata, and `stream_id`'s
  a lane name's. (`instructions`, tool names and descriptions are echoed too, but they are
  part of the prompt, so the context bound covers them; `tool_choice` is echoed normalized.)
- JSON values per body / frame (`MAX_JSON_VALUES`), counted in slices before msgspec builds
  them (json_scan.py): decoding is one C call that holds the GIL, so its size bounds how long
  any thread, the event loop included, waits on one request's decoding.
- Bodies and frames over `OFF_LOOP_BYTES` are decoded, and their messages converted (Responses
  input: over `OFF_LOOP_MESSAGES` items), on a worker thread (ServerContext.parse): decoding
  6 MB of JSON takes ~0.1-0.5 s, which on the event loop would stall every stream that long.
"""

from __future__ import annotations

import msgspec

from prescient.server.errors import bad_request
from prescient.server.json_scan import shape

# 128 levels is a JSON schema ~60 objects deep (each level is a schema and its `properties`);
# the schema walkers recurse a few frames per level, well inside Python's limit of 1000.
MAX_JSON_DEPTH = 128
# Chat `messages` / Responses `input` items (with a previous response's conversation): far past
# any agent's conversation (each message costs a template a few tokens, so a context of 8192
# tokens holds fewer than 2,000), and bounds what is converted and rendered before the length
# check can refuse it.
MAX_MESSAGES = 4096
MAX_STREAM_ID_CHARS = 256  # a WebSocket lane's name, echoed on every event of its response
MAX_METADATA_PAIRS = 16  # OpenAI's metadata limits (echoed on the response object)
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# JSON values (array elements, object members) per body / frame: msgspec builds them in one C
# call holding the GIL (~0.35 us each), so this bounds that call to ~90 ms. 256Ki is 32 prompts of
# token ids of a 8192-token context, or 4096 messages of 60 values each.
MAX_JSON_VALUES = 1 << 18
OFF_LOOP_BYTES = 256 << 10  # bodies / frames larger than this are decoded off the event loop
OFF_LOOP_MESSAGES = 256  # Responses input items converted off the loop past this many (a frame's)

_encode = msgspec.json.Encoder().encode


def too_deep(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON `data` nests arrays / objects deeper than `limit`. Most requests hold fewer
    brackets than the limit and are answered by two counts; otherwise a scan in slices
    (json_scan.py)."""
    count = (data.count("[") + data.count("{")) if isinstance(data, str) else (data.count(b"[") + data.count(b"{"))
    if count <= limit:
        return False
    return shape(data).depth > limit


def check_values(data: bytes | str, limit: int = MAX_JSON_VALUES) -> None:
    """400 `too_many_values` naming the top-level field of a body / frame that holds more than
    `limit` JSON values, before msgspec builds them. A value takes a byte at least (its comma
    or bracket), so a text of fewer bytes is not scanned."""
    if len(data) <= limit:
        return
    try:  # top-level fields as raw slices: a skim, ~8 ms for 6 MB
        fields = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.MsgspecError, RecursionError):
        return  # not a JSON object, or too deep: decoding it says what is wrong
    counts = {name: shape(raw).values + 1 for name, raw in fields.items()}
    total = sum(counts.values())
    if total > limit:
        name = max(counts, key=counts.get)
        raise bad_request(f"the request holds {total} JSON values ({counts[name]} in {name}); the limit is {limit}",
                          param=name, code="too_many_values")


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


def check_messages(count: int, param: str) -> None:
    """400 `too_many_messages` for a conversation of more than `MAX_MESSAGES` messages."""
    if count > MAX_MESSAGES:
        raise bad_request(f"the conversation has {count} messages; the limit is {MAX_MESSAGES}", param=param,
                          code="too_many_messages")


def check_echoed(stream_id: str | None, metadata: dict | None) -> None:
    """400 naming the field for a client string the server would copy onto its events past its
    cap: `stream_id` (every event) and `metadata` (the response object)."""
    if stream_id is not None and len(stream_id) > MAX_STREAM_ID_CHARS:
        raise bad_request(f"stream_id is {len(stream_id)} characters; the limit is {MAX_STREAM_ID_CHARS}",
                          param="stream_id", code="string_too_long")
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata has {len(metadata)} pairs; the limit is {MAX_METADATA_PAIRS}", param="metadata",
                          code="too_many_metadata_pairs")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(f"a metadata key is {len(key)} characters; the limit is {MAX_METADATA_KEY_CHARS}",
                              param="metadata", code="string_too_long")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"metadata[{key!r}] is {len(value)} characters; the limit is "
                              f"{MAX_METADATA_VALUE_CHARS}", param=f"metadata.{key}", code="string_too_long")
