"""Draw the bundled JSONSchemaBench sample (the .jsonl files next to this one) from the full files.

    python latency_bench/jsonschemabench-sample/make_sample.py --source DIR [--out DIR]

DIR holds the full one-object-per-line files (Glaiveai2K.jsonl, Github_*.jsonl,
maskbench_bfcl.jsonl). Lines are copied byte for byte; nothing is reformatted. Per file (PLAN):

- a row count: the file's lines are shuffled with random.Random(SEED) and the first rows not
  over MAX_LINE_BYTES are kept, in that shuffled order; or None: every line, in file order;
- the rows named by id in PINNED are kept too (appended after the draw when it missed them).

Running it again on the same files writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 0
MAX_LINE_BYTES = 16_000  # Github_medium/hard hold schemas up to 140 KB; skip the very largest

# file -> rows to draw (None: the whole file)
PLAN = {
    # The whole file: tests/grammar/test_grammar_schema_check.py asserts GlaiveAI refusals stay
    # under 5% of 1707 (70 today, 4.1%); the refused rows cluster in the first ~800 lines, so a
    # 150-200 row sample lands anywhere from 2% to 6% depending on how it is drawn.
    "Glaiveai2K.jsonl": None,
    # Shuffled with the same seed the matcher test used on the full file, so its first 100
    # rows are the 100 tests/grammar/test_grammar_maskbench.py always checked.
    "maskbench_bfcl.jsonl": 150,
    "Github_trivial.jsonl": 150,
    "Github_easy.jsonl": 150,
    "Github_medium.jsonl": 150,
    "Github_hard.jsonl": 80,  # large schemas: fewer rows keep the sample small
}

# Rows tests/runtime/test_constrained_generation.py names by id (schemas grammar/schema/lower.py rewrites).
PINNED = {
    "Glaiveai2K.jsonl": ("calculate_area_0bc8b268", "calculate_area_00d870b6"),
    "Github_easy.jsonl": ("o12649", "o1316", "o14471"),
}


def draw(lines: list[bytes], count: int | None, pinned: tuple[str, ...] = ()) -> list[bytes]:
    """The sample's lines (see the module docstring)."""
    if count is None:
        kept = list(lines)
    else:
        order = list(range(len(lines)))
        random.Random(SEED).shuffle(order)
        kept = [lines[i] for i in order if len(lines[i]) <= MAX_LINE_BYTES][:count]
    have = {json.loads(line)["id"] for line in kept}
    missing = [i for i in pinned if i not in have]
    by_id = {json.loads(line)["id"]: line for line in lines} if missing else {}
    for row_id in missing:
        if row_id not in by_id:
            raise SystemExit(f"pinned row {row_id} is not in the source file")
        kept.append(by_id[row_id])
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="folder with the full JSONSchemaBench files")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent),
                        help="where the sample goes (default: this folder, the bundled one)")
    args = parser.parse_args(argv)
    source, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, count in PLAN.items():
        lines = [line for line in (source / name).read_bytes().splitlines() if line.strip()]
        kept = draw(lines, count, PINNED.get(name, ()))
        (out / name).write_bytes(b"".join(line + b"\n" for line in kept))
        print(f"{name}: {len(kept)} of {len(lines)} rows, {sum(len(k) + 1 for k in kept)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
