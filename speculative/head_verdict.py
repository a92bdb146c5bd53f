"""Whether a trained EAGLE head pays here: the verdict `prescient train-head` writes beside it.

Having a head is not reason enough for `--speculate auto` to use it: on a 2-core AVX2 machine a
head trained by the command drafted slower than n-gram on every workload kind (chat 1.23x vs
1.44x over plain decoding, long_edit 1.12x vs 1.37x, tool_call 0.94x vs 1.05x), because a head
call per depth costs CPU time n-gram lookups do not. So the command measures the head beside
n-gram on the bundled workloads (prescient/train_head.py, `measure_verdict`) and writes

    <head>.verdict.json = {"tier", "head_sha256", "ngram_tok_s", "eagle_tok_s",
                           "eagle_over_ngram", "pays", ...}

and auto takes the head only where that verdict is for this head file, this kernel tier, and says
it pays (eagle at least PAYS_RATIO times n-gram's tok/s). Any other head stays available to
`--speculate eagle`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# eagle / n-gram tok/s a verdict needs to call a head worth taking: above the few % the
# interleaved measurement wanders by on a shared machine
PAYS_RATIO = 1.02


def verdict_path(head_path: str) -> Path:
    return Path(head_path).with_suffix(".verdict.json")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def kernel_tier() -> str | None:
    """The CPU kernels' ISA tier in use (None where the native kernels are unavailable)."""
    try:
        from prescient.kernels.cpu_linear import kernel_info

        return kernel_info().get("isa")
    except Exception:  # no compiler, no .so: the tier is unknown, not an error
        return None


def read_verdict(head_path: str) -> dict | None:
    try:
        with open(verdict_path(head_path)) as f:
            verdict = json.load(f)
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) else None


def write_verdict(head_path: str, verdict: dict) -> Path:
    path = verdict_path(head_path)
    path.write_text(json.dumps(verdict, indent=1) + "\n")
    return path


def head_pays_here(head_path: str) -> tuple[bool, str]:
    """(auto may take the head, why): its verdict must be for this file and this tier, and say
    it pays."""
    verdict = read_verdict(head_path)
    if verdict is None:
        return False, "no measurement beside n-gram (run `prescient train-head --verdict-only`)"
    tier = kernel_tier()
    if verdict.get("tier") != tier:
        return False, f"measured on kernel tier {verdict.get('tier')}, this one is {tier}"
    if verdict.get("head_sha256") != file_sha256(head_path):
        return False, "measured for another head file"
    if verdict.get("pays") is not True:
        return False, (f"measured slower than n-gram here ({verdict.get('eagle_over_ngram', 0):.2f}x its tok/s, "
                       f"{PAYS_RATIO}x needed)")
    return True, f"measured {verdict.get('eagle_over_ngram', 0):.2f}x n-gram's tok/s here"
