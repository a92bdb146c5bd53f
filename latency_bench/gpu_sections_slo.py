"""gpu_check section: the seed SLOs under 32 concurrent agents (TTFT <= 200 ms, ITL p99 <= 25 ms).

Each agent runs multi-turn sessions against one in-process engine: a prompt (a system prefix all
agents share plus its own user text), `turn_tokens` generated, then a tool result of
`tool_tokens` appended after `tool_latency_s`, and the next turn continues the conversation
under the agent's session id (so its KV is reused), for `turns` turns. Token ids are random. The
models: the real SmolLM2-135M (the default model's GGUF) and an 8B-shaped random-weight Llama.
When the real model cannot be loaded its rows fail with the loader's reason, and the section ends
as an error: random weights are never measured under the real model's name. Each model runs
`RUNS`: greedy and sampled decoding, each with n-gram speculation off and on (its verify-cost
table measured on the model before the run), each after a short warm-up round (Triton compiles
each new shape on first use), and all of them once eagerly and once with CUDA graphs
(`GRAPH_MODES`; EngineConfig.cuda_graphs, off by default: this section is where it is measured
against eager; without CUDA those rows are skipped, saying so). The engines run the device step
path on CUDA (runtime/step_path.py: one forward and one sync a step). Every figure is runtime/slo.py's over
RequestTrace objects stamped on this thread after each engine step: TTFT p50/p99, the
per-emission ITL p99 (the reader's gap) beside the largest gap of the run (ITL max: one stall
a p99 over thousands of gaps hides), and the share of requests meeting both seed bounds. The
section reports; it does not fail on a missed SLO (that is a performance finding, not an error):
its `slo_verdict` says whether every measured row met the seed budgets, which did not, and each
(model, sampling, speculation) triple's ITL p99 with graphs over eager.
"""

from __future__ import annotations

import gc
import random
import time

from prescient.latency_bench.gpu_sections_common import failure, fmt, sync, table

SEED_TTFT_S, SEED_ITL_S = 0.200, 0.025
# (sampling, speculation) per model, in order; runs sharing a speculation mode share an engine.
RUNS = (("greedy", "off"), ("t=0.8", "off"), ("greedy", "ngram"), ("t=0.8", "ngram"))
# eager first: the default, and what graphs are judged against
GRAPH_MODES = ("eager", "graphs")


def llama_8b_config(name: str = "Llama-8B-shaped (random init)"):
    """Llama-3-8B's shapes (hidden 4096, 32 layers, GQA 32/8, MLP 14336, vocab 128256)."""
    from prescient.runtime.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False, name=name)


def _engine(model, kv_cache_bytes: int, max_num_seqs: int, speculate: str = "off", cuda_graphs: bool = False,
            step_path: str = "auto"):
    """An engine through the one builder; with speculation, its verify-cost table measured now
    (before any timed run: measuring in idle moments would land inside the run)."""
    from prescient.build import EngineSpec, LoadedModel, build_engine
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import EngineConfig

    dtype = str(model.dtype).replace("torch.", "")
    spec = EngineSpec(dtype=dtype, device=str(model.device), speculate=speculate, calibrate="now", progress=False)
    config = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=16, kv_cache_bytes=kv_cache_bytes),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
                          cuda_graphs=cuda_graphs, step_path=step_path)
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


def _verdict(rows: list[dict]) -> dict:
    """Every measured row against the seed budgets, and graphs over eager per triple."""
    measured = [r for r in rows if r.get("status") == "ok"]
    missed = [f"{r['model']} {r['sampling']} {r['speculation']} {r['graphs']}" for r in measured
              if not r["meets_seed_slo"]]
    by_key = {(r["model"], r["sampling"], r["speculation"], r["graphs"]): r for r in measured}
    compare = []
    for (model, sampling, mode, graphs), r in by_key.items():
        eager = by_key.get((model, sampling, mode, "eager"))
        if graphs != "graphs" or eager is None:
            continue
        e99, g99 = eager["itl_emission_s"]["p99"], r["itl_emission_s"]["p99"]
        compare.append({"model": model, "sampling": sampling, "speculation": mode, "itl_p99_eager_s": e99,
                        "itl_p99_graphs_s": g99, "graphs_over_eager": g99 / e99 if e99 and g99 is not None else None})
    return {"budgets": {"ttft_s": SEED_TTFT_S, "itl_emission_p99_s": SEED_ITL_S},
            "rows_measured": len(measured), "rows_meeting": len(measured) - len(missed), "missed": missed,
            "meets_seed_slo": bool(measured) and not missed, "graphs_vs_eager": compare}


