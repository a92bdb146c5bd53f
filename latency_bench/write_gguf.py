"""Write BF16, F32 and Q8_0 GGUFs of the default model from its shipped Q4_1 file, so llama.cpp
and prescient can be compared in each weight format on the same weights.

    prescient bench write-gguf --out DIR [--formats bf16,f32,q8_0] [--model PATH]
    (= python -m prescient.latency_bench.write_gguf ...)

Every tensor is dequantized (gguf.quants) and written again with the `gguf` package's GGUFWriter:
2-D tensors in the asked format (Q8_0 through gguf.quants.quantize), 1-D tensors (the norms) in
F32, as llama.cpp's converter keeps them. The metadata (architecture, hyperparameters, tokenizer,
chat template) is copied field by field, `general.file_type` set to the new format. Q/K rows stay
in llama.cpp's permuted layout, as in any GGUF; both readers undo it themselves. The values are
the Q4_1 file's: F32 holds them exactly, BF16 rounds them, Q8_0 re-quantizes them (so the Q8_0
file is not the original model quantized to Q8_0, and is no better than the Q4_1 one).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from prescient.latency_bench.suites import suite_parser

FORMATS = ("bf16", "f32", "q8_0")


def write_gguf(src: str, out: str, fmt: str) -> Path:
    """Write `src`'s tensors in `fmt` (one of FORMATS) to the file `out`; returns its path."""
    import gguf

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f32": gguf.GGMLQuantizationType.F32,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[fmt]
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own counts and version, written by the writer
        if key == "general.file_type":
            writer.add_key_value(key, int(file_type), gguf.GGUFValueType.UINT32)
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    if "general.file_type" not in reader.fields:
        writer.add_key_value("general.file_type", int(file_type), gguf.GGUFValueType.UINT32)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # numpy order [out, in]
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        target = qtype if len(shape) > 1 else gguf.GGMLQuantizationType.F32
        if target == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % block:
            target = gguf.GGMLQuantizationType.BF16  # no whole Q8_0 blocks in a row: the next best
        if target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def output_name(src: str, fmt: str) -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.BF16.gguf"""
    stem = Path(src).stem
    base, dot, last = stem.rpartition(".")
    if dot and last.upper().replace("_", "").startswith(("Q", "F", "BF", "IQ")):
        stem = base
    return f"{stem}.{fmt.upper()}.gguf"


def cli(argv: list[str] | None = None) -> int:
    from prescient.runtime.loader import default_model_path

    p = suite_parser("write-gguf", __doc__, out={"required": True, "help": "folder to write the GGUFs into "
                                                 "(created if missing)"})
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma-separated formats to write, of {', '.join(FORMATS)}")
    p.add_argument("--model", default=None, help="the GGUF to start from; unset = the default model's Q4_1 file")
    args = p.parse_args(argv)
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        p.error(f"unknown format(s) {', '.join(bad)} (choose from {', '.join(FORMATS)})")
    src = args.model or default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        t0 = time.perf_counter()
        path = write_gguf(src, str(out / output_name(src, fmt)), fmt)
        print(f"{path} ({path.stat().st_size / (1 << 20):.1f} MiB, {time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
