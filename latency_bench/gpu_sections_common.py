"""Helpers shared by gpu_check's sections (gpu_sections_*.py): Markdown tables, number format,
error records and CUDA synchronisation.

Kept free of prescient imports so that any section module can use it, however it was loaded.
"""

from __future__ import annotations

import math
import traceback


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def fmt_err(x) -> str:
    """An error measure: small floats in scientific notation, counts as integers."""
    if x is None:
        return "–"
    if isinstance(x, int) or (isinstance(x, float) and math.isfinite(x) and x == int(x) and (x >= 1 or x == 0)):
        return str(int(x))
    return f"{x:.2e}" if isinstance(x, float) and math.isfinite(x) else str(x)


def short_error(e: BaseException, limit: int = 500) -> str:
    return f"{type(e).__name__}: {e}"[:limit]


def failure(e: BaseException) -> dict:
    """What a caught exception leaves in the report (call inside the `except` block)."""
    return {"error": short_error(e, 2000), "traceback": traceback.format_exc()[-4000:]}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
