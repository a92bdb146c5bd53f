"""The grammar compile worker process: the other end of compile_pool.py's socket pair.

CompilePool starts `python -c "from prescient.grammar.compile_worker import worker_main; ..."`
at low priority; the worker builds a GrammarCompiler of its own (in-process: `isolate=False`)
from the tokenizer and config the pool sends, says "ready", then answers each (kind, source)
with xgrammar's serialized grammar or the refusal. It lives apart from the pool because it needs
the compiler, which itself needs the pool: here both imports stay at module level, acyclic.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
from multiprocessing.connection import Connection

import xgrammar as xgr

from prescient.grammar.compiler import CompilerConfig, GrammarCompiler
from prescient.grammar.errors import GrammarError
from prescient.grammar.spec import GrammarSpec
from prescient.grammar.tokenizer import GrammarTokenizer


def worker_main(fd: int) -> None:
    """A worker process: compile what arrives on socket `fd` until it closes."""
    conn = Connection(fd)
    try:
        tokenizer_info_json, stop_token_ids, config_fields = conn.recv()
    except (EOFError, OSError):  # the pool closed before this worker was up
        return
    with contextlib.suppress(OSError):  # if memory runs out, the kernel should pick this process
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    with contextlib.suppress(Exception):  # Linux: die with the server, even mid-compile
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = GrammarCompiler(GrammarTokenizer(info, _no_encode, tuple(stop_token_ids)),
                               CompilerConfig(**config_fields))
    conn.send("ready")
    while True:
        try:
            kind, source = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiled = compiler.build(GrammarSpec(kind, source))
            reply = ("ok", compiled.handle.serialize_json(), compiled.compile_s, compiled.forced_spans)
        except GrammarError as err:
            reply = ("error", str(err), err.feature)
        except Exception as err:  # a bug: refuse this grammar, keep the worker
            reply = ("error", f"grammar compile failed: {type(err).__name__}: {err}", "compile")
        conn.send(reply)


def _no_encode(text: str) -> list[int]:
    raise RuntimeError("a compile worker does not tokenize")
