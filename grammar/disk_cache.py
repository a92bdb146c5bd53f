"""Compiled grammars kept on disk across restarts (`cache_dir("grammars")`): a schema or an agent's
tool set compiles once per machine, not once per server start.

    key   = sha256(fingerprint, spec kind, spec source)
    entry = <key>.json: {"blob": xgrammar's serialized grammar, "compile_s", "forced_spans"}
    fingerprint = xgrammar's version, the tokenizer (its serialized info), the compile options
                  that shape a grammar, and the source of prescient's grammar package (a change
                  to the lowering makes every entry a miss, never a stale grammar)

Bounded in bytes: after a write the least recently used entries (by mtime, touched on a hit) go
until the folder fits. A damaged or unreadable entry is a miss (and removed); a write that fails
(a full disk) is logged and forgotten. Only the worker-process compiles (CompilePool) use it: they
already hold the serialized form.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import tempfile
from dataclasses import asdict

log = logging.getLogger("prescient.grammar")

# CompilerConfig fields that change no compiled grammar (scheduling, limits, caches)
# (backend too: the disk cache holds xgrammar compiles only, the same under "auto" and "xgrammar")
_RUNTIME_FIELDS = {"time_limit_s", "max_workers", "xgrammar_threads", "isolate", "cache_size", "nice",
                   "xgrammar_cache_mb", "disk_cache_mb", "backend"}


def fingerprint(tokenizer_info_json: str, config) -> str:
    h = hashlib.sha256()
    h.update(importlib.metadata.version("xgrammar").encode())
    h.update(hashlib.sha256(tokenizer_info_json.encode()).digest())
    options = {k: v for k, v in asdict(config).items() if k not in _RUNTIME_FIELDS}
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    package = pathlib.Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class GrammarDiskCache:
    def __init__(self, folder: pathlib.Path, fingerprint: str, limit_bytes: int):
        self.folder = pathlib.Path(folder)
        self.fingerprint = fingerprint
        self.limit_bytes = limit_bytes
        self.hits = self.misses = 0

    def _path(self, spec) -> pathlib.Path:
        key = hashlib.sha256("\0".join((self.fingerprint, spec.kind, spec.source)).encode()).hexdigest()
        return self.folder / f"{key}.json"

    def has(self, spec) -> bool:
        """An earlier compile of `spec` is on disk (not counted as a hit or a miss)."""
        return self._path(spec).exists()

    def load(self, spec) -> tuple[str, float, bool] | None:
        """(serialized grammar, compile seconds, forced_spans) of an earlier compile, or None."""
        path = self._path(spec)
        try:
            entry = json.loads(path.read_text())
            found = (entry["blob"], float(entry["compile_s"]), bool(entry["forced_spans"]))
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, KeyError, TypeError):  # damaged: a miss, and gone
            log.warning("a cached grammar could not be read (%s); compiling again", path.name)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        self.hits += 1
        return found

    def store(self, spec, blob: str, compile_s: float, forced_spans: bool) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            data = json.dumps({"blob": blob, "compile_s": compile_s, "forced_spans": forced_spans})
            if len(data) > self.limit_bytes:
                return  # bigger than the whole cache: not kept
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self._path(spec))  # whole or not at all: a reader never sees half
            self._evict()
        except OSError as e:
            log.warning("a compiled grammar could not be cached on disk: %s", e)

    def _evict(self) -> None:
        entries = []
        for p in self.folder.glob("*.json"):
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):  # oldest first
            if total <= self.limit_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
