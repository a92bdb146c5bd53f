"""gpu_check section: the seed SLOs under 32 concurrent agents (TTFT <= 200 ms, ITL p99 <= 25 ms).

Each agent runs multi-turn sessions against one in-process engine: a prompt (a system prefix all
agents share plus its own user text), `turn_tokens` generated, then a tool result of
`tool_tokens` appended after `tool_latency_s`, and the next turn continues the conversation
under the agent's session id (so its KV is reused), for `turns` turns. Token ids are random: the
models are random-weight (the SmolLM2-135M architecture, or the real 135M model when its GGUF is
installed, and an 8B-shaped Llama); greedy and sampled decoding each run once after a short
warm-up round (Triton compiles each new shape on first use). Every figure is runtime/slo.py's over
RequestTrace objects stamped on this thread after each engine step: TTFT p50/p99 and the
per-emission ITL p99 (the reader's gap), with the share of requests meeting both seed bounds.
The section reports; it does not fail on a missed SLO (that is a performance finding, not an
error).
"""

from __future__ import annotations

import gc
import random
import time

from prescient.latency_bench.gpu_sections_common import failure, fmt, sync, table

SEED_TTFT_S, SEED_ITL_S = 0.200, 0.025


def llama_8b_config(name: str = "Llama-8B-shaped (random init)"):
    """Llama-3-8B's shapes (hidden 4096, 32 layers, GQA 32/8, MLP 14336, vocab 128256)."""
    from prescient.runtime.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False, name=name)


def _engine(model, kv_cache_bytes: int, max_num_seqs: int):
    from prescient.build import EngineSpec, LoadedModel, build_engine
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import EngineConfig

    dtype = str(model.dtype).replace("torch.", "")
    spec = EngineSpec(dtype=dtype, device=str(model.device), speculate="off", progress=False)
    config = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=16, kv_cache_bytes=kv_cache_bytes),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048))
    return build_engine(spec, LoadedModel(model, None, (), None), config=config)


def run_agents(engine, device, *, agents: int, turns: int, prefix_len: int, user_len: int, turn_tokens: int,
               tool_tokens: int, params, vocab: int, tool_latency_s: float, seed: int, tag: str,
               deadline: float | None = None) -> list:
    """Drive `agents` closed-loop agents to the end of their `turns`; the finished RequestTrace of
    every turn (tags: agent, turn). Stops submitting new turns past `deadline` (perf_counter)."""
    from prescient.runtime.slo import RequestTrace

    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    convs = [prefix + [rng.randrange(vocab) for _ in range(user_len)] for _ in range(agents)]
    turn = [0] * agents
    ready = [0.0] * agents
    live: dict[str, tuple[int, RequestTrace]] = {}
    outputs: dict[str, list[int]] = {}
    done = []
    while True:
        now = time.perf_counter()
        for a in range(agents):
            busy = any(x == a for x, _ in live.values())
            if not busy and turn[a] < turns and ready[a] <= now and (deadline is None or now < deadline):
                rid = f"{tag}-a{a}-t{turn[a]}"
                trace = RequestTrace(rid, now, num_prompt_tokens=len(convs[a]), tags={"agent": a, "turn": turn[a]})
                engine.add_request(list(convs[a]), params, request_id=rid, session_id=f"{tag}-a{a}", arrival_time=now)
                live[rid], outputs[rid] = (a, trace), []
        if not live:
            if all(t >= turns for t in turn) or (deadline is not None and now >= deadline):
                return done
            time.sleep(max(0.0, min(r for r, t in zip(ready, turn) if t < turns) - now))
            continue
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            sync(device)
            t = time.perf_counter()
            a, trace = live[out.request_id]
            trace.add_emission(t, len(out.new_token_ids))
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                trace.finished_time = t
                done.append(trace)
                del live[out.request_id]
                convs[a] += outputs.pop(out.request_id) + [rng.randrange(vocab) for _ in range(tool_tokens)]
                turn[a] += 1
                ready[a] = t + tool_latency_s


def _summary(traces: list, slo) -> dict:
    from prescient.runtime.slo import distribution, request_metrics

    ms = [request_metrics(t, slo) for t in traces]
    later = [m for m, t in zip(ms, traces) if t.tags.get("turn", 0) > 0]
    return {"requests": len(ms), "ttft_s": distribution([m.ttft_s for m in ms]),
            "ttft_later_turns_s": distribution([m.ttft_s for m in later]),
            "itl_emission_s": distribution([x for m in ms for x in m.itl_emission_s]),
            "itl_token_s": distribution([x for m in ms for x in m.itl_token_s]),
            "slo_attainment": sum(m.met_all for m in ms) / len(ms) if ms else None}


