"""The one way to build an engine: `build_engine(EngineSpec(...))`.

It sits above runtime/ and speculative/ because it assembles both: the model (from the
converted-weights cache, runtime/weights_cache.py, its transformations applied here:
runtime/model.prepare_for_cpu, or tp_worker.launch's tensor-parallel shards), the engine's
configs, and the speculator, handed to the `Engine` as an argument. The CLI, the server,
latency_bench and every script build engines here (tests also assemble small engines by hand,
with hand-set cost tables).

    spec   = EngineSpec(model=None, dtype="bfloat16", speculate="ngram")
    loaded = load_model(spec)                  # optional: share one model between engines
    engine = build_engine(spec, loaded)
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import DTYPES, Engine, EngineConfig
from prescient.runtime.loader import QUANTIZE
from prescient.runtime.model import LlamaModel, ModelRunner, prepare_for_cpu
from prescient.runtime.weights_cache import WEIGHTS, load_model_files

# auto = eagle where the target has a trained head (shipped, or `prescient train-head`) measured to beat
# ngram on this kernel tier (speculative/head_verdict.py), else ngram
SPECULATE = ("auto", "eagle", "ngram", "draft", "off")
# how the speculator's verify-cost table is obtained (speculative/speculator.make_speculator):
# idle = cached, else measured in the engine's idle moments; now = cached, else measured before
# the engine is returned; fresh = measured now whatever is cached; off = the default table
CALIBRATE = ("idle", "now", "fresh", "off")
# The int8 KV cache has C kernels (CPU) only: on CUDA, kernels/ops.py would send store_kv and
# tree_attention to the torch reference, which reads each sequence's block table and lengths back
# to the host in every layer of every step. Refused rather than run at a fraction of the speed.
KV_INT8_ON_CUDA = ("--kv-dtype int8 is not supported on CUDA: the Triton kernels have no int8 KV cache path (only "
                   "the CPU's C kernels read int8 rows with their scales); use --kv-dtype auto on a GPU")


@dataclass(frozen=True)
class EngineSpec:
    model: str | None = None  # a .gguf file or a Hugging Face folder; None = the default model
    dtype: str = "bfloat16"  # activations, norms and KV cache
    # how the weight matrices are held: native = a GGUF's quantized blocks as they are (its float
    # tensors, and a Hugging Face folder, in `dtype`); bfloat16 / float32 = dequantized at load
    weights: str = "native"
    quantize: str | None = None  # int8 (q8_0) | int4 (q4_1): a float checkpoint's linears, at load
    device: str = "cpu"
    speculate: str = "auto"
    # for speculate="draft": a checkpoint path, self-int4 / self-int8 (the target's own weights
    # quantized at load), None = layer-truncated target
    draft_model: str | None = None
    force_draft: bool = False  # start a draft that speculative/draft_gate.py judges cannot pay
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_gb: float = 1.0
    kv_dtype: str = "auto"  # "auto" = the compute dtype; "int8" = int8 rows + a scale per token and head
    enable_prefix_caching: bool = True
    session_ttl_s: float = 300.0  # how long a finished agent turn keeps its KV pinned
    max_waiting: int = 256  # queued requests before a new one is refused as overloaded (429)
    max_queue_wait_s: float = 30.0  # a request not started this long after arrival: overloaded
    # the scheduler's time budget (docs/SCHEDULING.md): steps with prefill work beside decodes
    # stay within a margin of this ITL bound (a request's slo.itl_ms tightens it; None: token
    # budget only); waiting prompts start earliest TTFT deadline first, this the default bound
    itl_target_ms: float | None = 100.0
    ttft_target_ms: float = 1000.0
    calibrate: str = "idle"
    weights_cache: bool = True  # memory-map converted GGUF weights from the user's cache
    progress: bool = True  # stage progress on stderr
    # tensor-parallel ranks (runtime/tp_worker.py): rank 0 is this process, the others are spawned
    tp: int = 1
    # a prefill/decode split (runtime/disaggregated.py): this process decodes, a spawned prefill
    # worker computes every prompt and hands its KV pages over torch.distributed
    pd_split: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r} (supported: {', '.join(DTYPES)})")
        if self.speculate not in SPECULATE:
            raise ValueError(f"speculate must be one of {SPECULATE}, got {self.speculate!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {tuple(QUANTIZE)} or unset, got {self.quantize!r}")
        if self.calibrate not in CALIBRATE:
            raise ValueError(f"calibrate must be one of {CALIBRATE}, got {self.calibrate!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.kv_cache_gb <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, kv_cache_gb > 0")
        if self.kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'int8', got {self.kv_dtype!r}")
        import torch

        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp!r}")
        if self.pd_split and self.tp > 1:
            raise ValueError("--pd-split with --tp > 1 is not supported: both workers would need their own "
                             "tensor-parallel group")
        if self.pd_split and self.speculate == "draft":
            raise ValueError("--pd-split with --speculate draft is not supported: the draft model keeps its own "
                             "KV of the prompt, which the prefill worker does not compute (use ngram or off)")
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch build sees no CUDA device")
        if kind == "cuda" and self.kv_dtype == "int8":
            raise ValueError(KV_INT8_ON_CUDA)


@dataclass
class LoadedModel:
    """A model ready to serve, shareable (read-only) by several engines. `load_model` makes one
    from a checkpoint; a script with random weights makes one directly (identity None: its
    verify-cost table is measured, never cached)."""

    model: ModelRunner  # a LlamaModel, or a TensorParallelModel under --tp
    tokenizer: object | None  # runtime.tokenizer.Tokenizer
    eos_token_ids: tuple[int, ...]
    identity: str | None  # weights content hash + weights mode + dtype (runtime/weights_cache.py)
    config: object = None  # runtime.config.ModelConfig; None = the model's own

    def __post_init__(self) -> None:
        self.config = self.config or self.model.config


def stage(message: str, enabled: bool):
    """A one-line stage report on stderr ("loading ... 0.4 s")."""
    return _Stage(message, enabled)


class _Stage:
    def __init__(self, message: str, enabled: bool):
        self.message, self.enabled = message, enabled

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.enabled:
            print(f"prescient: {self.message} ...", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc):
        if self.enabled and exc[0] is None:
            print(f"prescient: {self.message}: done in {time.perf_counter() - self.t0:.1f} s",
                  file=sys.stderr, flush=True)


def weights_label(spec: EngineSpec) -> str:
    """How the spec's weights are held, as LlamaModel.weights_description() names it."""
    parts = [f"--quantize {spec.quantize}"] if spec.quantize else []
    if spec.weights != "native":
        parts.append(f"--weights {spec.weights}")
    return ", ".join(parts) or "native"


