"""gpu_check section 3: end-to-end decode of a random-init model with the default model's config.

Greedy decode tokens/s (SmolLM2-135M architecture, bf16 on the GPU), plain and with n-gram
speculation, plus a short sampled-decoding probe. Speculation must not change greedy output
beyond rounding: the section's error measure is, at the first token where the speculative greedy
output leaves the plain one, how far the speculative token's logit is below the argmax under a
plain forward of the common prefix (0 when the outputs are identical). A rounding flip between
near-tied tokens gives a gap of a few hundredths in bf16; a wrongly accepted draft token gives
the gap of a random token (about 2 on this model).
"""

from __future__ import annotations

import gc
import math
import random
import time

from prescient.latency_bench.gpu_sections_common import failure, fmt, sync, table

# Largest logit gap allowed at the first greedy divergence, by dtype. bf16: a few times the
# rounding a 30-layer forward accumulates on logits of this scale (std about 0.5); float32
# rounding is orders of magnitude below any real gap (spec_check expects identical outputs).
TOLERANCE = {"bfloat16": 0.1, "float16": 0.05, "float32": 1e-3}
_TOP_LOGPROBS = 20  # the engine's maximum
_BLOCK_SIZE = 16  # KV cache block size of every engine here (the speculator is calibrated for it)


def smollm2_135m_config(name: str = "SmolLM2-135M (random init)"):
    """The default model's architecture (SmolLM2-135M-Instruct's config.json)."""
    from prescient.runtime.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                       name=name)


def tiny_config():
    from prescient.runtime.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                       name="tiny (random init)")


