"""A/B step time of two checkouts on identical work, interleaved: the DPO benchmark (sigmoid loss,
cached reference) and the GRPO benchmark (one generation per step), each in fresh processes.

    git worktree add /tmp/baseline 4cbaf23          # the code to compare against
    git worktree add /tmp/candidate HEAD            # a frozen copy of this checkout
    .venv/bin/python benchmarks/ab.py /tmp/baseline /tmp/candidate --rounds 3

Each round runs every benchmark in both trees, alternating which tree goes first (A B, then B A),
so slow drift of the machine's load falls on both. Each tree runs its own ``benchmarks/*.py``
with its own packages first on ``PYTHONPATH``. Reported: the per-round figures and the median of
the per-round ratios candidate / baseline (below 1: the candidate is faster).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

# name -> (command, pattern of the figure on its output: seconds per optimizer step). A command
# runs the tree's own script, or, marked CANDIDATE_SCRIPT, the candidate's script on the tree's code
# (for options the baseline's script does not have yet; the trainer API it calls is the same).
CANDIDATE_SCRIPT = "candidate:"
BENCHMARKS = {
    "DPO step CPU s (sigmoid, cached, 35.7M Llama, 4 pairs)": (
        ["benchmarks/dpo.py", "--steps", "4"],
        r"\| cached \| [0-9.]+ \| ([0-9.]+) \|",
    ),
    "GRPO step wall s (tiny Llama, 16 × 8 completions per step)": (
        ["benchmarks/grpo.py", "--steps-per-generation", "1", "--repeats", "1", "--threads", "1"],
        r"\| 1 \| \d+ \| \d+ \| ([0-9.]+) \|",
    ),
    "GRPO step wall s (tiny Llama with a 32,000-token vocabulary, 16 × 8 completions per step)": (
        [
            CANDIDATE_SCRIPT + "benchmarks/grpo.py",
            *("--steps-per-generation", "1", "--repeats", "1", "--threads", "1", "--vocab-size", "32000"),
        ],
        r"\| 1 \| \d+ \| \d+ \| ([0-9.]+) \|",
    ),
}


def measure(tree: Path, command: list[str], pattern: str, candidate: Path) -> float:
    environment = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    script = command[0]
    if script.startswith(CANDIDATE_SCRIPT):
        command = [str(candidate / script.removeprefix(CANDIDATE_SCRIPT)), *command[1:]]
    result = subprocess.run(
        [sys.executable, *command], cwd=tree, env=environment, capture_output=True, text=True, check=True
    )
    match = re.search(pattern, result.stdout)
    if match is None:
        raise RuntimeError(f"{tree}: {' '.join(command)} printed no figure:\n{result.stdout[-2000:]}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("candidate", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="run only the benchmarks whose name contains this text, e.g. 32,000")
    options = parser.parse_args()
    trees = {"baseline": options.baseline.resolve(), "candidate": options.candidate.resolve()}
    print(f"baseline {trees['baseline']}, candidate {trees['candidate']}, {options.rounds} rounds, 1 thread")
    for name, (command, pattern) in BENCHMARKS.items():
        if options.only and options.only not in name:
            continue
        rows = []
        for round_index in range(options.rounds):
            order = ["baseline", "candidate"] if round_index % 2 == 0 else ["candidate", "baseline"]
            figures = {label: measure(trees[label], command, pattern, trees["candidate"]) for label in order}
            rows.append(figures)
            print(f"{name}, round {round_index + 1}: {figures}", flush=True)
        ratios = [row["candidate"] / row["baseline"] for row in rows]
        print(f"| {name} | {' / '.join(f'{r:.3f}' for r in ratios)} | median {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
