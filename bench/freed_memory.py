"""bench/freed_memory.py — CPU sampling with glibc's default malloc vs common.keep_freed_memory, side by side.

    python bench/freed_memory.py --rounds 3      # SmolLM2-135M: 8 arith prompts × n = 32 (256 rows), 24 new tokens

`HFPolicy` on a CPU calls `common.keep_freed_memory()`; the baseline skips it. The malloc setting is process-wide, so
every measurement is a fresh process, alternating default / kept for --rounds rounds. A markdown table of the medians
of one `generate` call (wall, user and kernel CPU seconds), the ratio, and whether both sides sampled the same tokens
(they must: only where memory comes from changes).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import harness  # noqa: E402
from util import emit, machine_line, table  # noqa: E402  (bench/, beside this file)


@dataclass
class Args:
    model: str = "smollm2-135m"
    rounds: int = 3
    n: int = 32
    """samples per prompt (8 prompts)"""
    max_new_tokens: int = 24
    out: str = ""
    """also write the table to this file"""
    child: str = ""
    """internal: 'default' or 'kept' runs one measurement in this process"""


def measure(args: Args) -> dict:
    if args.child == "default":
        common.keep_freed_memory = lambda: None  # HFPolicy calls it on a CPU: skip it for the baseline
    policy = common.HFPolicy(args.model, "float32", "cpu", batch_size=8 * args.n)
    problems = common.load_task("arith", "test")[:8]
    prompts = [common.render_prompt("arith", p, policy.tokenizer, chat_template=True) for p in problems]
    policy.generate(prompts[:1], n=2, max_new_tokens=2, temperature=0.6)  # warm-up
    start, times = time.perf_counter(), os.times()
    samples = policy.generate(prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=0.6, seed=0)
    end = os.times()
    tokens = hashlib.sha256(json.dumps([s.token_ids for s in samples]).encode()).hexdigest()[:12]
    return {"wall": time.perf_counter() - start, "user": end.user - times.user, "sys": end.system - times.system,
            "tokens": tokens}


def main(args: Args) -> None:
    if args.child:
        print(json.dumps(measure(args)))
        return
    results: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(args.rounds):
        for mode in results:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model, "--n", str(args.n),
                                  "--max-new-tokens", str(args.max_new_tokens)], capture_output=True, text=True)
            common.require(out.returncode == 0, f"the {mode} measurement failed:\n{out.stderr[-2000:]}")
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(mode, results[mode][-1], flush=True)
    median = {mode: {k: statistics.median(r[k] for r in rs) for k in ("wall", "user", "sys")}
              for mode, rs in results.items()}
    same = len({r["tokens"] for rs in results.values() for r in rs}) == 1
    emit([f"machine: {machine_line('cpu')}", f"{args.model}, fp32, 8 arith prompts × n = {args.n}, "
          f"{args.max_new_tokens} new tokens, temperature 0.6; medians of {args.rounds} processes a side", "",
          table(["malloc", "wall s", "user s", "kernel s"],
                [[mode, m["wall"], m["user"], m["sys"]] for mode, m in median.items()]), "",
          f"kept: {median['default']['wall'] / median['kept']['wall']:.2f}x faster; same tokens: {same}"], args.out)


if __name__ == "__main__":
    main(harness.cli(Args))