def load_model(spec: EngineSpec) -> LoadedModel:
    """Weights (cached conversion when the model is a GGUF), tokenizer and the model itself."""
    flags = f"--weights {spec.weights}" + (f" --quantize {spec.quantize}" if spec.quantize else "")
    with stage(f"loading {spec.model or 'the default model'} ({flags}, --dtype {spec.dtype})", spec.progress):
        files = load_model_files(spec.model, spec.dtype, spec.weights_cache, spec.progress,
                                 weights=spec.weights, quantize=spec.quantize)
        kwargs = dict(dtype=DTYPES[spec.dtype], weights_dtype=None if spec.weights == "native" else DTYPES[spec.weights],
                      weights_mode=weights_label(spec))
        if spec.tp > 1:  # rank 0's shard (sharded, then prepared); the workers load theirs (the cache, mapped)
            from prescient.runtime.tp_worker import CheckpointSource, launch

            source = CheckpointSource(spec.model, spec.dtype, spec.weights_cache, spec.weights, spec.quantize)
            model = launch(source, spec.tp, kwargs, device=spec.device, rank0_weights=(files.config, files.weights),
                           progress=spec.progress)
        else:
            # the reference model, then the CPU transformation (a no-op on CUDA)
            model = LlamaModel(files.config, files.weights, device=spec.device, **kwargs, prepare=False)
            model = prepare_for_cpu(model)
    if spec.progress:
        print(f"prescient: {memory_line(model, spec.kv_dtype)}", file=sys.stderr, flush=True)
    if spec.device == "cpu":
        # the native kernels compile once per machine (tens of seconds); say so when it happens
        from prescient.kernels import cpu_linear

        if not cpu_linear.is_built():
            with stage("compiling the CPU kernels (once per machine)", spec.progress):
                cpu_linear.available()
        else:
            cpu_linear.available()
        if spec.progress and cpu_linear.available():
            print(f"prescient: {kernels_line(cpu_linear.kernel_info(), spec.tp)}", file=sys.stderr, flush=True)
    return LoadedModel(model, files.tokenizer, files.eos_token_ids, files.identity, files.config)


