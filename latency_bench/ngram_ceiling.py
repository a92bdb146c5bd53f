"""The most the n-gram proposer could give on the shared workloads, verification aside.

Generates each workload's plain greedy output with the default model, then replays it: at every
step the proposer (with a fixed draft budget, no adaptive sizing) proposes a tree from the text so
far, and the step emits the longest tree path that equals the true continuation plus one bonus
token, exactly as greedy verification would. Tokens per step here is an upper bound on the
speedup of n-gram speculation for that budget: it assumes a verify forward costs no more than a
1-token step. It separates "the proposer cannot guess this text" from "verification costs too
much".

    prescient bench ngram-ceiling --budgets 4,8,16,32,64   # = python -m prescient.latency_bench.ngram_ceiling
"""

from __future__ import annotations

import collections

from prescient.latency_bench.workloads import load_workloads
from prescient.build import EngineSpec, build_engine
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.ngram import NgramConfig, NgramProposer
from prescient.speculative.proposer import ProposalContext
from prescient.latency_bench.suites import suite_parser


def accepted_along(tree, truth: list[int]) -> int:
    """Length of the longest root path of `tree` whose tokens equal truth[0], truth[1], ..."""
    if tree is None:
        return 0
    node, depth = 0, 0
    children = tree.children
    while depth < len(truth):
        nxt = next((c for c in children[node] if tree.tokens[c] == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def replay(prompt: list[int], output: list[int], budget: int, config: NgramConfig) -> tuple[int, int]:
    """(steps, tokens) to emit `output` after its first token with n-gram trees of `budget` nodes."""
    proposer = NgramProposer(config)
    tokens, i, steps = prompt + output[:1], 1, 0
    while i < len(output):
        tree = proposer.propose([ProposalContext("replay", None, tokens, budget)])[0]
        advance = min(accepted_along(tree, output[i:]) + 1, len(output) - i)
        tokens += output[i:i + advance]
        i += advance
        steps += 1
    return steps, len(output) - 1


def cli(argv: list[str] | None = None) -> int:
    parser = suite_parser("ngram-ceiling", __doc__, dtype=True)
    parser.add_argument("--budgets", default="4,8,16,32,64", help="comma-separated draft budgets to replay")
    args = parser.parse_args(argv)
    engine = build_engine(EngineSpec(dtype=args.dtype, speculate="off"))
    runs = []
    for w in load_workloads()[0]:
        ids = engine.tokenizer.apply_chat_template(list(w.messages))
        r = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=w.max_tokens))
        while engine.has_unfinished_requests():
            engine.step()
        runs.append((w.kind, ids, list(r.output_token_ids)))
    print("tokens per step with free verification (plain greedy outputs replayed):")
    for budget in [int(b) for b in args.budgets.split(",")]:
        totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for kind, prompt, output in runs:
            steps, tokens = replay(prompt, output, budget, NgramConfig())
            totals[kind][0] += steps
            totals[kind][1] += tokens
        print(f"  budget {budget:3d}: " + ", ".join(f"{k} {t / s:.2f}" for k, (s, t) in sorted(totals.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
