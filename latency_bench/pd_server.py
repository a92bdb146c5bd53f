"""`pd_bench --server`: the decodes' ITL while a long prompt arrives, through `prescient serve` over
HTTP, co-located (the default) against `--pd-split`.

Two servers on the same model, speculation off, both started first; reps interleaved (the order
rotates each rep). Each rep on each server: the long prompt alone (its TTFT with nothing else
running), then `decodes` streaming chat requests (ignore_eos) and, once each has delivered
`MIN_EMISSIONS`, the long prompt (max_tokens 1); the decodes are stopped (their streams closed)
shortly after its first token. Every request goes through agent_http's `ChatHTTPTransport.stream`
(the load benchmark's client) with a fresh prefix, so every prefill is cold. Figures, from
runtime/slo.py: the decodes' emission gaps that overlap the long prompt's wait (its send to its
first token) as a distribution (p50 / p99 / max), the long prompt's TTFT under load and alone
(medians over reps) and their ratio; issue 25's targets are ITL p99 <= 100 ms and ratio <= 1.3.
The same gaps by the server's own stamps on each chunk (`token_times`) come beside them
(`server_itl_*`): on a 2-core machine the client (the openai SDK) shares the server's cores, and
the two differ by the client's own delay in reading them.
"""

from __future__ import annotations

import asyncio
import sys
import uuid

from prescient.latency_bench.workloads import long_prompt, load_workloads, with_fresh_prefix
from prescient.runtime.slo import CPU_INTERACTIVE, RequestTrace, distribution, percentile, request_metrics

MIN_EMISSIONS = 8  # decode emissions each stream delivers before the long prompt is sent
AFTER_FIRST_S = 0.2  # the decodes run on this long past the long prompt's first token
SETUPS = {"colocated": (), "split": ("--pd-split",)}


def prefill_gaps(traces: list[RequestTrace], t_sent: float, t_first: float) -> list[float]:
    """Every emission gap of `traces` that overlaps (t_sent, t_first): what a reader of a decode
    waited while the long prompt was being prefilled (the gaps as runtime/slo.py's model defines them)."""
    gaps = []
    for trace in traces:
        for t, e in zip(trace.emission_times[1:], trace.emissions()[1:]):
            if t > t_sent and t - e.itl_emission_s < t_first:
                gaps.append(e.itl_emission_s)
    return gaps


def server_prefill_gaps(traces: list[RequestTrace], t_sent: float, t_first: float) -> list[float]:
    """The same gaps as `prefill_gaps`, by the server's stamps on the chunks (`token_times`):
    what the server delivered, without the delay the client's own scheduling adds when it shares
    the server's cores (chosen by the client's times, so the same emissions are compared)."""
    gaps = []
    for trace in traces:
        stamps = trace.tags.get("server_times", [])
        if len(stamps) != len(trace.emission_times):
            continue  # a server that stamps nothing (or not every chunk): no figure
        for i in range(1, len(stamps)):
            if trace.emission_times[i] > t_sent and trace.emission_times[i - 1] < t_first:
                gaps.append(stamps[i] - stamps[i - 1])
    return gaps


async def run_once(transport, chats: list[list[dict]], long_messages: list[dict], decode_tokens: int,
                   tag: str, banned: tuple[int, ...] = ()) -> dict:
    """One rep on one server: {"alone_ttft_s", "ttft_s", "gaps_s", "server_gaps_s", "outlasted"}.
    `banned`: token ids no request of the rep may sample (the chat template's special tokens: past an
    ignored end of turn the model writes `<|im_end|>` / `<|im_start|>`, which stream no text, so
    their step's delivery would join the next one's and the figure would be of the bench's own
    ignore_eos, not of the server; and a long prompt's one token must stream text for its TTFT
    to exist: a first token that ends the turn streams none)."""
    bias = {"logit_bias": {str(t): -100 for t in banned}} if banned else {}
    nonce = f"{tag}-{uuid.uuid4().hex[:8]}"
    alone = RequestTrace("long-alone", 0.0)
    await transport.stream(with_fresh_prefix(long_messages, f"{nonce}-alone"), f"{tag}-alone", 1, trace=alone, **bias)
    traces = [RequestTrace(f"{tag}-d{i}", 0.0) for i in range(len(chats))]
    tasks = [asyncio.create_task(transport.stream(with_fresh_prefix(c, f"{nonce}-d{i}"), t.request_id,
                                                  decode_tokens, trace=t, ignore_eos=True, **bias))
             for i, (c, t) in enumerate(zip(chats, traces))]
    try:
        while any(len(t.emission_times) < MIN_EMISSIONS for t in traces):
            done = [task for task in tasks if task.done()]
            for task in done:
                task.result()  # a failed decode fails the rep, with its error
            if done:
                raise RuntimeError(f"a decode finished before {MIN_EMISSIONS} emissions (raise --decode-tokens)")
            await asyncio.sleep(0.002)
        long = RequestTrace(f"{tag}-long", 0.0)
        await transport.stream(with_fresh_prefix(long_messages, f"{nonce}-long"), long.request_id, 1, trace=long,
                               **bias)
        outlasted = not any(task.done() for task in tasks)
        await asyncio.sleep(AFTER_FIRST_S)
    finally:
        for task in tasks:
            task.cancel()  # closes the stream: the server stops the decode
        await asyncio.gather(*tasks, return_exceptions=True)
    if not long.emission_times or not alone.emission_times:
        raise RuntimeError("the long prompt delivered no text (its first token ended the turn: pass `banned`)")
    ttft = request_metrics(long, CPU_INTERACTIVE).ttft_s
    return {"alone_ttft_s": request_metrics(alone, CPU_INTERACTIVE).ttft_s, "ttft_s": ttft,
            "gaps_s": prefill_gaps(traces, long.arrival_time, long.emission_times[0]),
            "server_gaps_s": server_prefill_gaps(traces, long.arrival_time, long.emission_times[0]),
            "outlasted": outlasted}