def memory_line(model: ModelRunner, kv_dtype: str = "auto") -> str:
    """"weights q4_1+q8_0 (native): 92.0 MiB; KV cache bfloat16: 22.5 KiB/token (on huge pages)"."""
    from prescient.kernels import huge_pages
    from prescient.kernels.cpu_linear import amx_bytes, pairs_bytes
    from prescient.kernels.quant_linear import regrouped_bytes

    kv = torch.int8 if kv_dtype == "int8" else model.dtype
    rg = regrouped_bytes() + amx_bytes() + pairs_bytes()
    # (all of the process's copies: a draft model's too)
    extra = f" (+{rg / (1 << 20):.1f} MiB of weight copies laid out for the SIMD kernels)" if rg else ""
    pages = f" ({huge_pages.describe()})" if model.device.type == "cpu" else ""
    return (f"weights {model.weights_description()}: {model.weight_bytes() / (1 << 20):.1f} MiB{extra}; "
            f"KV cache {str(kv).replace('torch.', '')}: {model.kv_bytes_per_token(kv) / 1024:.1f} KiB/token{pages}")


def kernels_line(info: dict, tp: int = 1) -> str:
    """"CPU kernels avx2, 8 threads (...)": the tier (with "+ AVX-VNNI" where tier avx2's rows take
    it, "+ SDOT" where aarch64's portable tier runs the int8 kernels on it, "(vdpbf16ps as FMAs)" where tier avx512_bf16 computes that instruction's products by FMAs) and the pool size in use (kernels/cpu_linear.kernel_info), where the size came from and
    how to change it."""
    if os.environ.get("PRESCIENT_GEMV_THREADS"):
        how = "PRESCIENT_GEMV_THREADS"
    elif tp > 1:
        how = f"the usable cores shared by {tp} ranks"
    else:
        how = "one per usable core; PRESCIENT_GEMV_THREADS=n to change"
    n = info["threads"]
    notes = [n for n, on in (("vdpbf16ps as FMAs", info.get("bf16_dot") == "fma"),
                             ("bf16 weights on AMX", info.get("bf16_amx")),
                             ("q.K on AMX", info.get("attn_amx"))) if on]
    isa = (info["isa"] + (" + AVX-VNNI" if info.get("avx_vnni") else "") + (" + SDOT" if info.get("neon_dot") else "")
           + (f" ({'; '.join(notes)})" if notes else ""))
    return f"CPU kernels {isa}, {n} thread{'s' if n != 1 else ''} ({how})"