def run(ctx, device, dtype, models: list[tuple[str, object]], *, agents: int = 32, turns: int = 3,
        prefix_len: int = 384, user_len: int = 64, turn_tokens: int = 64, tool_tokens: int = 48,
        tool_latency_s: float = 0.02, kv_cache_bytes: int = 8 << 30, seed: int = 0,
        runs: tuple[tuple[str, str], ...] = RUNS, graph_modes: tuple[str, ...] = GRAPH_MODES,
        step_path: str = "auto") -> dict:
    """`models`: (name, () -> LlamaModel) pairs, built one at a time (an 8B model is 16 GB).
    `runs`: (sampling, speculation) pairs, sampling "greedy" or "t=0.8", speculation "off" or
    "ngram"; each run once per graph mode ("eager", "graphs": CUDA graphs, CUDA only).
    step_path: the engines' (runtime/step_path.py); "auto" = the device path on CUDA, and
    --cpu-smoke passes "device" so that the CPU runs the path a GPU takes."""
    import torch

    from prescient.runtime.sampling_params import SamplingParams
    from prescient.runtime.slo import SLOConfig
    from prescient.speculative.speculator import SpecStats

    slo = SLOConfig(name="seed", ttft_s=SEED_TTFT_S, itl_emission_p99_s=SEED_ITL_S, tpot_s=None, e2e_s=None)
    samplings = {"greedy": dict(temperature=0.0), "t=0.8": dict(temperature=0.8, top_p=0.95, seed=seed)}
    rows, errors = [], {}
    plan = [(graphs, sampling, mode) for graphs in graph_modes for sampling, mode in runs]
    result = {"agents": agents, "turns": turns, "turn_tokens": turn_tokens, "slo": slo.to_dict(),
              "dtype": str(dtype).replace("torch.", ""), "runs": [list(r) for r in runs],
              "graph_modes": list(graph_modes), "rows": rows, "errors": errors, "measured_error": None,
              "slo_verdict": _verdict(rows)}
    runs_left = len(models) * len(plan)
    for name, build in models:
        if ctx.expired():
            rows += [{"model": name, "sampling": sp, "speculation": mode, "graphs": g, "status": "skipped: time limit"}
                     for g, sp, mode in plan]
            runs_left -= len(plan)
            continue
        model = engine = None
        done = 0
        try:
            t0 = time.perf_counter()
            model = build()
            sync(device)
            build_s = time.perf_counter() - t0
            weights = model.weights_description() if hasattr(model, "weights_description") else None
            vocab = model.config.vocab_size
            engine_mode = None
            for graphs, sampling, mode in plan:
                runs_left -= 1
                done += 1
                head = {"model": name, "sampling": sampling, "speculation": mode, "graphs": graphs}
                if graphs == "graphs" and device.type != "cuda":
                    rows.append({**head, "status": "skipped: CUDA graphs need CUDA"})
                    continue
                if ctx.expired():
                    rows.append({**head, "status": "skipped: time limit"})
                    continue
                if (mode, graphs) != engine_mode:
                    engine = None  # the previous mode's KV goes before the next engine's is allocated
                    gc.collect()
                    t0 = time.perf_counter()
                    engine = _engine(model, kv_cache_bytes, max(agents, 8), mode, cuda_graphs=graphs == "graphs",
                                     step_path=step_path)
                    engine_s, engine_mode = time.perf_counter() - t0, (mode, graphs)
                params = SamplingParams(max_tokens=turn_tokens, ignore_eos=True, **samplings[sampling])
                common = dict(agents=agents, prefix_len=prefix_len, user_len=user_len, tool_tokens=tool_tokens,
                              params=params, vocab=vocab, tool_latency_s=tool_latency_s)
                t0 = time.perf_counter()
                # bounded by the section's deadline too: a slow model must not overrun it here
                run_agents(engine, device, turns=2, turn_tokens=turn_tokens, seed=seed + 1,
                           tag=f"warm-{sampling}-{mode}", deadline=time.perf_counter() + ctx.time_left(), **common)
                warm_s = time.perf_counter() - t0
                if engine.speculator is not None:
                    engine.speculator.stats = SpecStats()  # count the measured run only
                # this run's share of what is left, so a slow first run cannot starve the others
                deadline = time.perf_counter() + max((ctx.time_left() - 5.0) / (runs_left + 1), 1.0)
                t0 = time.perf_counter()
                traces = run_agents(engine, device, turns=turns, turn_tokens=turn_tokens, seed=seed,
                                    tag=f"slo-{sampling}-{mode}", deadline=deadline, **common)
                s = _summary(traces, slo)
                stats = engine.speculator.stats if engine.speculator is not None else None
                runner = engine._graphs
                rows.append({**head, "weights": weights, "step_path": engine.path.name,
                             "graph_replays": runner.num_replays if runner is not None else None,
                             "graphs_captured": len(runner.graphs) if runner is not None else None,
                             "status": "ok", "model_build_s": build_s, "engine_build_s": engine_s,
                             "warmup_s": warm_s, "run_s": time.perf_counter() - t0, **s,
                             "acceptance_rate": stats.acceptance_rate if stats else None,
                             "mean_accepted_length": stats.mean_accepted_length if stats else None,
                             "meets_seed_slo": (s["ttft_s"]["p99"] is not None and s["ttft_s"]["p99"] <= SEED_TTFT_S
                                                and s["itl_emission_s"]["p99"] is not None
                                                and s["itl_emission_s"]["p99"] <= SEED_ITL_S)})
                result["slo_verdict"] = _verdict(rows)
                ctx.checkpoint(result)
        except Exception as e:
            errors[name] = failure(e)
            # this model's runs not measured: the failing one and those after it
            rows += [{"model": name, "sampling": sp, "speculation": mode, "graphs": g, "status": "failed",
                      "error": errors[name]["error"]} for g, sp, mode in plan[max(done - 1, 0):]]
            runs_left -= len(plan) - done
            result["slo_verdict"] = _verdict(rows)
            ctx.checkpoint(result)
        finally:
            model = engine = None  # frees the weights and KV before the next model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return result


