"""`ServerConfig` (the serving knobs) and `ServerContext` (what every handler shares).

The context holds the one `AsyncEngine` the server talks to and the per-server helpers built
around it: the chat renderer, the grammar constraints, the response store for
`previous_response_id`, and the metrics (requests judged against the config's `slo_*`). It also
turns a request's sampling fields into `SamplingParams` (with OpenAI's `logit_bias`, token-id
strings to biases) and checks the requested model name. Work that grows with a request's size
runs on its thread pools, never on the event loop: rendering and tokenizing, and decoding a body
or frame over `OFF_LOOP_BYTES` (server/limits.py) with its message conversion (`parse`).

A request's tenant, whose shared pool of recent outputs drafts for it, is its API key: with
`--api-key` a digest of the key it presented (today every authorized client holds the one key),
without one all clients are one tenant; `shared_pool=False` gives requests no tenant.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from prescient.grammar import GRAMMAR_BACKENDS, llguidance_available
from prescient.runtime.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from prescient.runtime.slo import SLOConfig
from prescient.server.chat import ChatRenderer, Rendered
from prescient.server.constraints import Constraints
from prescient.server.errors import APIError, bad_request
from prescient.server.limits import OFF_LOOP_BYTES
from prescient.server.metrics import ServerMetrics
from prescient.server.protocol import SamplingFields
from prescient.server.sessions import RESPONSE_SCOPES, Client, ResponseStore

MODEL_ALIAS = "default"
_TOKEN_ID = re.compile(r"-?[0-9]{1,12}")  # a logit_bias key (negative ids are refused by SamplingParams)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None  # served name; None: the model's own name
    api_key: str | None = None  # required as `Authorization: Bearer <key>` when set
    max_connections: int = 256  # HTTP requests in flight + open WebSockets
    max_body_bytes: int = 8 << 20  # HTTP request bodies
    max_frame_bytes: int = 4 << 20  # WebSocket client frames (larger: an `error` event)
    ws_buffer_bytes: int = 4 << 20  # per-connection outbound buffer; overflow ends the response
    max_responses_per_connection: int = 16  # responses in flight on one WebSocket
    default_max_tokens: int = 1024  # chat completions / responses when the request sets none
    default_completion_tokens: int = 16  # legacy completions, as OpenAI's default
    response_store_size: int = 4096  # conversations kept for previous_response_id (LRU beyond)
    response_store_mb: float = 256.0  # and the most memory they may hold (LRU beyond)
    response_ttl_s: float = 3600.0  # a stored conversation expires this long after its response
    # Who may continue a stored response: "key" (the API key that created it, over HTTP or any
    # WebSocket), "connection" (a WebSocket's responses only on that connection; HTTP's: by key),
    # "global" (anyone who knows the id). See sessions.py.
    response_scope: str = "key"
    # Limits a public endpoint needs (server/limits.py; each refusal is a 4xx naming the field):
    max_tools: int = 128  # tools declared in one request
    max_schema_bytes: int = 256 << 10  # JSON of one request's tool parameters + response format
    request_time_limit_s: float = 600.0  # wall clock from submission; past it: aborted, finish "error"
    # Slow clients (server/transport.py, access.py, responses_ws.py): without these a client that
    # sends half a request, or opens a WebSocket and goes quiet, holds its connection for good.
    header_timeout_s: float = 10.0  # from connect (or the previous response) to a request's full headers
    body_timeout_s: float = 30.0  # from the headers to the request body's last byte; past it 408
    ws_idle_timeout_s: float = 300.0  # a WebSocket with no frame and no response running: closed (1001)
    shutdown_grace_s: int = 10  # in-flight HTTP requests get this long to finish on shutdown
    # The SLO /metrics judges requests against (runtime/slo.py defines the verdict). The defaults
    # are latency_bench's cpu-interactive preset, for this CPU-first server: a ~900-token prompt
    # takes most of a second to prefill on 2 cores, so 1 s TTFT; per-emission gaps run 12-31 ms
    # at batch 1 (a speculative verify step the longest) and approach 100 ms with 16 concurrent
    # streams, so 100 ms for the p99 of a request's gaps between deliveries. TPOT is off by
    # default: TPOT is a request's mean per-token gap, at most its mean per-emission gap, so the
    # ITL bound nearly implies TPOT <= 100 ms; set it tighter to require a reading speed.
    # Start the grammar compiler's worker processes with the server (~2.5 s of low-priority CPU
    # and ~310 MB each, grammar/compile_pool.py) rather than at the first constrained request,
    # which would otherwise wait for them: once the engine has been idle warm_grammar_idle_s,
    # so that no stream decodes beside their start (Constraints.warm_when_idle). `prescient
    # serve` does; apps built in tests do not.
    warm_grammar: bool = False
    warm_grammar_idle_s: float = 1.0
    slo_ttft_ms: float | None = 1000.0  # None switches an objective off
    slo_itl_ms: float | None = 100.0  # p99 of a request's per-emission gaps
    slo_tpot_ms: float | None = None
    slo_window_s: float = 60.0  # span of the live attainment / goodput gauges
    # Whether a tenant's (an API key's) requests draft from the recent outputs of all its
    # sessions (speculative/suffix_pool.py); `--no-shared-pool` turns it off.
    shared_pool: bool = True
    # The grammar engine (grammar/compiler.py CompilerConfig.backend): "xgrammar", "llguidance"
    # (faster compiles, slower masks, refuses what it cannot enforce exactly: tool calls, EBNF,
    # some JSON-schema keywords) or "auto" (llguidance where it accepts a schema exactly, else
    # xgrammar; xgrammar then compiles it in a worker and serves its later requests: a new schema
    # waits milliseconds, a recurring one gets xgrammar's cheaper masks). `--grammar-backend`.
    grammar_backend: str = "auto" if llguidance_available() else "xgrammar"

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_body_bytes", "max_frame_bytes", "ws_buffer_bytes",
                     "max_responses_per_connection", "default_max_tokens", "default_completion_tokens",
                     "response_store_size", "max_tools", "max_schema_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("response_ttl_s", "response_store_mb", "request_time_limit_s", "header_timeout_s", "body_timeout_s",
                     "ws_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.response_scope not in RESPONSE_SCOPES:
            raise ValueError(f"response_scope must be one of {', '.join(RESPONSE_SCOPES)}")
        for name in ("slo_ttft_ms", "slo_itl_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or None: off)")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}")
        if self.grammar_backend != "xgrammar" and not llguidance_available():
            raise ValueError(f"grammar_backend {self.grammar_backend} needs llguidance: "
                             "pip install prescient[llguidance]")
        if not self.slo_window_s > 0:
            raise ValueError("slo_window_s must be > 0")

    @property
    def slo(self) -> SLOConfig:
        def seconds(ms: float | None) -> float | None:
            return None if ms is None else ms / 1e3

        return SLOConfig(name="server", ttft_s=seconds(self.slo_ttft_ms), itl_emission_p99_s=seconds(self.slo_itl_ms),
                         tpot_s=seconds(self.slo_tpot_ms))


class ServerContext:
    def __init__(self, aengine, config: ServerConfig = ServerConfig()):
        self.aengine = aengine
        self.engine = aengine.engine
        self.warm_grammar_task = None  # the compiler's start at boot (ServerConfig.warm_grammar)
        self.config = config
        engine = self.engine
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer")
        self.model_name = config.model_name or engine.model.config.name
        self.tokenizer = engine.tokenizer
        self.renderer = ChatRenderer(engine.tokenizer)
        self.metrics = ServerMetrics(engine, config.slo, config.slo_window_s)
        aengine.step_hooks.append(self.metrics.step_hook)
        self.constraints = Constraints(engine, self.metrics, config.grammar_backend)
        self.store = ResponseStore(config.response_store_size, config.response_ttl_s, config.response_scope,
                                   max_bytes=int(config.response_store_mb * (1 << 20)))
        self.metrics.watch_store(self.store)
        self.ready = False  # set once warmed up; /health answers 503 before
        self.max_model_len = engine.max_model_len
        self.kv_tokens = engine.kv_capacity  # a second limit on prompt + output (check_max_tokens)
        # Chat templates and tokenizing run here, off the event loop: a long prompt costs ~0.6 s
        # per million characters, and on the loop every stream and /health would wait for it.
        # (The tokenizer releases the GIL while it works.)
        self._text_pool = ThreadPoolExecutor(2, thread_name_prefix="prescient-tokenize")
        # Big bodies are decoded on a pool of their own, so a flood of them cannot queue in front
        # of the ordinary requests' rendering.
        self._parse_pool = ThreadPoolExecutor(2, thread_name_prefix="prescient-parse")

    async def render(self, system: list[str], messages: list[dict], *, param: str, **kwargs) -> Rendered:
        """ChatRenderer.render off the event loop; a text that cannot fit the context is refused
        before it is tokenized (400 naming `param`)."""
        return await self._off_loop(partial(self.renderer.render, system, messages, max_model_len=self.max_model_len,
                                            param=param, **kwargs))

    async def encode_prompt(self, text: str, param: str) -> list[int]:
        """A raw prompt's token ids, tokenized off the event loop (refused first if it cannot fit)."""
        self.renderer.check_length(len(text), self.max_model_len, param)
        return await self._off_loop(partial(self.tokenizer.encode, text))

    async def _off_loop(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn)

    async def parse(self, size: int, fn, limit: int = OFF_LOOP_BYTES):
        """`fn()` (decode a body of `size` bytes, convert its messages): on the event loop for a
        small body, where a thread hop would cost more than it saves; over `limit` on a worker
        thread (msgspec takes ~0.1-0.5 s for 6 MB, the message conversion as long again)."""
        if size <= limit:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, fn)

    def close(self) -> None:
        self._text_pool.shutdown(wait=False, cancel_futures=True)
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self.constraints.close()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, MODEL_ALIAS):
            raise APIError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r} "
                           f"(alias {MODEL_ALIAS!r})", param="model", code="model_not_found")

    def tenant(self, client: Client | None = None) -> str | None:
        """The shared pool a request of `client` may use (None: none). Without `client`, the
        server's own key stands for it (the key every authorized client presents)."""
        if not self.config.shared_pool:
            return None
        if self.config.api_key is None:
            return ""
        if client is not None and client.key:
            return client.key
        return hashlib.sha256(self.config.api_key.encode()).hexdigest()

    def sampling(self, fields: SamplingFields, max_tokens: int, *, stop=None, ignore_eos: bool = False,
                 logprobs: int | None = None, client: Client | None = None) -> SamplingParams:
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if fields.temperature is None else fields.temperature,
                top_p=1.0 if fields.top_p is None else fields.top_p,
                top_k=fields.top_k or 0,
                min_p=fields.min_p or 0.0,
                seed=fields.seed,
                stop=stop,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                presence_penalty=fields.presence_penalty or 0.0,
                frequency_penalty=fields.frequency_penalty or 0.0,
                speculate=fields.speculate is not False,
                max_itl_s=None if fields.slo is None or fields.slo.itl_ms is None else fields.slo.itl_ms / 1e3,
                max_ttft_s=None if fields.slo is None or fields.slo.ttft_ms is None else fields.slo.ttft_ms / 1e3,
                tenant=self.tenant(client),
                logit_bias=_logit_bias(fields.logit_bias),
            )
        except ValueError as err:  # SamplingParams names the field first
            message = str(err)
            raise bad_request(message, param=message.split(" ", 1)[0]) from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` object -> (token id, bias) pairs; keys must be decimal token ids.
    Ranges (ids >= 0, biases in [-100, 100]) are SamplingParams' to check, the vocabulary the
    engine's."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # before walking a huge object
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                          param="logit_bias")
    out = []
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {key!r:.40}",
                              param="logit_bias", code="invalid_value")
        out.append((int(key), float(value)))
    return tuple(out)
