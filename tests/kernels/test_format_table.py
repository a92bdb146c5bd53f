"""One-place invariants of the CPU kernel library (kernels/cpu_formats.h, cpu_runtime.h,
cpu_layer.c): the block formats are defined once, in the library's traits table, and Python reads
them from it; the 64-token small-M limit is written once; the C files use each other's symbols in
one direction only (no cycle), and headers include downward."""

from __future__ import annotations

import ast
import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch

from prescient.kernels import cpu_layer, cpu_linear
from prescient.kernels import quant_reference as qr

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ============================================================================================
# One-place invariants of the library (kernels/cpu_formats.h, cpu_runtime.h, cpu_layer.c)
# ============================================================================================
# * The block formats are defined once, in the library's traits table (kernels/cpu_formats.c):
#   Python's QTYPES (codes, block sizes) is read from it, and its no-library fallback (ggml's
#   sizes from the gguf package) agrees with it.
# * The 64-token small-M limit is written once (PL_MAX_T in kernels/cpu_layer.c): the library,
#   kernels/cpu_layer.MAX_T and runtime/linear.BATCH_INVARIANT_M report the same value, and no
#   Python module assigns it from a literal again.
# * The C files of the .so use each other's symbols in one direction only: the graph "A uses a
#   function defined in B" has no cycle, and follows the layer order of cpu_linear._SOURCE_NAMES
#   (runtime at the bottom, then kernels, the format table, the dispatcher, the fused layer).

_KDIR = os.path.join(REPO, "kernels")


def _built_lib():
    lib = cpu_linear.library()
    if lib is None:
        pytest.skip("the C library cannot be built here")
    return lib


# ---- formats -----------------------------------------------------------------------------------

def _table(lib) -> dict[str, tuple[int, int, int]]:
    lib.pf_name.restype = ctypes.c_char_p
    for fn in (lib.pf_name, lib.pf_code, lib.pf_block_elems, lib.pf_block_bytes):
        fn.argtypes = [ctypes.c_int]
    rows = {}
    for i in range(lib.pf_count()):
        name = lib.pf_name(i)
        if name:
            rows[name.decode()] = (lib.pf_code(i), lib.pf_block_elems(i), lib.pf_block_bytes(i))
    return rows


def test_python_formats_are_the_library_table():
    lib = _built_lib()
    table = _table(lib)
    assert dict(qr.QTYPES) == table and qr.QTYPES.source == "library"
    lib.pq_supported.argtypes = [ctypes.c_int]
    for name, (code, be, bb) in table.items():
        assert code >= 16 and lib.pq_supported(code) == 1, name
        assert bb > 0 and be in (32, 256), name
    assert len({code for code, _, _ in table.values()}) == len(table)  # codes are unique
    from prescient.kernels import quant_reference_k as R
    assert R.BLOCK_BYTES == {q: table[q][2] for q in qr.K_FORMATS}
    assert R.DT_CODES == {q: table[q][0] for q in qr.K_FORMATS}


def test_no_library_fallback_agrees_with_the_table():
    """The fallback (used only without a compiler) has the library's formats and sizes."""
    table = _table(_built_lib())
    fallback = qr._fallback_rows()
    assert set(fallback) == set(table)
    assert {q: v[1:] for q, v in fallback.items()} == {q: v[1:] for q, v in table.items()}


def test_dequantize_rejects_a_format_it_does_not_implement(monkeypatch):
    """A table format without a reference dequantizer raises; it is never decoded as Q4_1."""
    rows = dict(qr.QTYPES)
    rows["q5_0"] = (99, 32, 22)
    monkeypatch.setattr(qr.QTYPES, "_rows", rows)
    with pytest.raises(ValueError, match="no reference dequantizer"):
        qr.dequantize(torch.zeros(2, 22, dtype=torch.uint8), "q5_0", 2, 32)
    with pytest.raises(ValueError, match="unknown qtype"):
        qr.dequantize(torch.zeros(2, 22, dtype=torch.uint8), "q9_9", 2, 32)


