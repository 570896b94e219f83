"""Did a model's greedy answers get better than the base's on the same problems? A paired comparison from the
samples.jsonl of one eval_passk.py run.

For each model m ≠ base and problem set, over its K problems x: d_x = r_m(x) − r_base(x) for the greedy reward r
(and for greedy correctness), mean d̄ = Σ d_x / K, standard error SE = std(d, ddof=1)/√K, and how many problems m
solves that the base does not ("won") and the reverse ("lost"). Pairing removes the between-problem spread, so a
change is "more than its noise" when |d̄| is a few SE; the problems are the same for every model by construction.

    python eval_passk.py --task arith --chat-template --models base=smollm2-135m \
        es=runs/quickstart/checkpoints/step_000006 --num-problems 200 --n 1 --max-new-tokens 24 --out-dir runs/qs-eval
    python bench/paired_greedy.py --run runs/qs-eval --base base
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cli, require  # noqa: E402


@dataclass
class Args:
    run: str
    """an eval_passk.py run directory (its samples.jsonl)"""
    base: str = "base"
    """the label of the model to compare against"""


def paired(before: np.ndarray, after: np.ndarray) -> tuple[float, float]:
    """Mean paired difference and its standard error (0 when K < 2)."""
    d = after - before
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def compare(rows: list[dict], base: str) -> list[dict]:
    """A result per (model ≠ base, problem set) from samples.jsonl rows that hold a greedy completion."""
    greedy = defaultdict(dict)  # (model, set) -> problem -> greedy row
    for row in rows:
        if "greedy" in row:
            greedy[row["model"], row["set"]][row["problem"]] = row["greedy"]
    out = []
    for (model, name), by_problem in greedy.items():
        if model == base:
            continue
        require((base, name) in greedy, f"no greedy rows of '{base}' on '{name}'")
        problems = sorted(set(by_problem) & set(greedy[base, name]))
        a = {key: np.array([float(greedy[base, name][x][key]) for x in problems]) for key in ("reward", "correct")}
        b = {key: np.array([float(by_problem[x][key]) for x in problems]) for key in ("reward", "correct")}
        out.append({"model": model, "set": name, "problems": len(problems),
                    **{key: (a[key].mean(), b[key].mean(), *paired(a[key], b[key])) for key in a},
                    "won": int(((b["correct"] == 1) & (a["correct"] == 0)).sum()),
                    "lost": int(((b["correct"] == 0) & (a["correct"] == 1)).sum())})
    return out


def main(args: Args) -> None:
    file = Path(args.run) / "samples.jsonl"
    require(file.is_file(), f"no samples.jsonl in '{args.run}'")
    results = compare([json.loads(line) for line in file.read_text().splitlines()], args.base)
    print(f"| model | set | K | greedy reward: {args.base} → model | Δ ± SE | greedy accuracy: {args.base} → model "
          "| Δ ± SE | won / lost |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        (ra, rb, rd, rse), (ca, cb, cd, cse) = r["reward"], r["correct"]
        print(f"| {r['model']} | {r['set']} | {r['problems']} | {ra:.3f} → {rb:.3f} | {rd:+.3f} ± {rse:.3f} "
              f"| {ca:.3f} → {cb:.3f} | {cd:+.3f} ± {cse:.3f} | {r['won']} / {r['lost']} |")


if __name__ == "__main__":
    main(cli(Args))
