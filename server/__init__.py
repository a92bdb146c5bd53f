"""prescient.server: OpenAI-compatible HTTP + SSE and the Responses WebSocket over one AsyncEngine.

`prescient serve` (server/app.py) runs it under uvicorn. Endpoints:

    GET  /health                 200 once warmed up (503 before); exempt from the API key
    GET  /metrics                Prometheus text (server/metrics.py)
    GET  /v1/models[/{model}]    the served model; `model` may be its name or the alias "default"
    POST /v1/chat/completions    JSON or SSE; tools, tool_choice, response_format, stream_options
    POST /v1/completions         JSON or SSE (prompt as text or token ids)
    POST /v1/responses           JSON or SSE (the Responses API)
    WS   /v1/responses           OpenAI's Responses WebSocket mode (`client.responses.connect()`)

One request, fewest hops: a handler decodes its body into a msgspec Struct (protocol.py), renders
the conversation (chat.py, tools.py), compiles its grammar (constraints.py), and runs a
`Generation` (generation.py) on the AsyncEngine; API-specific code only turns the generation's
events into its wire types (chat_wire.py, responses_wire.py via responses.py) and writes them
(SSE: sse.py; WebSocket: responses_ws.py). Conversations for `previous_response_id` live in
sessions.py (bounded, expiring, continued only by the clients `--response-scope` admits); API
key and connection limit in access.py; per-request limits (JSON depth, tools, schema bytes) in
limits.py, the wall-clock limit in generation.py.

Defaults: `temperature` 1.0 (below 1e-5, 0 included, is greedy), `top_p` 1.0; `seed` any
signed 64-bit integer; output budget 1024 tokens for chat completions and responses when the
request sets none (cut to what fits the context and the KV cache; an explicit `max_tokens` /
`max_output_tokens` that does not fit, or a prompt that does not, is a 400), 16 for legacy
completions. A request that fits only once others finish waits in the engine's bounded queue;
a full queue or a wait past its limit is a 429 with `Retry-After` (runtime/config.py
SchedulerConfig).

Tools are rendered into the system prompt in the hermes format and calls are parsed in that
same format (see server/tools.py). With tools and `tool_choice` auto the grammar lets the model
write text or a well-formed call; `required` / a named function force calls.

prescient extensions: `top_k`, `min_p`, `ignore_eos` request fields; `text.format` /
`response_format` types `regex` (`{"type": "regex", "regex": ...}`) and `grammar` (xgrammar EBNF);
`generate: false` on `response.create` to prefill a conversation without generating; the
`response.cancel` client event; per-token timing on every delta (`token_times`, `num_tokens`,
`token_sources`) and `ttft_s` on the terminal Responses event.
"""