def run(ctx, device, dtype, models: list[tuple[str, object]], *, agents: int = 32, turns: int = 3,
        prefix_len: int = 384, user_len: int = 64, turn_tokens: int = 64, tool_tokens: int = 48,
        tool_latency_s: float = 0.02, kv_cache_bytes: int = 8 << 30, seed: int = 0) -> dict:
    """`models`: (name, () -> LlamaModel) pairs, built one at a time (an 8B model is 16 GB)."""
    import torch

    from prescient.runtime.sampling_params import SamplingParams
    from prescient.runtime.slo import SLOConfig

    slo = SLOConfig(name="seed", ttft_s=SEED_TTFT_S, itl_emission_p99_s=SEED_ITL_S, tpot_s=None, e2e_s=None)
    samplings = {"greedy": dict(temperature=0.0), "t=0.8": dict(temperature=0.8, top_p=0.95, seed=seed)}
    rows, errors = [], {}
    result = {"agents": agents, "turns": turns, "turn_tokens": turn_tokens, "slo": slo.to_dict(),
              "dtype": str(dtype).replace("torch.", ""), "rows": rows, "errors": errors, "measured_error": None}
    runs_left = len(models) * len(samplings)
    for name, build in models:
        if ctx.expired():
            rows.append({"model": name, "status": "skipped: time limit"})
            runs_left -= len(samplings)
            continue
        model = engine = None
        try:
            t0 = time.perf_counter()
            model = build()
            sync(device)
            build_s = time.perf_counter() - t0
            engine = _engine(model, kv_cache_bytes, max(agents, 8))
            vocab = model.config.vocab_size
            for sampling, kw in samplings.items():
                runs_left -= 1
                if ctx.expired():
                    rows.append({"model": name, "sampling": sampling, "status": "skipped: time limit"})
                    continue
                params = SamplingParams(max_tokens=turn_tokens, ignore_eos=True, **kw)
                common = dict(agents=agents, prefix_len=prefix_len, user_len=user_len, tool_tokens=tool_tokens,
                              params=params, vocab=vocab, tool_latency_s=tool_latency_s)
                t0 = time.perf_counter()
                run_agents(engine, device, turns=2, turn_tokens=turn_tokens, seed=seed + 1, tag=f"warm-{sampling}",
                           **common)
                warm_s = time.perf_counter() - t0
                # this run's share of what is left, so a slow first run cannot starve the others
                deadline = time.perf_counter() + max((ctx.time_left() - 5.0) / (runs_left + 1), 1.0)
                t0 = time.perf_counter()
                traces = run_agents(engine, device, turns=turns, turn_tokens=turn_tokens, seed=seed,
                                    tag=f"slo-{sampling}", deadline=deadline, **common)
                s = _summary(traces, slo)
                rows.append({"model": name, "sampling": sampling, "status": "ok", "model_build_s": build_s,
                             "warmup_s": warm_s, "run_s": time.perf_counter() - t0, **s,
                             "meets_seed_slo": (s["ttft_s"]["p99"] is not None and s["ttft_s"]["p99"] <= SEED_TTFT_S
                                                and s["itl_emission_s"]["p99"] is not None
                                                and s["itl_emission_s"]["p99"] <= SEED_ITL_S)})
                ctx.checkpoint(result)
        except Exception as e:
            errors[name] = failure(e)
            rows.append({"model": name, "status": "failed", "error": errors[name]["error"]})
        finally:
            model = engine = None  # frees the weights and KV before the next model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return result


def default_models(device, dtype, smoke: bool) -> list[tuple[str, object]]:
    """The 135M model (real weights when the default GGUF is installed, else its architecture with
    random weights) and the 8B-shaped Llama; --cpu-smoke: the tiny config only."""
    from prescient.latency_bench import gpu_sections_decode as decode
    from prescient.runtime.model import LlamaModel

    def random_model(config):
        return lambda: LlamaModel(config, decode.random_weights(config, device, dtype), dtype=dtype, device=device,
                                  fast_linear=not smoke)

    if smoke:
        return [("tiny (random init)", random_model(decode.tiny_config()))]

    def smollm():
        try:
            from prescient.build import EngineSpec, load_model

            return load_model(EngineSpec(dtype=str(dtype).replace("torch.", ""), device=str(device),
                                         speculate="off", progress=False)).model
        except Exception:  # no GGUF on this machine: the same architecture, random weights
            return random_model(decode.smollm2_135m_config())()

    return [("SmolLM2-135M", smollm), ("Llama-8B-shaped (random init)", random_model(llama_8b_config()))]


def render(d: dict) -> list[str]:
    rows = d.get("rows") or []
    if not rows:
        return []
    out = [f"{d['agents']} agents x {d['turns']} turns of {d['turn_tokens']} tokens, {d['dtype']}, speculation "
           f"off; seed SLO: TTFT <= {SEED_TTFT_S * 1e3:.0f} ms, per-emission ITL p99 <= {SEED_ITL_S * 1e3:.0f} ms.", ""]
    body = []
    for r in rows:
        if r.get("status") != "ok":
            body.append([r["model"], r.get("sampling", "-"), r["status"], "", "", "", "", ""])
            continue
        ms = lambda x: fmt(x * 1e3 if x is not None else None)  # noqa: E731
        body.append([r["model"], r["sampling"], r["requests"], ms(r["ttft_s"]["p50"]), ms(r["ttft_s"]["p99"]),
                     ms(r["itl_emission_s"]["p99"]), fmt(r["slo_attainment"], 2),
                     "yes" if r["meets_seed_slo"] else "**no**"])
    out.append(table(["model", "sampling", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL/emission p99 ms",
                      "attainment", "meets seed SLO"], body))
    return out