def test_c_block_structs_are_checked_against_ggml():
    """Every block struct of cpu_formats.h has a compile-time size check."""
    src = open(os.path.join(_KDIR, "cpu_formats.h")).read()
    structs = set(re.findall(r"\}\s*(block_\w+);", src))
    asserted = set(re.findall(r"_Static_assert\(sizeof\((block_\w+)\) == \d+", src))
    assert structs and structs == asserted


# ---- the small-M limit -------------------------------------------------------------------------

def test_small_m_limits_have_one_definition_each():
    """Two limits, each written once in C and read from the library: the GEMV kernels' rows per
    call (PG_MAX_M, runtime/linear.py's BATCH_INVARIANT_M) and the fused layers' tokens per call
    (PL_MAX_T, cpu_layer.MAX_T)."""
    from prescient.runtime.linear import BATCH_INVARIANT_M

    lib = _built_lib()
    lib.pl_max_tokens.restype = lib.pg_max_m.restype = ctypes.c_int
    assert lib.pl_max_tokens() == cpu_layer.MAX_T
    assert lib.pg_max_m() == cpu_linear.MAX_M == BATCH_INVARIANT_M
    for limit, name, pattern in ((cpu_layer.MAX_T, ("cpu_layer.c", "PL_MAX_T"), r"MAX_T|MAX_TOKENS"),
                                 (cpu_linear.MAX_M, ("cpu_runtime.h", "PG_MAX_M"), r"MAX_M|BATCH_INVARIANT_M")):
        # the C definition, once (a limit by name: tile sizes such as PA_MAX_ROWS are others)
        defs = []
        for f in os.listdir(_KDIR):
            if f.endswith((".c", ".h")):
                src = open(os.path.join(_KDIR, f)).read()
                defs += [(f, n) for n, v in re.findall(rf"^#define (\w*(?:{pattern}))\s+(\d+)", src, re.M)
                         if int(v) == limit]
        assert defs == [name]
        # no Python module binds a name to a literal copy of it
        for rel in ("runtime/linear.py", "kernels/cpu_layer.py", "kernels/quant_linear.py", "kernels/cpu_linear.py"):
            tree = ast.parse(open(os.path.join(REPO, rel)).read())
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                    names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                             if isinstance(t, ast.Name)]
                    assert node.value.value != limit, f"{rel}: {names} = {node.value.value}"


# ---- the C files' symbol graph -----------------------------------------------------------------

def _strip_attributes(code: str) -> str:
    """Remove __attribute__((...)) (balanced parentheses) so that declarations parse simply."""
    out, i = [], 0
    while True:
        j = code.find("__attribute__", i)
        if j < 0:
            out.append(code[i:])
            return "".join(out)
        out.append(code[i:j])
        k = code.index("(", j)
        depth = 0
        while True:
            depth += {"(": 1, ")": -1}.get(code[k], 0)
            k += 1
            if depth == 0:
                break
        i = k