def _draft_config(spec: EngineSpec, loaded: LoadedModel):
    """The draft proposer's config: a self-quantized copy built from the target's own weights
    (read again from the converted-weights cache), else draft_model.draft_config_for's."""
    from prescient.speculative.draft_model import (SELF_DRAFTS, DraftModelConfig, draft_config_for,
                                                   self_quantized_draft)

    if spec.draft_model not in SELF_DRAFTS:
        return draft_config_for(loaded.model, loaded.tokenizer, spec.draft_model)
    files = load_model_files(spec.model, spec.dtype, spec.weights_cache, False, weights=spec.weights,
                             quantize=spec.quantize)
    with stage(f"quantizing the target into its {spec.draft_model} draft", spec.progress):
        draft = self_quantized_draft(loaded.model, files.weights, spec.draft_model)
    return DraftModelConfig(draft_model=draft, target_model=loaded.model)


def eagle_refusal(spec: EngineSpec) -> str | None:
    """Why this spec cannot draft with an EAGLE head, or None."""
    if spec.tp > 1:
        return "--speculate eagle with --tp > 1 is not supported (the head reads rank 0's features only)"
    if spec.pd_split:
        return "--speculate eagle with --pd-split is not supported (the prefill worker keeps the prompt's features)"
    if not spec.device.startswith("cpu"):
        return "--speculate eagle runs on the CPU path only for now (the CUDA graphs keep only logits)"
    return None


def speculate_choice(spec: EngineSpec, model) -> tuple[str, str | None]:
    """(the proposer `spec.speculate` means for this model, why auto left a present head out or
    None): auto = eagle when the model has a head that was measured to beat n-gram on this kernel
    tier (speculative/head_verdict.py) and the spec allows it, else ngram; eagle without a head
    (or where refused) is an error."""
    from prescient.speculative.eagle import has_head, head_path_for
    from prescient.speculative.head_verdict import head_pays_here

    if spec.speculate not in ("auto", "eagle"):
        return spec.speculate, None
    refusal = eagle_refusal(spec)
    if spec.speculate == "auto":
        if refusal is not None or not has_head(model):
            return "ngram", None
        pays, why = head_pays_here(head_path_for(model))
        return ("eagle", None) if pays else ("ngram", f"the EAGLE head {head_path_for(model)} is left to "
                                                      f"--speculate eagle: {why}")
    if refusal is not None:
        raise ValueError(refusal)
    if not has_head(model):
        raise ValueError(f"--speculate eagle: no head for this model at {head_path_for(model)}; "
                         "train one with `prescient train-head` (or use --speculate ngram)")
    return "eagle", None



def _eagle_config(model):
    from prescient.speculative.eagle import EagleConfig, head_path_for
    from prescient.speculative.ngram import NgramProposer

    return EagleConfig(target_model=model, head_path=head_path_for(model), ngram=NgramProposer())