def random_weights(config, device, dtype, seed: int = 0) -> dict:
    """Random weights under the canonical names runtime/loader.py produces, made on the device
    (135M float32 parameters would take seconds on the host and a copy)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim

    def normal(*shape):
        # std 0.02: SmolLM2's initializer_range, so activations have a trained model's scale
        # (what matters here is the work per step, not what the model says).
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)

    weights = {"embed": normal(config.vocab_size, h), "norm": torch.ones(h, device=device, dtype=dtype)}
    if not config.tie_word_embeddings:
        weights["lm_head"] = normal(config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        weights.update({
            p + "q": normal(config.num_heads * d, h), p + "k": normal(config.num_kv_heads * d, h),
            p + "v": normal(config.num_kv_heads * d, h), p + "o": normal(h, config.num_heads * d),
            p + "gate": normal(i, h), p + "up": normal(i, h), p + "down": normal(h, i),
            p + "attn_norm": torch.ones(h, device=device, dtype=dtype),
            p + "mlp_norm": torch.ones(h, device=device, dtype=dtype),
        })
    return weights


def _generate(engine, prompt: list[int], params, device) -> dict:
    """One request to completion; decode rate counted from the first generated token on."""
    t0 = time.perf_counter()
    steps0 = engine.num_steps
    engine.add_request(prompt, params)
    tokens: list[int] = []
    logprobs: list[dict] = []
    t_first = n_first = steps_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or [])
        if t_first is None and tokens:
            sync(device)
            t_first, n_first, steps_first = time.perf_counter(), len(tokens), engine.num_steps
    sync(device)
    t_end = time.perf_counter()
    decoded = len(tokens) - (n_first or 0)
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "prefill_ms": (t_first - t0) * 1e3 if t_first else None,
        "decode_tokens_per_s": decoded / (t_end - t_first) if t_first and t_end > t_first and decoded else None,
        "decode_steps": engine.num_steps - (steps_first or steps0),
        "decoded_tokens": decoded,
    }


def _new_engine(model, kv_cache_bytes: int, speculate: str = "off"):
    """An engine over the random-weight model through the one builder, with its speculator
    calibrated now (a random model has no cached table: identity None)."""
    from prescient.build import EngineSpec, LoadedModel, build_engine
    from prescient.runtime.config import CacheConfig
    from prescient.runtime.engine import EngineConfig

    dtype = str(model.dtype).replace("torch.", "")
    spec = EngineSpec(dtype=dtype, device=str(model.device), speculate=speculate, calibrate="now", progress=False)
    config = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=_BLOCK_SIZE, kv_cache_bytes=kv_cache_bytes))
    return build_engine(spec, LoadedModel(model, None, (), None), config=config)


def divergence_gap(model, prompt: list[int], plain: list[int], spec: list[int], kv_cache_bytes: int,
                   device) -> dict:
    """Where the speculative greedy tokens first leave the plain ones, the plain model's logit gap
    between its argmax and the speculative token there (0.0 when the outputs are identical)."""
    from prescient.runtime.sampling_params import SamplingParams

    d = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), None)
    if d is None:
        if len(plain) == len(spec):
            return {"identical": True, "first_divergence": None, "logit_gap": 0.0}
        # One output is a prefix of the other: with ignore_eos both must be max_tokens long.
        return {"identical": False, "first_divergence": min(len(plain), len(spec)), "logit_gap": math.inf,
                "note": f"lengths differ: {len(plain)} plain vs {len(spec)} speculative tokens"}
    # A fresh plain engine, one prefill over the shared prefix: its logits are what plain
    # decoding chose from at position d (up to the rounding of a prefill vs a 1-token step).
    engine = _new_engine(model, kv_cache_bytes)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=_TOP_LOGPROBS, ignore_eos=True)
        entry = _generate(engine, prompt + plain[:d], params, device)["logprobs"][0]
    finally:
        engine = None
        gc.collect()
    top = dict(entry["top"])
    best_token, best = max(top.items(), key=lambda kv: kv[1])
    found = {"identical": False, "first_divergence": d, "plain_token": plain[d], "speculative_token": spec[d],
             "probe_argmax": best_token, "probe_plain_gap": best - top[plain[d]] if plain[d] in top else None}
    if spec[d] in top:
        return {**found, "logit_gap": best - top[spec[d]]}
    # Outside the top 20 is no rounding flip of the argmax: an infinite gap fails any tolerance.
    return {**found, "logit_gap": math.inf,
            "note": f"speculative token outside the plain top {_TOP_LOGPROBS} (gap > {best - min(top.values()):.3f})"}


def run(ctx, device, dtype, config, prompt_len: int, new_tokens: int, kv_cache_bytes: int,
        seed: int = 0, fast_linear: bool = True) -> dict:
    import torch

    from prescient.runtime.model import LlamaModel
    from prescient.runtime.sampling_params import SamplingParams
    from prescient.speculative.speculator import SpecStats

    t0 = time.perf_counter()
    weights = random_weights(config, device, dtype, seed)
    model = LlamaModel(config, weights, dtype=dtype, device=device, fast_linear=fast_linear)
    del weights
    sync(device)
    build_s = time.perf_counter() - t0
    # A repeated phrase: the n-gram proposer finds matches from the first decode step on.
    rng = random.Random(seed)
    phrase = [rng.randrange(config.vocab_size) for _ in range(32)]
    prompt = (phrase * (prompt_len // len(phrase) + 1))[:prompt_len]
    runs = {
        "greedy": SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
        # Sampling takes other code paths (plain: Engine._sample's noise; speculative: rejection
        # sampling), and on a random model's near-flat distributions n-grams rarely hit: the
        # speculative row then shows what speculation costs when it does not pay.
        "t=0.8": SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True),
    }
    rows, errors, outputs = [], {}, {}
    result = {"model": config.name, "dtype": str(dtype).replace("torch.", ""), "model_build_s": build_s,
              "rows": rows, "greedy_outputs_match": None, "errors": errors, "measured_error": None}
    truncated = False
    for sampling, params in runs.items():
        for mode in ("off", "ngram"):
            key = f"{sampling}/{mode}"
            if ctx.expired():
                truncated = True
                rows.append({"sampling": sampling, "speculation": mode, "status": "skipped: time limit"})
                continue
            engine = None
            try:
                # with speculation, the verify cost table is measured on this model first
                engine = _new_engine(model, kv_cache_bytes, mode)
                # A full-length warm-up run first: tree sizes and context lengths vary step to
                # step, and each new Triton specialization compiles on first use (seconds).
                _generate(engine, prompt, params, device)
                if engine.speculator is not None:
                    engine.speculator.stats = SpecStats()  # count the measured run only
                run_result = _generate(engine, prompt, params, device)
                outputs[key] = run_result.pop("tokens")
                run_result.pop("logprobs")
                stats = engine.speculator.stats if engine.speculator is not None else None
                rows.append({
                    "sampling": sampling, "speculation": mode, "status": "ok", "prompt_tokens": prompt_len,
                    **run_result,
                    "ms_per_token": 1e3 / run_result["decode_tokens_per_s"] if run_result["decode_tokens_per_s"] else None,
                    "acceptance_rate": stats.acceptance_rate if stats else None,
                    "mean_accepted_length": stats.mean_accepted_length if stats else None,
                    "distinct_output_tokens": len(set(outputs[key])),
                })
            except Exception as e:
                errors[key] = failure(e)
                rows.append({"sampling": sampling, "speculation": mode, "status": "failed",
                             "error": errors[key]["error"]})
            finally:
                engine = None  # frees this engine's KV cache before the next one
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if key == "greedy/ngram" and "greedy/off" in outputs and key in outputs:
                # Right after the greedy pair, so the tolerance check survives a later time limit.
                try:
                    match = divergence_gap(model, prompt, outputs["greedy/off"], outputs[key], kv_cache_bytes,
                                           device)
                    result["greedy_outputs_match"] = match
                    result["measured_error"] = match["logit_gap"]
                except Exception as e:
                    errors["divergence probe"] = failure(e)
            ctx.checkpoint(result)
    result["truncated"] = "time limit" if truncated else None
    return result


def render(d: dict) -> list[str]:
    if not d.get("rows"):
        return []
    out = [f"{d['model']}, {d['dtype']}; decode rate from the first generated token on, after a "
           "full-length warm-up run, repetitive prompt. A random model's greedy output tends to repeat "
           "itself, which n-grams predict well: read the greedy speculative row as an upper bound and the "
           "sampled one (near-flat distributions, few n-gram hits) as the cost of speculating in vain; "
           "see acceptance and distinct tokens.", ""]
    out.append(table(
        ["sampling", "speculation", "status", "prompt", "decoded", "decode tok/s", "ms/token", "steps",
         "acceptance", "mean accepted len", "distinct tokens", "prefill ms"],
        [[r["sampling"], r["speculation"], r["status"], r.get("prompt_tokens", "–"), r.get("decoded_tokens", "–"),
          fmt(r.get("decode_tokens_per_s")), fmt(r.get("ms_per_token"), 2), r.get("decode_steps", "–"),
          fmt(r.get("acceptance_rate"), 2), fmt(r.get("mean_accepted_length"), 2),
          r.get("distinct_output_tokens", "–"), fmt(r.get("prefill_ms"))] for r in d["rows"]]))
    m = d.get("greedy_outputs_match")
    if m is not None:
        line = f"Greedy tokens identical with and without speculation: {m['identical']}"
        if not m["identical"]:
            line += (f" (first divergence at token {m['first_divergence']}: the speculative token's logit is "
                     f"{m['logit_gap']:.3g} below the plain argmax; bf16 rounding differs between a 1-token "
                     "and a tree forward, so near-ties can flip)")
            if m.get("note"):
                line += f"; {m['note']}"
        out += ["", line]
    for key, err in d.get("errors", {}).items():
        out += ["", f"Decode {key} failed:", "```", err["traceback"][-1500:], "```"]
    return out
