"""Slow, obviously-correct oracles for the kernel ops, written independently of reference.py.

Plain Python loops over sequences, nodes and positions, so that a shared bug in the reference
and the Triton kernels (which follow the same vectorized walk) cannot hide. Also builders for
the trees, masks and paged caches the tests use, and the ISA-tier cap of the C kernels' tests.
"""

from __future__ import annotations

import math
import random

import torch


def tree_ancestors(parents: list[int]) -> torch.Tensor:  # [n, n] bool, row = node, incl. itself
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        a = node
        while a >= 0:
            anc[node, a] = True
            a = parents[a]
    return anc


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_tree(num_nodes: int, rng: random.Random, max_children: int | None = None) -> list[int]:
    """Parents of a random topologically ordered tree (node 0 = root)."""
    parents = [-1]
    for node in range(1, num_nodes):
        choices = [p for p in range(node) if max_children is None or parents.count(p) < max_children]
        parents.append(rng.choice(choices))
    return parents


def paged_layout(
    context_lens: list[int], block_size: int, num_blocks: int, rng: random.Random
) -> torch.Tensor:  # [num_seqs, max_blocks] int32, distinct shuffled blocks per sequence
    needed = [math.ceil(c / block_size) for c in context_lens]
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    assert sum(needed) <= num_blocks, "test cache too small"
    table = torch.zeros(len(context_lens), max(needed + [1]), dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    return table


def slot_of(block_table: torch.Tensor, pos: int, block_size: int) -> int:
    return int(block_table[pos // block_size]) * block_size + pos % block_size


def attention_oracle(
    q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, visible_new, scale
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float64
    """visible_new[t] = bool [q_len] of the new tokens query t sees (prefix always visible)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for i in range(len(context_lens)):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ctx = int(context_lens[i])
        prefix = ctx - (end - start)
        slots = [slot_of(block_tables[i], p, block_size) for p in range(ctx)]
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        kv_head = torch.arange(num_heads) // group  # GQA: query head h reads kv head h // group
        for t in range(start, end):
            seen = torch.cat([torch.ones(prefix, dtype=torch.bool), visible_new[t]])
            keys, values = k[seen][:, kv_head], v[seen][:, kv_head]  # [num_seen, num_heads, head_dim]
            scores = torch.einsum("nhd,hd->hn", keys, q[t].double()) * scale
            out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def greedy_oracle(draft_tokens, parents, num_nodes, target_argmax):
    accept_len, accepted, next_token = [], [], []
    for s in range(draft_tokens.shape[0]):
        n = int(num_nodes[s])
        cur, path = 0, [0]
        while True:
            kids = [c for c in range(1, n) if int(parents[s, c]) == cur]
            match = [c for c in kids if int(draft_tokens[s, c]) == int(target_argmax[s, cur])]
            if not match:
                break
            cur = match[0]
            path.append(cur)
        accept_len.append(len(path) - 1)
        accepted.append(path + [-1] * (draft_tokens.shape[1] - len(path)))
        next_token.append(int(target_argmax[s, cur]))
    return torch.tensor(accept_len), torch.tensor(accepted), torch.tensor(next_token)


def rejection_oracle(draft_tokens, parents, num_nodes, target_probs, draft_probs, uniform, noise):
    """SpecInfer's recursive rejection, one sequence and one sibling at a time (float64)."""
    accept_len, accepted, next_token = [], [], []
    for s in range(draft_tokens.shape[0]):
        n = int(num_nodes[s])
        cur, path = 0, [0]
        p = target_probs[s, 0].double()
        descended = True
        while descended:
            descended = False
            for c in [c for c in range(1, n) if int(parents[s, c]) == cur]:
                token = int(draft_tokens[s, c])
                if draft_probs is None:
                    q = torch.zeros_like(p)
                    q[token] = 1.0
                else:
                    q = draft_probs[s, c].double()
                if float(uniform[s, c]) * float(q[token]) < float(p[token]):
                    cur = c
                    path.append(c)
                    p = target_probs[s, c].double()
                    descended = True
                    break
                left = (p - q).clamp(min=0)
                p = left / left.sum() if float(left.sum()) > 0 else p
        accept_len.append(len(path) - 1)
        accepted.append(path + [-1] * (draft_tokens.shape[1] - len(path)))
        next_token.append(int((p / noise[s].double()).argmax()))
    return torch.tensor(accept_len), torch.tensor(accepted), torch.tensor(next_token)


def bitmask_oracle(logits, bitmask, indices):
    out = logits.clone()
    rows = range(bitmask.shape[0]) if indices is None else [int(i) for i in indices]
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    for i, row in enumerate(rows):
        for tok in range(covered):
            if not (int(bitmask[i, tok // 32]) >> (tok % 32)) & 1:
                out[row, tok] = float("-inf")
    return out


def run_at_tier(tier: str) -> None:
    """Cap the C library at ISA `tier` (a name of cpu_linear.ISA_TIERS) for the calling test;
    skip a tier this CPU cannot run. The caller's fixture restores the cap (_set_isa_cap(99))."""
    import pytest

    from prescient.kernels import cpu_linear

    if tier not in cpu_linear.machine_tiers():
        pytest.skip(f"this CPU cannot run the {tier} tier")
    assert cpu_linear._set_isa_cap(tier) == tier


def aarch64_cross_tools() -> tuple[str | None, str | None, str | None]:
    """(aarch64 C compiler, qemu-aarch64, None), or (None, None, why not): what the aarch64 kernel
    tests need to build for Arm and run the result here."""
    import os
    import shutil

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        return None, None, ("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install "
                            "gcc-aarch64-linux-gnu qemu-user)")
    if not os.path.isdir("/usr/aarch64-linux-gnu/lib"):
        return None, None, "no aarch64 sysroot at /usr/aarch64-linux-gnu"
    return cc, qemu, None


def build_aarch64_library(cc: str, out) -> None:
    """The whole kernel library cross-built for aarch64 at `out` with cpu_linear's own portable
    flags (no -march=native for another ISA) and sources: what an Arm user's first import builds."""
    import subprocess

    from prescient.kernels import cpu_linear

    flags = cpu_linear._flag_sets()[1]
    assert "-march=native" not in flags and "-Werror=implicit-function-declaration" in flags
    build = subprocess.run([cc, *flags, "-o", str(out), *map(str, cpu_linear._SOURCES), "-lm"],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]


def run_c_driver(cc: str, driver: str, so, exe, qemu: str | None = None) -> tuple[str, int, int, str]:
    """Link the C test driver `driver` against the kernel library `so` (ld refuses a library with
    undefined symbols) and run it, under qemu-aarch64 (every symbol bound at start) when given.
    Returns (which kernels it checked, cases, failed, its output) from its last line,
    "<name>: <which>, N cases, F failed"."""
    import os
    import subprocess

    kdir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
    link = subprocess.run([cc, "-O2", "-std=gnu11", "-Wall", "-Werror", "-I", kdir, "-o", str(exe), driver, str(so),
                           "-lm"], capture_output=True, text=True, timeout=300)
    assert link.returncode == 0, link.stderr[-3000:]
    cmd = [qemu, "-L", "/usr/aarch64-linux-gnu", str(exe)] if qemu else [str(exe)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "LD_BIND_NOW": "1"})
    out = run.stdout[-3000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    name = os.path.splitext(os.path.basename(driver))[0] + ": "
    assert last.startswith(name), out
    which, cases, failed = last[len(name):].split(", ")
    failed_n = int(failed.split()[0])
    assert (run.returncode == 0) == (failed_n == 0), out
    return which, int(cases.split()[0]), failed_n, out


def native_driver_tools() -> tuple[str, str]:
    """(the host's C compiler, the loaded kernel library) for a C test driver, or skip."""
    import os
    import shutil

    import pytest

    from prescient.kernels import cpu_linear

    cc = shutil.which(os.environ.get("CC", "")) or shutil.which("gcc") or shutil.which("cc")
    so = cpu_linear.kernel_info()["so"]
    if cc is None or so is None:
        pytest.skip("needs a C compiler and the compiled kernels")
    return cc, so
