"""`prescient bench SUITE [options]`: latency_bench's suites, one table, one dispatcher.

    prescient bench --quick --out DIR           # no suite named: the latency suite (the default)
    prescient bench agents --quick --out DIR    # a named suite with its own options
    prescient bench list                        # the suites with their help lines (= `prescient bench --help`)
    prescient bench SUITE --help                # one suite's options

Every suite is a module of this package with an entry `cli(argv) -> int` (gpu_check's is `main`,
which also runs as a plain script on a machine without prescient installed): it parses its own
options, most of them built by `suite_parser` below (the flags several suites share, written
once), runs, and its return value is the exit status (the checks return 1 on a difference).
`python -m prescient.latency_bench.MODULE [options]` runs the same entry.

The legacy spellings, read here and nowhere else (ALIASES): a suite flag in the suite name's
place, the first argument, stands for that suite:

    --agents   the agents suite, when no count follows it; `--agents N` is the latency
               suite's option (closed-loop agents of its load phases) and stays one
    --load     the load suite
    --tp       the tp suite
    --pd-split the pd suite

Anywhere after the first argument such a flag is refused with a line saying to put it first,
as `--load` always was: no option of one suite is ever read as the name of another.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NamedTuple

from prescient.help_format import DefaultsHelpFormatter
from prescient.runtime.slo import CPU_INTERACTIVE

PROG = "prescient bench"


class Suite(NamedTuple):
    help: str  # one line, shown by `prescient bench list`
    module: str  # the module under prescient.latency_bench
    entry: str  # its function `(argv) -> exit status`
    kind: str = "bench"  # bench | check (exits non-zero on a difference) | kernel | tool


# name -> suite. The first is the default (`prescient bench` with no suite name).
SUITES: dict[str, Suite] = {
    "latency": Suite("the latency SLO report: prescient's modes (and peers) at batch 1, concurrent and under "
                     "load; JSON + Markdown + plots (the default suite)", "run", "cli"),
    "agents": Suite("the tool-calling agent loop through prescient's servers and llama.cpp's: closed loop at "
                    "N = 1 and 8, open-loop task arrivals", "agent_bench", "cli"),
    "load": Suite("closed-loop clients with cold prompts and a long-prompt injector through prescient's server "
                  "and llama.cpp's", "load_bench", "cli"),
    "pd": Suite("decode ITL while a long prompt is prefilled: the prefill/decode split against co-located "
                "engines (--server: through `prescient serve`)", "pd_bench", "cli"),
    "tp": Suite("greedy decode ms/token at TP=1 and TP=2 on the same model, interleaved", "tp_bench", "cli"),
    "startup": Suite("process start to /health (serve) and to the first token (generate), first start and warm",
                     "startup", "cli"),
    "peer-decode": Suite("prescient through its server beside llama.cpp in process: batch-1 greedy decode and "
                         "cold TTFT on the same weights",
                         "peer_decode", "cli"),
    "spec-check": Suite("batch-1 decode tok/s and the speculation speedup per workload kind, plain and "
                        "speculative interleaved", "spec_check", "cli"),
    "grammar": Suite("tool_call decode tok/s with grammar + n-gram speculation against plain decoding",
                     "grammar_check", "cli"),
    "ngram-ceiling": Suite("tokens per step the n-gram proposer could give with free verification",
                           "ngram_ceiling", "cli"),
    "model-compliance": Suite("constrained generation with the default model on JSONSchemaBench files",
                              "model_compliance", "cli"),
    "grammar-compliance": Suite("JSONSchemaBench schemas compiled and random-walked without a model; exit 1 "
                                "on an output the schema refuses", "grammar_compliance", "cli", "check"),
    "grammar-backends": Suite("xgrammar beside llguidance on JSONSchemaBench files: declared coverage, compile "
                              "p50/p99, mask time per token at batch 1 and 8", "grammar_backends", "cli"),
    "invariance": Suite("greedy output with speculation vs plain and alone vs batched, per weights format and "
                        "ISA tier; exit 1 on a difference", "invariance_check", "cli", "check"),
    "gpu-check": Suite("the GPU machine's one-shot check: GPU op tests, tree attention vs SDPA, decode, SLOs; "
                       "exit 1 on a section over its tolerance", "gpu_check", "main", "check"),
    "step-profile": Suite("where a CPU decode step's time goes: GEMV, attention, other kernels, host",
                          "step_profile", "cli", "kernel"),
    "gemv": Suite("weight-streaming GB/s of small-M CPU linears per ISA tier: F.linear vs cpu_linear",
                  "gemv_bench", "cli", "kernel"),
    "qgemv": Suite("weight-streaming GB/s of the GGUF block-format kernels per ISA tier and path, beside bf16 "
                   "and torch's quantized matmuls", "qgemv_bench", "cli", "kernel"),
    "attention": Suite("K/V read rate of the C tree attention over a step's layers at agent contexts, beside "
                       "the read floor and the compute alone", "attention_bench", "cli", "kernel"),
    "write-gguf": Suite("write BF16, F32 and Q8_0 GGUFs of the default model from its Q4_1 file",
                        "write_gguf", "cli", "tool"),
}
DEFAULT = next(iter(SUITES))

# legacy flag -> suite, valid only as the first argument (module docstring); `takes_count`: the
# flag is also an option with an integer value of the default suite, which then wins
ALIASES: dict[str, tuple[str, bool]] = {"--agents": ("agents", True), "--load": ("load", False),
                                        "--tp": ("tp", False), "--pd-split": ("pd", False)}
LISTING = ("list", "help", "-h", "--help")
KINDS = {"bench": "benchmarks", "check": "checks (exit non-zero on a difference)",
         "kernel": "kernel microbenchmarks", "tool": "tools"}


class UnknownSuite(ValueError):
    pass


def _alias(argv: list[str], i: int) -> str | None:
    """The suite that the legacy flag argv[i] stands for, or None (not one, or `--agents N`)."""
    if argv[i] not in ALIASES:
        return None
    name, takes_count = ALIASES[argv[i]]
    if takes_count and i + 1 < len(argv) and argv[i + 1].isdigit():
        return None
    return name


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """(suite name, the suite's own argv) for `prescient bench ARGV`; raises UnknownSuite with
    the line to print for a name that is not a suite or a legacy flag out of place."""
    if argv and argv[0] in SUITES:
        return argv[0], argv[1:]
    if argv and _alias(argv, 0):
        return _alias(argv, 0), argv[1:]
    if argv and not argv[0].startswith("-"):
        raise UnknownSuite(f"unknown suite {argv[0]!r}; the suites: {', '.join(SUITES)} (`{PROG} list`)")
    for i in range(1, len(argv)):
        name = _alias(argv, i)
        if name:
            raise UnknownSuite(f"{argv[i]} selects the {name} suite: put it first "
                               f"(`{PROG} {name} ...`, or `{PROG} {argv[i]} ...`)")
    return DEFAULT, argv


def entry(name: str):
    """The suite's entry function (imports its module)."""
    suite = SUITES[name]
    return getattr(importlib.import_module(f"prescient.latency_bench.{suite.module}"), suite.entry)


def listing() -> str:
    width = max(map(len, SUITES))
    lines = [f"usage: {PROG} [SUITE] [options]   ({PROG} SUITE --help: that suite's options)", "",
             f"No suite named: {DEFAULT}. Legacy spellings in the suite's place: "
             + ", ".join(f"{flag} = {name}" for flag, (name, _) in ALIASES.items())
             + " (`--agents N` stays the latency suite's agent count)."]
    for kind, title in KINDS.items():
        lines += ["", f"{title}:"]
        lines += [f"  {name:<{width}}  {s.help}" for name, s in SUITES.items() if s.kind == kind]
    return "\n".join(lines)


def dispatch(argv: list[str] | None = None) -> int:
    """`prescient bench ARGV` / `python -m prescient.latency_bench ARGV`: the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in LISTING:
        print(listing())
        return 0
    try:
        name, rest = resolve(argv)
    except UnknownSuite as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return entry(name)(rest) or 0


# ---------------------------------------------------------------- the shared flags

def _common() -> dict[str, tuple[tuple[str, ...], dict]]:
    return {
        "quick": (("--quick",), {"action": "store_true", "help": "the short run; unset = the full run"}),
        "out": (("--out",), {"default": None, "help": "report folder"}),
        "model": (("--model",), {"default": None, "help": "a .gguf file or a Hugging Face folder "
                                 "(default: SmolLM2-135M-Instruct, the default model)"}),
        "workloads": (("--workloads",), {"default": None,
                                         "help": "workloads.jsonl (default: the one bundled with the package)"}),
        "dtype": (("--dtype",), {"default": "bfloat16", "help": "activations and KV cache dtype"}),
        "weights": (("--weights",), {"default": "native", "help": "how the weight matrices are held "
                                     "(EngineSpec.weights: native, bfloat16, float32)"}),
        "reps": (("--reps",), {"type": int, "default": 3, "help": "repetitions"}),
        "ttft_slo_ms": (("--ttft-slo-ms",), {"type": float, "default": None, "help": "TTFT bound of the SLO, ms "
                                             f"(default {CPU_INTERACTIVE.ttft_s * 1e3:g}, the CPU preset)"}),
        "itl_slo_ms": (("--itl-slo-ms",), {"type": float, "default": None,
                                           "help": "bound on each request's p99 per-emission ITL, ms "
                                           f"(default {CPU_INTERACTIVE.itl_emission_p99_s * 1e3:g}, the CPU preset)"}),
        "peer_threads": (("--peer-threads",), {"type": int, "default": None,
                                               "help": "llama.cpp threads (default: all cores)"}),
        "peer_pythonpath": (("--peer-pythonpath",), {
            "default": os.environ.get("PRESCIENT_PEER_PYTHONPATH"),
            "help": "extra PYTHONPATH for llama_cpp.server's web stack when installed apart "
                    "(default: $PRESCIENT_PEER_PYTHONPATH)"}),
        "no_plots": (("--no-plots",), {"action": "store_true", "help": "write no PNG plots"}),
        "no_progress": (("--no-progress",), {"action": "store_true", "help": "no progress lines on stderr"}),
    }


class _RawDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The description as written (a module docstring's layout), the options with their defaults."""


def suite_parser(suite: str, doc: str | None, *, full_doc: bool = False, **flags) -> argparse.ArgumentParser:
    """The parser of `prescient bench SUITE`: its description is the first line of `doc` (all of
    it, layout kept, with `full_doc`), and each keyword names a shared flag to add, in order:
    True for it as it is, or a dict of add_argument keywords that replace its own (a suite's
    default or help). Every option's help ends with its default (prescient.help_format)."""
    text = (doc or "").strip("\n")
    p = argparse.ArgumentParser(prog=f"{PROG} {suite}", description=text if full_doc else text.splitlines()[0],
                                formatter_class=_RawDefaultsHelpFormatter if full_doc else DefaultsHelpFormatter)
    return add_shared(p, **flags)


def add_shared(p: argparse.ArgumentParser, **flags) -> argparse.ArgumentParser:
    """Add the named shared flags to `p`, in order (suite_parser's keywords), e.g. after a
    suite's own flags."""
    common = _common()
    unknown = set(flags) - set(common)
    if unknown:
        raise TypeError(f"no shared flag {', '.join(sorted(unknown))} (the shared: {', '.join(common)})")
    for name, over in flags.items():
        names, kwargs = common[name]
        p.add_argument(*names, **{**kwargs, **(over if isinstance(over, dict) else {})})
    return p
