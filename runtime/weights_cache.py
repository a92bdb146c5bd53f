"""Converted-weights cache: a GGUF converted once, then memory-mapped on every later start.

Reading a GGUF means dequantizing every tensor (seconds on 2 cores), or in the native weights
mode copying its blocks, and building the tokenizer from GGUF metadata (seconds more). The first
load of a file in a weights mode writes, under
`cache_dir("weights")/<sha256 of the file>-<mode>-<converter version>/`:

    weights.safetensors   canonical names (runtime/loader.py): float tensors in the mode's dtype
                          (native: the file's own), quantized blocks as uint8 [N, row_bytes]
                          with a metadata entry "quantized" naming each one's qtype and [N, K]
    config.json           ModelConfig + eos ids + the weights mode
    tokenizer/            the Hugging Face tokenizer, saved (tokenizer.json + chat template)

Later loads memory-map the safetensors and read the saved tokenizer (well under a second).
The key is the file's content hash, so a changed file is never served stale; the hash itself is
remembered per (path, size, mtime) so a start does not re-read the whole file to find its entry.
A Hugging Face folder is already safetensors and loads directly (no cache).

Weights modes (`--weights`): `native` keeps a GGUF's quantized tensors in their blocks and its
float tensors in their own dtype (the model casts those to the compute dtype); `bfloat16` /
`float32` dequantize every tensor into that dtype; None (callers that predate the modes) is every
tensor in the compute dtype. `quantize` (`--quantize int8|int4`) quantizes a float checkpoint's
linear weights at load (loader.quantize_linears); it is part of the entry's mode.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from prescient.cache_dir import cache_dir
from prescient.runtime import config as config_module
from prescient.runtime import loader as loader_module
from prescient.runtime import tokenizer as tokenizer_module
from prescient.runtime.config import ModelConfig, RopeScaling
from prescient.runtime.engine import DTYPES
from prescient.runtime import linear as linear_module
from prescient.runtime.linear import QuantWeight
from prescient.runtime.loader import (QUANTIZE, LoadedCheckpoint, ModelLoadError, is_quantized, load_checkpoint,
                                      quantize_linears, resolve_model_path)
from prescient.runtime.tokenizer import Tokenizer

log = logging.getLogger("prescient.loader")

_FORMAT = 3  # the cached layout (3: quantized blocks + weights modes); the converter's own version is in `converter_version`
WEIGHTS = ("native", "bfloat16", "float32")


@functools.cache
def converter_version() -> str:
    """What a cached conversion depends on besides the file: the code that converts (loader,
    config, tokenizer and this module) and the libraries it calls. A change to any of them is a
    new entry, never a stale one."""
    h = hashlib.sha256(str(_FORMAT).encode())
    for module in (loader_module, config_module, tokenizer_module, linear_module):
        h.update(Path(module.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    for dist in ("gguf", "transformers", "tokenizers", "safetensors", "torch"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.hexdigest()[:12]


@dataclass
class ModelFiles:
    """A checkpoint ready for `LlamaModel`: weights in the mode's dtype (or blocks), tokenizer loaded."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantWeight]
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    identity: str  # content hash + weights mode + dtype: what a measurement on this model is keyed by
    from_cache: bool
    mode: str = ""  # the weights mode the entry was made in (`weights_mode`)


def weights_mode(weights: str | None, dtype: str, quantize: str | None = None) -> str:
    """The name of a conversion: what the cache entry and the identity are keyed by."""
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    mode = weights or dtype
    return f"{mode}+{QUANTIZE[quantize]}" if quantize else mode


