"""bench/es_lowrank_speed.py — one ES iteration, full-rank (es.py) against low-rank (es_lowrank.py), at the Quickstart's
size and with larger low-rank populations, side by side in one run.

Each row is one iteration of es.py's or es_lowrank.py's stages 2 and 4 (evaluate the population, update the fp32
master), called as es.main calls them. Columns: the iteration's wall time; its rollout (generate), perturb (full-rank:
write θ + σε_n into the model and restore θ, per member; low-rank: draw the factors and set the hooks) and update
seconds; generated tokens per second of the whole iteration. Rollouts are greedy and fixed-length (EOS disabled):
every row generates exactly N·P·T tokens. Full-rank generates P rows per member (N generate calls); low-rank all N·P
rows in one call. Rewards are synthetic (member n gets reward n), so the update always runs: this measures
time, not learning. The prompts are the Quickstart's (arith, chat template).

Run it (CPU, the README's Quickstart size and N = 32, 64 low-rank; ~10 min on 2 cores):
  python bench/es_lowrank_speed.py
GPU:
  python bench/es_lowrank_speed.py --model random:qwen2.5-1.5b --dtype bfloat16 --prompts 64 --max-new-tokens 256 \
      --runs full:32 low:32 low:256 low:1024
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import tyro

from es_iteration import member_rewards
from util import emit, fixed_length, machine_line, resolve_bench_model, setup_threads, sync, table

import common  # noqa: E402  (util puts the repo root on sys.path)
import es  # noqa: E402
import es_lowrank  # noqa: E402


@dataclass
class Args:
    model: str = common.EMBEDDED_MODEL
    """a name common.resolve_model takes, or random:qwen2.5-0.5b / random:qwen2.5-1.5b (random-init)"""
    runs: tuple[str, ...] = ("full:8", "low:8", "low:32", "low:64")
    """iterations to time, as full:N (es.py) or low:N (es_lowrank.py), N = population size"""
    prompts: int = 8
    """prompts per member P"""
    max_new_tokens: int = 24
    """tokens per completion T (fixed: EOS disabled)"""
    rank: int = 1
    """low-rank: rank r of each member's change"""
    sigma: float = 5e-3
    """noise scale σ"""
    alpha: float = 5e-3
    """step size α"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """model dtype"""
    threads: Optional[int] = 2
    """torch CPU threads"""
    out: Optional[str] = None
    """also write the table to this file"""


def measure(policy: common.HFPolicy, prompts: list[str], run: str, args: Args) -> list:
    """One iteration of `run` (full:N or low:N), stages 2 and 4 as the scripts run them: a table row."""
    kind, pop = run.split(":")[0], int(run.split(":")[1])
    population, update = (es.evaluate_population, es.es_update) if kind == "full" else es_lowrank.stages(args.rank)
    policy.batch_size = len(prompts) * (pop if kind == "low" else 1)  # low-rank: the whole population in one call
    master = common.Master(policy.params)
    seeds, signs = es.member_seeds(0, 0, pop, False)
    sync(policy.device)
    start = time.perf_counter()
    rewards, _, perf = population(policy, master, prompts, member_rewards(len(prompts)), seeds, signs, args.sigma,
                                  args.max_new_tokens, 0.0, [0] * pop)
    sync(policy.device)
    middle = time.perf_counter()
    assert update(master, seeds, signs, rewards.mean(1), args.alpha)["es/skipped"] == 0
    sync(policy.device)
    end = time.perf_counter()
    return [f"{kind}-rank" + (f" (r={args.rank})" if kind == "low" else ""), pop,
            f"{pop}×{len(prompts)}×{args.max_new_tokens}", -(-pop * len(prompts) // policy.batch_size), end - start,
            perf["rollout_s"], perf["perturb_s"], end - middle, perf["tokens"] / (end - start), perf["tokens"]]


def main(args: Args) -> str:
    threads = setup_threads(args.threads)
    path = resolve_bench_model(args.model, Path("runs/bench-models"), None, common.EMBEDDED_MODEL)
    policy = common.HFPolicy(path, args.dtype)
    fixed_length(policy)
    problems = common.load_task("arith", "train")[: args.prompts]
    prompts = [common.render_prompt("arith", p, policy.tokenizer, chat_template=True) for p in problems]
    policy.generate(prompts[:2], max_new_tokens=2)  # warm-up: first-call allocations
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").is_file() else "?"
    lines = ["# ES iteration, full-rank vs low-rank (bench/es_lowrank_speed.py)", "",
             f"model: {args.model}, {str(policy.model.dtype).removeprefix('torch.')}, HF backend; CPU model: {cpu}; "
             f"machine: {machine_line(policy.device)}", ""]
    rows = [measure(policy, prompts, run, args) for run in args.runs]
    header = ["ES", "N", "N×P×T", "generate calls", "s / iteration", "rollout s", "perturb s", "update s",
              "tokens/s", "tokens"]
    lines += [table(header, rows), "", f"after: {machine_line(policy.device)}",
              f"command: python bench/es_lowrank_speed.py --model {args.model} --runs {' '.join(args.runs)} "
              f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --rank {args.rank} --dtype "
              f"{args.dtype} --threads {threads}"]
    return emit(lines, args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