def summarize(runs: list[dict]) -> dict:
    gaps = distribution([g for r in runs for g in r["gaps_s"]])
    served = distribution([g for r in runs for g in r["server_gaps_s"]])
    ttft = percentile([r["ttft_s"] for r in runs], 50)
    alone = percentile([r["alone_ttft_s"] for r in runs], 50)
    ratio = ttft / alone if ttft is not None and alone else None
    ms = (lambda x: None if x is None else round(1e3 * x, 1))
    return {"gaps": gaps["count"], "itl_p50_ms": ms(gaps["p50"]), "itl_p99_ms": ms(gaps["p99"]),
            "itl_max_ms": ms(gaps["max"]), "server_itl_p99_ms": ms(served["p99"]), "server_itl_max_ms": ms(served["max"]),
            "long_ttft_ms": ms(ttft), "long_ttft_alone_ms": ms(alone),
            "long_ttft_ratio": round(ratio, 3) if ratio is not None else None,
            "decodes_outlasted_prefill": all(r["outlasted"] for r in runs),
            "targets": {"itl_p99_le_100ms": gaps["p99"] is not None and gaps["p99"] <= 0.100,
                        "long_ttft_ratio_le_1.3": ratio is not None and ratio <= 1.3}}


def run_server_mode(args) -> dict:
    """`args`: pd_bench's parsed flags (model, weights, dtype, long_tokens, decodes, decode_tokens, reps)."""
    from prescient.latency_bench.agent_http import ChatHTTPTransport
    from prescient.latency_bench.bench_servers import PeerMissing, PrescientServer, model_tokenizer

    workloads, _ = load_workloads()
    chats = [list(w.messages) for w in workloads[:args.decodes]]
    flags = ("--weights", args.weights, "--dtype", args.dtype)
    servers, not_run = {}, {}
    for name, extra in SETUPS.items():
        try:
            servers[name] = PrescientServer(args.model, "off", (*flags, *extra))
        except PeerMissing as e:
            not_run[name] = str(e)
    report = {"mode": "server", "model": args.model or "default", "weights": args.weights, "dtype": args.dtype,
              "decodes": args.decodes, "reps": args.reps, "not_run": not_run, "setups": {}}
    try:
        tokenizer = model_tokenizer(args.model)
        long_messages = long_prompt(workloads, args.long_tokens, tokenizer)
        report["long_prompt_tokens"] = len(tokenizer.apply_chat_template(long_messages))

        async def main() -> dict:
            transports = {n: ChatHTTPTransport(s.url, "hermes", args.decode_tokens) for n, s in servers.items()}
            runs: dict[str, list[dict]] = {n: [] for n in transports}
            try:
                for n, t in transports.items():  # first-request costs before the measurement
                    await t.stream(with_fresh_prefix(long_messages, f"warm-{n}"), f"warm-{n}", 1)
                names = list(transports)
                for rep in range(args.reps):
                    for n in names[rep % len(names):] + names[:rep % len(names)]:
                        r = await run_once(transports[n], chats, long_messages, args.decode_tokens, f"{n}-r{rep}",
                                           banned=tuple(tokenizer.hf.all_special_ids))
                        runs[n].append(r)
                        p99 = percentile(r["gaps_s"], 99)
                        print(f"rep {rep} {n}: gap p99 {1e3 * p99 if p99 is not None else float('nan'):.1f} ms, "
                              f"long TTFT {1e3 * r['ttft_s']:.0f} ms (alone {1e3 * r['alone_ttft_s']:.0f} ms)",
                              file=sys.stderr, flush=True)
            finally:
                for t in transports.values():
                    await t.aclose()
            return runs

        for name, runs in asyncio.run(main()).items():
            report["setups"][name] = {"server": servers[name].name + " ".join(("",) + SETUPS[name]),
                                      **summarize(runs)}
    finally:
        for server in servers.values():
            server.stop()
    return report