def _own_code(path: str) -> tuple[str, str]:
    """The preprocessed text of a kernel source (macros expanded): (the lines of the file
    itself, the lines of the kernel headers it includes); system headers are left out."""
    cc = cpu_linear._compiler()
    res = subprocess.run([cc, "-E", "-std=gnu11", "-I", _KDIR, path], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    where, own, headers = None, [], []
    for line in res.stdout.splitlines():
        m = re.match(r'# \d+ "([^"]+)"', line)
        if m:
            f = os.path.abspath(m.group(1))
            where = "own" if f == os.path.abspath(path) else "hdr" if os.path.dirname(f) == _KDIR else None
            continue
        if where == "own":
            own.append(line)
        elif where == "hdr":
            headers.append(line)
    return _strip_attributes("\n".join(own)), _strip_attributes("\n".join(headers))


def _bodies(code: str) -> str:
    """The text inside braces (function bodies, initialisers): what code uses, not declares."""
    out, depth = [], 0
    for ch in code:
        if ch == "}":
            depth -= 1
        if depth > 0:
            out.append(ch)
        if ch == "{":
            depth += 1
    return "".join(out)


def _definitions(code: str) -> set[str]:
    """Functions with external linkage defined at file scope (brace depth 0, not static)."""
    defs, depth, start = set(), 0, 0
    for i, ch in enumerate(code):
        if ch == "{":
            if depth == 0:
                head = code[start:i]
                m = re.search(r"\b([A-Za-z_]\w*)\s*\([^()]*\)\s*$", head)
                if m and not re.search(r"\b(static|typedef|struct|enum|union)\b|=", head):
                    defs.add(m.group(1))
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
        elif ch == ";" and depth == 0:
            start = i + 1
    return defs


@pytest.fixture(scope="module")
def c_symbol_graph():
    if cpu_linear._compiler() is None or shutil.which(cpu_linear._compiler()) is None:
        pytest.skip("no C compiler (needed to expand the sources' macros)")
    code = {p.name: _own_code(str(p)) for p in cpu_linear._SOURCES}
    defined = {name: _definitions(own) for name, (own, _) in code.items()}
    owner = {}
    for name, fns in defined.items():
        for fn in fns:
            assert fn not in owner, f"{fn} defined in {owner.get(fn)} and {name}"
            owner[fn] = name
    uses = {}
    for name, (own, headers) in code.items():
        # a use: in the file's own code (a declaration there counts: it declares to use), or in
        # the body of a header's inline function; a header's mere declarations do not
        idents = set(re.findall(r"\b[A-Za-z_]\w*\b", own + "\n" + _bodies(headers)))
        uses[name] = {owner[i] for i in idents if i in owner and owner[i] != name}
    return defined, uses


def test_symbol_graph_is_the_documented_layering(c_symbol_graph):
    defined, uses = c_symbol_graph
    assert "pg_parallel_for" in defined["cpu_runtime.c"] and "pg_isa" in defined["cpu_runtime.c"]
    assert "pg_linear_w" in defined["cpu_dispatch.c"] and "pq_format_of" in defined["cpu_formats.c"]
    assert uses["cpu_runtime.c"] == set()  # the bottom layer
    order = list(cpu_linear._SOURCE_NAMES)
    for f, deps in uses.items():
        later = {d for d in deps if order.index(d) > order.index(f)}
        assert not later, f"{f} uses symbols of {sorted(later)}, a layer above it"


def test_symbol_graph_has_no_cycle(c_symbol_graph):
    _, uses = c_symbol_graph
    state: dict[str, int] = {}

    def visit(f, path):
        if state.get(f) == 1:
            raise AssertionError("cycle: " + " -> ".join(path + [f]))
        if state.get(f) == 2:
            return
        state[f] = 1
        for d in sorted(uses[f]):
            visit(d, path + [f])
        state[f] = 2

    for f in uses:
        visit(f, [])


def test_include_graph_points_downward():
    """A kernel header includes only headers of its own layer or below: none of the sources'
    headers includes the dispatcher's or the fused layer's."""
    inc = {}
    for f in os.listdir(_KDIR):
        if f.endswith(".h"):
            inc[f] = set(re.findall(r'^#include "([^"]+)"', open(os.path.join(_KDIR, f)).read(), re.M))
    assert inc["cpu_runtime.h"] <= set()  # includes no kernel header
    for h, deps in inc.items():
        if h != "cpu_dispatch.h":
            assert "cpu_dispatch.h" not in deps, h
    state: dict[str, int] = {}

    def visit(h, path):
        assert state.get(h) != 1, "include cycle: " + " -> ".join(path + [h])
        if state.get(h) == 2 or h not in inc:
            return
        state[h] = 1
        for d in sorted(inc[h]):
            visit(d, path + [h])
        state[h] = 2

    for h in inc:
        visit(h, [])