class ModelLoadError(RuntimeError):
    """The real model could not be loaded (its rows fail; nothing else stands in for it)."""


def default_models(device, dtype, smoke: bool) -> list[tuple[str, object]]:
    """The real 135M model (the default GGUF; its rows fail, naming why, when it cannot load) and
    the 8B-shaped random Llama; --cpu-smoke: the tiny config only."""
    from prescient.latency_bench import gpu_sections_decode as decode
    from prescient.runtime.model import LlamaModel

    def random_model(config):
        return lambda: LlamaModel(config, decode.random_weights(config, device, dtype), dtype=dtype, device=device,
                                  fast_linear=not smoke)

    if smoke:
        return [("tiny (random init)", random_model(decode.tiny_config()))]

    def smollm():
        from prescient.build import EngineSpec, load_model

        try:
            return load_model(EngineSpec(dtype=str(dtype).replace("torch.", ""), device=str(device),
                                         speculate="off", progress=False)).model
        except Exception as e:
            # Random weights in its place would be reported under its name: fail its rows instead
            # (the decode section already measures the random-init 135M architecture).
            raise ModelLoadError(f"the real SmolLM2-135M did not load ({type(e).__name__}: {e}); "
                                 "no random weights were substituted") from e

    return [("SmolLM2-135M", smollm), ("Llama-8B-shaped (random init)", random_model(llama_8b_config()))]


def render(d: dict) -> list[str]:
    rows = d.get("rows") or []
    if not rows:
        return []
    out = [f"{d['agents']} agents x {d['turns']} turns of {d['turn_tokens']} tokens, {d['dtype']}; seed SLO: "
           f"TTFT <= {SEED_TTFT_S * 1e3:.0f} ms, per-emission ITL p99 <= {SEED_ITL_S * 1e3:.0f} ms. ITL max: the "
           "largest gap between two emissions in the run.", ""]
    ms = lambda x: fmt(x * 1e3 if x is not None else None)  # noqa: E731
    body = []
    for r in rows:
        if r.get("status") != "ok":
            body.append([r["model"], r.get("sampling", "-"), r.get("speculation", "-"), r.get("graphs", "eager"),
                         f"**{r['status']}**", *[""] * 7])
            continue
        itl = r["itl_emission_s"]
        body.append([r["model"], r["sampling"], r["speculation"], r.get("graphs", "eager"), r["requests"],
                     ms(r["ttft_s"]["p50"]),
                     ms(r["ttft_s"]["p99"]), ms(itl["p99"]), ms(itl["max"]), fmt(r.get("mean_accepted_length"), 2),
                     fmt(r["slo_attainment"], 2), "yes" if r["meets_seed_slo"] else "**no**"])
    out.append(table(["model", "sampling", "speculation", "graphs", "requests", "TTFT p50 ms", "TTFT p99 ms",
                      "ITL/emission p99 ms", "ITL max ms", "mean accepted len", "attainment", "meets seed SLO"],
                     body))
    verdict = d.get("slo_verdict") or {}
    if verdict.get("rows_measured"):
        out += ["", f"Verdict: {verdict['rows_meeting']} of {verdict['rows_measured']} measured rows meet the seed "
                f"SLO" + (f"; missed: {', '.join(verdict['missed'])}." if verdict["missed"] else ".")]
        for c in verdict.get("graphs_vs_eager") or []:
            out.append(f"- {c['model']} {c['sampling']} {c['speculation']}: ITL p99 with graphs / eager = "
                       f"{fmt(c['graphs_over_eager'], 2)}")
    for name, err in (d.get("errors") or {}).items():
        out += ["", f"{name} failed: {err['error']}"]
    return out
