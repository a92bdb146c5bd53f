"""Where prescient keeps what it can rebuild: compiled kernels, converted weights, cost tables.

`$PRESCIENT_CACHE_DIR`, else `$XDG_CACHE_HOME/prescient`, else `~/.cache/prescient`. A leaf
module (standard library only), so every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The folder for one kind of cached thing (e.g. "kernels", "weights"); not created here."""
    base = os.environ.get("PRESCIENT_CACHE_DIR")
    if base:
        return Path(base) / kind
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "prescient" / kind