def build_engine(spec: EngineSpec, loaded: LoadedModel | None = None, config: EngineConfig | None = None) -> Engine:
    """An Engine (with its speculator, unless speculate="off") for `spec`. `loaded` shares an
    already loaded model (its dtype and device must be the spec's); `config` replaces the
    EngineConfig the spec's knobs make (tests and tools that set block sizes or block counts)."""
    from prescient.speculative.speculator import make_speculator
    from prescient.speculative.verify_cost import cache_key

    loaded = loaded or load_model(spec)
    if loaded.model.dtype is not DTYPES[spec.dtype]:
        raise ValueError(f"the loaded model is {loaded.model.dtype}, the spec asks for {spec.dtype}")
    if loaded.model.weights_mode and loaded.model.weights_mode != weights_label(spec):
        raise ValueError(f"the loaded model's weights are {loaded.model.weights_mode}, the spec asks for "
                         f"{weights_label(spec)}")
    if (config is not None and config.cache.kv_dtype == "int8"
            and str(loaded.model.device).startswith("cuda")):
        raise ValueError(KV_INT8_ON_CUDA)  # an EngineConfig given directly: the same refusal as the spec's
    config = config or EngineConfig(
        dtype=spec.dtype,
        cache=CacheConfig(kv_cache_bytes=int(spec.kv_cache_gb * (1 << 30)), enable_prefix_caching=spec.enable_prefix_caching,
                          kv_dtype=None if spec.kv_dtype == "auto" else spec.kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                                  max_waiting=spec.max_waiting, max_queue_wait_s=spec.max_queue_wait_s,
                                  itl_target_s=None if spec.itl_target_ms is None else spec.itl_target_ms / 1e3,
                                  ttft_target_s=spec.ttft_target_ms / 1e3),
        session_ttl_s=spec.session_ttl_s,
    )
    block_size = config.cache.block_size
    speculator = None
    if spec.speculate != "off":
        # a draft model is named by its path (it is loaded uncached, speculative/draft_model.py)
        key = None if loaded.identity is None else cache_key(
            f"{loaded.identity}|{spec.draft_model}", spec.speculate, block_size, spec.device)
        method, left_out = speculate_choice(spec, loaded.model)
        draft_config = _draft_config(spec, loaded) if method == "draft" else None
        if method == "eagle":
            draft_config = _eagle_config(loaded.model)
            if spec.progress:
                print(f"prescient: speculation: the EAGLE head {draft_config.head_path} with n-gram copies",
                      file=sys.stderr, flush=True)
        elif left_out and spec.progress:  # a head exists: say why auto did not take it
            print(f"prescient: speculation: ngram; {left_out}", file=sys.stderr, flush=True)
        speculator = make_speculator(loaded.model, block_size, method, spec.draft_model, loaded.tokenizer,
                                     calibrate="off" if spec.calibrate == "off" else "idle", cache_key=key,
                                     use_cache=spec.calibrate != "fresh", proposer_config=draft_config)
        if method == "draft" and spec.calibrate != "off":
            from prescient.speculative.draft_gate import check_draft_pays
            from prescient.speculative.draft_model import draft_label

            with stage("checking that the draft pays (cached for later starts)", spec.progress):
                verdict = check_draft_pays(speculator, loaded.model, draft_label(draft_config, spec.draft_model),
                                           loaded.tokenizer, loaded.eos_token_ids, key, force=spec.force_draft,
                                           use_cache=spec.calibrate != "fresh")
            if spec.progress:
                print(f"prescient: {verdict.describe()}", file=sys.stderr, flush=True)
        if spec.calibrate in ("now", "fresh") and speculator.calibration is not None:
            with stage("measuring the verify cost (cached for later starts)", spec.progress):
                while speculator.idle_work():
                    pass
    if spec.pd_split and loaded.identity is None:
        raise ValueError("--pd-split needs a checkpoint the prefill worker can load itself (this model's "
                         "weights were made in memory)")
    engine = Engine(loaded.model, loaded.tokenizer, config, eos_token_ids=loaded.eos_token_ids,
                    speculator=speculator)
    if spec.pd_split:
        start_prefill_worker(spec, engine)
    return engine


def start_prefill_worker(spec: EngineSpec, engine: Engine) -> None:
    """Spawn the split's prefill worker (the same checkpoint, read from the converted-weights
    cache) and give this engine the decode side. The cores are shared out between the two."""
    from prescient.runtime.disaggregated import launch_prefill_worker
    from prescient.runtime.tensor_parallel import default_threads
    from prescient.runtime.tp_worker import CheckpointSource, _set_threads

    threads = default_threads(2)
    _set_threads(threads)
    source = CheckpointSource(spec.model, spec.dtype, spec.weights_cache, spec.weights, spec.quantize)
    kwargs = dict(dtype=DTYPES[spec.dtype], weights_dtype=None if spec.weights == "native" else DTYPES[spec.weights],
                  weights_mode=weights_label(spec), device=spec.device)
    with stage(f"starting the prefill worker ({threads} thread(s) each)", spec.progress):
        engine.remote_prefill = launch_prefill_worker(engine, source, kwargs, threads=threads)
