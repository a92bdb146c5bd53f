"""`prescient` console script: serve, generate, bench.

`prescient serve` runs the Starlette app (server/) under uvicorn with the default model;
`prescient generate` prints one completion (a quick check without a server);
`prescient bench` runs latency_bench.
"""

from __future__ import annotations

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float64"],
                   help="weights and activations dtype (default bfloat16: the faster one on these CPUs)")
    p.add_argument("--speculate", default="ngram", choices=["ngram", "draft", "off"],
                   help="speculative decoding proposer (default ngram)")
    p.add_argument("--draft-model", default=None, help="draft model path for --speculate draft "
                   "(default: a layer-truncated copy of the target)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (CUDA tensors run the Triton kernels)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # latency_bench owns its whole command line (argparse's REMAINDER would refuse a leading
        # option such as `bench --quick`), so hand it over before parsing
        from prescient.latency_bench.__main__ import main as bench_main

        return bench_main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="prescient", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP + WebSocket server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--max-connections", type=int, default=256)

    gen = sub.add_parser("generate", help="generate one completion and print it")
    _add_model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)

    sub.add_parser("bench", help="latency benchmark; see `prescient bench --help`")

    args = parser.parse_args(argv)
    if args.command == "serve":
        from prescient.server.app import run_server

        return run_server(args) or 0
    if args.command == "generate":
        return _generate(args)
    return 2


def build_engine(args):
    """An Engine from the shared model arguments (used by serve, generate and bench)."""
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import Engine, EngineConfig

    config = EngineConfig(
        dtype=args.dtype,
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gb * (1 << 30))),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
    )
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, config=config, device=getattr(args, "device", "cpu"))
    _attach_speculator(engine, args)
    return engine


def _attach_speculator(engine, args) -> None:
    if getattr(args, "speculate", "off") == "off":
        return
    try:
        from prescient.speculative.speculator import make_speculator
    except ImportError:
        return
    engine.speculator = make_speculator(engine, args.speculate, getattr(args, "draft_model", None))


def _generate(args) -> int:
    from prescient.runtime.sampling_params import SamplingParams

    engine = build_engine(args)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    out = engine.generate([ids], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))[0]
    print(engine.tokenizer.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
