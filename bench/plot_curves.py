"""Training curves of es.py / grpo.py / grpo_es.py runs side by side, from their metrics.jsonl.

One PNG with three panels over updates (ES iteration, GRPO step, or grpo_es.py's global update):
train reward (ES: mean over the population's members; GRPO: mean over sampled completions), greedy test accuracy
(the runs' --eval-every rows), and ES's JS_succ diversity ([ES-LLM] §3.1, bits). Prints a markdown table of the
first/last values, the population study's "final train reward".

    python bench/plot_curves.py --runs es=runs/es grpo=runs/grpo --out runs/curves.png
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import die  # noqa: E402

PANELS = (("train/reward_mean", "train reward"), ("eval/accuracy", "greedy test accuracy"),
          ("es/js_succ_bits", "JS_succ diversity (bits)"))


@dataclass
class Args:
    runs: tuple[str, ...]
    """runs as label=RUN_DIR (each holding metrics.jsonl)"""
    out: str = "curves.png"
    """output PNG; the markdown table is printed"""


def load_curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metric → [(update, value)] for every metric in PANELS that the run logged."""
    file = run / "metrics.jsonl"
    if not file.is_file():
        die(f"no metrics.jsonl in '{run}'")
    curves: dict[str, list[tuple[int, float]]] = {key: [] for key, _ in PANELS}
    for line in file.read_text().splitlines():
        row = json.loads(line)
        update = row.get("update", row.get("iteration", row.get("step")))  # grpo_es.py, es.py, grpo.py
        for key in curves:
            if key in row:
                curves[key].append((update, row[key]))
    return curves


def main(args: Args) -> None:
    runs = {}
    for spec in args.runs:
        label, _, path = spec.partition("=")
        runs[label] = load_curves(Path(path or label))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    print("| run | " + " | ".join(f"{name} (first → last)" for _, name in PANELS) + " |")
    print("|---" * (len(PANELS) + 1) + "|")
    for i, (label, curves) in enumerate(runs.items()):
        color = f"C{i % 10}"  # one colour per run in every panel (a run may lack a panel's metric, e.g. GRPO's JS)
        cells = []
        for ax, (key, name) in zip(axes, PANELS):
            points = curves[key]
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, color=color, label=label)
            cells.append(f"{points[0][1]:.3f} → {points[-1][1]:.3f}" if points else "–")
            ax.set(title=name, xlabel="update")
        print(f"| {label} | " + " | ".join(cells) + " |")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
