"""prescient through its server beside llama.cpp, through its server and in process: greedy
batch-1 decode speed and cold TTFT on the same weights, interleaved in one run, with the bandwidth
floor measured alongside.

    python -m prescient.latency_bench.peer_decode [--bf16-gguf F] [--q8-gguf F] [--isa avx2] [--reps 2]
        [--context TOKENS] [--peer-pythonpath DIR[:DIR]]

Each pair is one weights file both sides read: the default model's own Q4_1 GGUF (prescient
`--weights native`, its blocks as stored) and, when given, BF16 / Q8_0 GGUFs written from it by
`python -m prescient.latency_bench.write_gguf`. prescient runs as `prescient serve` (speculation
off, then n-gram) and llama.cpp as `llama_cpp.server` (flash attention on, all cores, ChatML, no
repeat penalty), both driven by the openai SDK, streamed, as a user sees them: that pair is the
like-for-like comparison. llama.cpp also runs through llama-cpp-python in this process
(`llama.cpp-inproc`, the same prompt ids as prescient's), which spares it any HTTP cost: the
figure of its engine alone. `--peer-pythonpath` names where llama-cpp-python (e.g. a build for
one ISA tier) and its server extra are installed, if not in this environment.
Every request starts its system message with a fresh nonce, so no prefix cache helps either side:
every TTFT is a cold prefill. Requests alternate between the systems, workload by workload.

`--context TOKENS` puts a filler document (a log excerpt repeated) before each request's first
message, after its nonce, so every prompt is about that long: decode at an agent's context, where
each step also reads the KV cache of every layer. The floor then counts those bytes too (the
default bf16 cache: layers x kv heads x head dim x 2 bytes x K and V, at TOKENS positions).

Decode tok/s of a request = (tokens - 1) / (last token - first token); "overall" = all decode
tokens / all decode time of that system. The floor = the weight bytes one decode step reads (every
matrix once, the LM head included; the embedding lookup reads a row) / the read bandwidth of a
streaming probe (torch.sum over 1 GiB on huge pages where the OS gives them, as the weights are;
best of 5) run here before and after.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch

from prescient.latency_bench.bench_servers import PeerMissing, PrescientServer
from prescient.latency_bench.bundled import WORKLOADS
from prescient.latency_bench.efficiency import probe_buffer
from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.runtime.slo import percentile
from prescient.kernels.cpu_threads import default_threads


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s of a streaming read (torch.sum over a buffer far larger than the caches)."""
    buf = probe_buffer(int(gib * (1 << 30)))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def step_weight_bytes(gguf_path: str) -> int:
    """Bytes of every 2-D weight matrix in the file, as stored; a tied embedding counts once (as the
    LM head a step streams whole)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)


FILLER = ("Log excerpt: the agent read each line of the build log, noted the error code, the module "
          "that raised it and the time it happened, then grouped the lines by module. ")


def context_fillers(work: list[dict], tokens: int, encode) -> list[str]:
    """Per workload, the filler that brings its prompt to about `tokens` tokens (its messages'
    text counted, the chat template's few tokens not); "" where it is already as long."""
    if tokens <= 0:
        return ["" for _ in work]
    per = len(encode(FILLER))
    out = []
    for w in work:
        own = len(encode(" ".join(m["content"] for m in w["messages"])))
        out.append(FILLER * -(-(tokens - own) // per) + "\n\n" if tokens > own else "")
    return out


def kv_bytes_per_position(config, esz: int = 2) -> int:
    """Bytes a decode step reads per cached position: every layer's K and V (bf16 by default)."""
    return config.num_layers * config.num_kv_heads * config.head_dim * 2 * esz


class Server:
    """`prescient serve` (bench_servers.PrescientServer: calibrated at start-up, before the peer)
    driven through the openai SDK, until close()."""

    def __init__(self, path: str, speculate: str, env: dict[str, str]):
        import openai

        self.server = PrescientServer(path, speculate, ("--weights", "native"), timeout_s=600, env=env)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        return _stream(self.client, messages, max_tokens)

    def close(self) -> None:
        self.server.stop()


def _stream(client, messages: list[dict], max_tokens: int, **extra) -> dict:
    """One greedy streamed chat completion through the openai SDK, timed at each content chunk.
    Tokens: the usage the server reports, else the content chunks (llama_cpp.server streams a
    chunk per token and reports no usage when streaming)."""
    t0 = time.perf_counter()
    times, n = [], 0
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if getattr(chunk, "usage", None) is not None:
            n = chunk.usage.completion_tokens
    return _result(t0, times, n or len(times))


class LlamaCppHttp:
    """llama_cpp.server on the same GGUF, driven like prescient's server (openai SDK, streamed)."""

    def __init__(self, path: str, pythonpath: str | None):
        import openai

        from prescient.latency_bench.bench_servers import LlamaCppServer

        self.server = LlamaCppServer(path, default_threads(), chat_format="chatml", pythonpath=pythonpath)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        # greedy as prescient's is: its server's defaults add a repeat penalty of 1.1
        return _stream(self.client, messages, max_tokens, extra_body={"repeat_penalty": 1.0, "top_k": 1})

    def close(self) -> None:
        self.server.stop()


class LlamaCpp:
    def __init__(self, path: str, tokenizer, eos: set[int], pythonpath: str | None = None):
        if pythonpath:  # after this environment's own packages: only llama_cpp is taken from there
            sys.path += [p for p in pythonpath.split(os.pathsep) if p not in sys.path]
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=4096, n_threads=default_threads(), flash_attn=True, verbose=False)
        self.tokenizer, self.eos = tokenizer, eos | {self.llm.token_eos()}

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        ids = self.tokenizer.apply_chat_template(messages)  # the ids the server renders
        self.llm.reset()
        t0 = time.perf_counter()
        times = []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in self.eos:
                break
            times.append(time.perf_counter())
            if len(times) >= max_tokens:
                break
        return _result(t0, times, len(times))


def _result(t0: float, times: list[float], n: int) -> dict:
    return {"ttft": times[0] - t0 if times else None, "tokens": n,
            "decode_s": times[-1] - times[0] if len(times) > 1 else 0.0}


def _summary(rows: list[dict]) -> dict:
    tokens = sum(max(r["tokens"] - 1, 0) for r in rows if r["decode_s"] > 0)
    secs = sum(r["decode_s"] for r in rows if r["decode_s"] > 0)
    per = [(r["tokens"] - 1) / r["decode_s"] for r in rows if r["decode_s"] > 0]
    return {"decode_tok_s": tokens / secs if secs else None, "median_request_tok_s": percentile(per, 50),
            "ttft_s": percentile([r["ttft"] for r in rows if r["ttft"] is not None], 50),
            "requests": len(rows)}


def cli(argv: list[str] | None = None) -> int:
    ap = suite_parser("peer-decode", __doc__.split("\n\n")[0], full_doc=True)
    ap.add_argument("--q4-gguf", default=None, help="the Q4_1 GGUF (default: the default model's file)")
    ap.add_argument("--bf16-gguf", default=None, help="a BF16 GGUF of the same model (write_gguf writes one)")
    ap.add_argument("--q8-gguf", default=None, help="a Q8_0 GGUF of the same model")
    ap.add_argument("--isa", default=None, help="PRESCIENT_ISA for the server (portable, avx2, avx512, avx512_vnni, avx512_bf16)")
    ap.add_argument("--speculate", default="off,ngram", help="prescient modes, comma-separated")
    add_shared(ap, reps={"default": 2, "help": "passes over the workloads"},
               workloads={"help": "a workloads .jsonl (default: the bundled 11)"}, peer_pythonpath=True)
    ap.add_argument("--limit", type=int, default=None, help="only the first N workloads (a smoke run)")
    ap.add_argument("--only", default=None, help="only workloads of this kind (chat, tool_call, long_edit)")
    ap.add_argument("--context", type=int, default=0,
                    help="pad every prompt to about this many tokens with a filler document (0: as they are)")
    add_shared(ap, out={"help": "write the results as JSON here (unset: stdout only)"})
    args = ap.parse_args(argv)

    from prescient.kernels import cpu_linear
    from prescient.build import EngineSpec, load_model
    from prescient.runtime.loader import default_model_path

    env = {"PRESCIENT_ISA": args.isa} if args.isa else {}
    if args.isa:
        os.environ["PRESCIENT_ISA"] = args.isa
        if cpu_linear.available():  # loaded before the variable was set: cap it as the server is
            cpu_linear._set_isa_cap(args.isa)
    tier = cpu_linear.kernel_info().get("isa")
    q4 = args.q4_gguf or default_model_path()
    pairs = [("q4_1", q4), ("bf16", args.bf16_gguf), ("q8_0", args.q8_gguf)]
    pairs = [(name, path) for name, path in pairs if path]
    work = [json.loads(line) for line in Path(args.workloads or WORKLOADS).read_text().splitlines() if line.strip()]
    work = [w for w in work if args.only in (None, w["workload"])]
    work = work[:args.limit] if args.limit else work
    loaded = load_model(EngineSpec(model=q4))  # for its tokenizer: llama.cpp gets the same prompt ids
    tokenizer, eos = loaded.tokenizer, set(loaded.eos_token_ids)
    kv_pp = kv_bytes_per_position(loaded.config)
    fillers = context_fillers(work, args.context, tokenizer.encode)
    del loaded
    bw0 = read_bandwidth()
    results: dict = {"tier": tier, "machine": os.uname().machine, "cpus": os.cpu_count(), "context": args.context,
                     "pairs": {}}
    print(f"prescient kernels tier {tier}; read bandwidth {bw0 / 1e9:.1f} GB/s", file=sys.stderr)
    for name, path in pairs:
        systems = {}
        for spec in args.speculate.split(","):
            systems[f"prescient-{spec}"] = Server(path, spec, env)
        try:
            systems["llama.cpp"] = LlamaCppHttp(path, args.peer_pythonpath)
        except PeerMissing as e:
            print(f"no llama.cpp server: {e}", file=sys.stderr)
        try:
            systems["llama.cpp-inproc"] = LlamaCpp(path, tokenizer, eos, args.peer_pythonpath)
        except ImportError:
            print("llama-cpp-python is not installed (pip install -e '.[peers]'): no in-process llama.cpp",
                  file=sys.stderr)
        rows: dict[str, list[dict]] = {s: [] for s in systems}
        try:
            order = list(systems)
            for rep in range(args.reps + 1):  # pass 0 warms every system up and is not counted
                for i, w in enumerate(work):
                    for s in (order if (rep + i) % 2 == 0 else order[::-1]):
                        msgs = [dict(m) for m in w["messages"]]
                        msgs[0]["content"] = f"[{uuid.uuid4().hex[:8]}] " + fillers[i] + msgs[0]["content"]
                        try:
                            r = systems[s].run(msgs, w["max_tokens"])
                        except Exception as e:  # a server that died: say how, not "connection error"
                            server = getattr(systems[s], "server", None)
                            reason = server.exit_reason() if server is not None else None
                            if reason is None:
                                raise
                            raise RuntimeError(f"{s} died during {w['workload']}: {reason}") from e
                        r["workload"] = w["workload"]
                        if rep:
                            rows[s].append(r)
                print(f"{name}: pass {rep} done", file=sys.stderr)
        finally:
            for s in systems.values():
                if isinstance(s, (Server, LlamaCppHttp)):
                    s.close()
        wbytes = step_weight_bytes(path)
        out = {"weight_bytes_per_step": wbytes, "kv_bytes_per_step": kv_pp * args.context, "systems": {}}
        for s, rs in rows.items():
            summ = _summary(rs)
            summ["by_workload"] = {k: _summary([r for r in rs if r["workload"] == k]) for k in dict.fromkeys(r["workload"] for r in rs)}
            out["systems"][s] = summ
        results["pairs"][name] = out
    bw1 = read_bandwidth()
    results["read_bandwidth_GBps"] = [bw0 / 1e9, bw1 / 1e9]
    bw = max(bw0, bw1)
    ctx_text = f"; prompts padded to ~{args.context} tokens (the floor counts their KV)" if args.context else ""
    lines = [f"tier {tier} (prescient kernels), {os.cpu_count()} CPUs; read bandwidth {bw / 1e9:.1f} GB/s{ctx_text}", "",
             "| weights | system | decode tok/s overall (x llama.cpp server, x in process) "
             "| chat / tool_call / long_edit | % of floor | cold TTFT long_edit |",
             "|---|---|---|---|---|---|"]
    for name, out in results["pairs"].items():
        floor = bw / (out["weight_bytes_per_step"] + out["kv_bytes_per_step"])
        out["floor_tok_s"] = floor
        bases = [out["systems"].get(k, {}).get("decode_tok_s") for k in ("llama.cpp", "llama.cpp-inproc")]
        for s, summ in out["systems"].items():
            bw_ = summ["by_workload"]
            per = " / ".join(f"{bw_[k]['decode_tok_s']:.1f}" if k in bw_ and bw_[k]["decode_tok_s"] else "-"
                             for k in ("chat", "tool_call", "long_edit"))
            ratio = ", ".join(f"{summ['decode_tok_s'] / b:.2f}x" if b else "-" for b in bases)
            ratio = f" ({ratio})" if s.startswith("prescient") else ""
            le = bw_.get("long_edit", {}).get("ttft_s")
            le_text = f"{le * 1000:.0f} ms" if le else "-"
            lines.append(f"| {name} | {s} | {summ['decode_tok_s']:.1f}{ratio} | {per} | "
                         f"{100 * summ['decode_tok_s'] / floor:.0f}% of {floor:.0f} | {le_text} |")
    table = "\n".join(lines)
    print(table)
    results["table"] = table
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