def load_model_files(path: str | None, dtype: str, use_cache: bool = True, progress: bool = False,
                     weights: str | None = None, quantize: str | None = None) -> ModelFiles:
    """weights: native | bfloat16 | float32 | None (every tensor in `dtype`); quantize: int8 |
    int4 | None (module docstring)."""
    path = resolve_model_path(path)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    mode = weights_mode(weights, dtype, quantize)
    if not (use_cache and path.endswith(".gguf") and os.path.isfile(path)):
        return _convert(_load(path, progress, weights, quantize), mode, f"{_folder_identity(path)}|{mode}|{dtype}")
    digest = content_hash(path)
    identity = f"{digest}|{mode}|{dtype}"
    entry = cache_dir("weights") / f"{digest[:32]}-{mode}-{converter_version()}"
    if entry.exists():
        try:
            return _read_entry(entry, identity)
        except Exception as e:  # noqa: BLE001 - a damaged entry: remove it, convert again
            log.warning("weights cache entry %s unreadable (%s); converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    files = _convert(_load(path, progress, weights, quantize), mode, identity)
    _write_entry(entry, files)
    return files


def _load(path: str, progress: bool, weights: str | None, quantize: str | None) -> LoadedCheckpoint:
    # only the native mode reads blocks (the other modes' call is the one older callers know)
    ckpt = load_checkpoint(path, progress, native=True) if weights == "native" else load_checkpoint(path, progress)
    if quantize is not None:
        quantized = [f for f in ckpt.stored_formats if is_quantized(f)]
        if quantized:
            raise ModelLoadError(
                f"--quantize {quantize} quantizes float weights, but {os.path.basename(path)} is already quantized "
                f"({'+'.join(quantized)}): drop --quantize to run its own blocks (--weights native) or to "
                "dequantize them (--weights bfloat16|float32)")
        ckpt.weights = quantize_linears(ckpt.weights, quantize)
    return ckpt


def _convert(ckpt: LoadedCheckpoint, mode: str, identity: str) -> ModelFiles:
    dtype = mode.split("+")[0]
    weights = {k: v if isinstance(v, QuantWeight) or dtype == "native" else v.to(DTYPES[dtype])
               for k, v in ckpt.weights.items()}
    tokenizer = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file, ckpt.eos_token_ids)
    return ModelFiles(ckpt.config, weights, tokenizer, ckpt.eos_token_ids, identity, False, mode)


def _folder_identity(path: str) -> str:
    """A Hugging Face folder's (or an uncached file's) identity: names, sizes and mtimes (not
    re-hashed)."""
    p = Path(path)
    parts = [str(p.resolve())]
    for f in sorted(p.iterdir()) if p.is_dir() else [p]:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def content_hash(path: str) -> str:
    """sha256 of the file, remembered per (path, inode, size, mtime, ctime): `cp -p` or rsync can
    put another file of the same size and mtime in place, but not with the same inode and ctime."""
    st = os.stat(path)
    stamp = f"{os.path.abspath(path)}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    index = cache_dir("weights") / "hashes.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp in known:
        return known[stamp]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    known[stamp] = h.hexdigest()
    _atomic_write(index, json.dumps(known))
    return known[stamp]


def _read_entry(entry: Path, identity: str) -> ModelFiles:
    from safetensors import safe_open
    from safetensors.torch import load_file

    meta = json.loads((entry / "config.json").read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"cache format {meta.get('format')} != {_FORMAT}")
    cfg = dict(meta["config"])
    cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"])
    eos = tuple(meta["eos_token_ids"])
    tokenizer = Tokenizer.load(str(entry / "tokenizer"), None, eos)
    path = str(entry / "weights.safetensors")
    weights: dict = load_file(path)
    with safe_open(path, "pt") as f:  # reads the header only
        quantized = json.loads((f.metadata() or {}).get("quantized", "{}"))
    for name, (qtype, n, k) in quantized.items():
        weights[name] = QuantWeight(weights[name], qtype, (n, k))
    return ModelFiles(ModelConfig(**cfg), weights, tokenizer, eos, identity, True, meta["weights"])


def _write_entry(entry: Path, files: ModelFiles) -> None:
    """Write into a temporary folder beside the entry, then rename: a crash or a concurrent
    writer never leaves a half-written entry behind."""
    from safetensors.torch import save_file

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _sweep_partial(entry.parent)
        tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".partial-", dir=entry.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the entry from a shared cache's users
        # safetensors refuses tensors that share storage: copy those (only those: memory)
        seen, tensors, quantized = set(), {}, {}
        for k, v in files.weights.items():
            if isinstance(v, QuantWeight):
                quantized[k] = [v.qtype, *v.shape]
                v = v.blocks
            v = v.contiguous()
            tensors[k] = v.clone() if v.untyped_storage().data_ptr() in seen else v
            seen.add(v.untyped_storage().data_ptr())
        save_file(tensors, str(tmp / "weights.safetensors"), metadata={"quantized": json.dumps(quantized)})
        files.tokenizer.hf.save_pretrained(str(tmp / "tokenizer"))
        meta = {"format": _FORMAT, "config": dataclasses.asdict(files.config),
                "eos_token_ids": list(files.eos_token_ids), "weights": files.mode}
        (tmp / "config.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process wrote it first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a full or read-only disk: serve anyway, convert again next time
        log.warning("could not write the weights cache (%s)", e)


def _sweep_partial(folder: Path, max_age_s: float = 3600.0) -> None:
    """Remove conversions a crashed process left half-written (older than an hour)."""
    import time

    for p in folder.glob("*.partial-*"):
        try:
            if time.time() - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _atomic_write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass
