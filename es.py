"""es.py — Evolution Strategies fine-tuning of an LLM on a verifiable reasoning task, in one file.

The update ([ES-LLM] §2, [Qiu] Alg. 1, the shared-seed trick of [OpenAI-ES] Alg. 2). Per iteration t:

    s_n = seed(run seed, t, n)                       n = 1..N; noise is never stored, only regenerated from s_n
    R_n = mean_x reward(θ + σ·ε_n, x)                the same prompts x for every member, greedy decoding
    Z_n = (R_n − mean(R)) / (std(R) + 1e-8)          population z-score (ddof 0); std(R) = 0 → no update
    θ  ← θ + α · (1/N) · Σ_n Z_n · ε_n              no 1/σ: [Qiu] folds it into α; Σ accumulated in fp32

Deviations from the reference code ([Qiu], VsonicV/es-fine-tuning-paper), and why:
  1. ε is i.i.d. across tensors: each tensor's generator is seeded from (s_n, hash(tensor name)). The reference
     seeds every tensor with s_n, so equal-shaped tensors (every q_proj, say) receive identical noise.
  2. An fp32 master copy of θ. Member n is cast(master + σ·ε_n) and the restore copies the master back, bit-exact in
     fp32/bf16/fp16. The reference adds then subtracts the noise in bf16, a random drift per member about as large
     as the real update.
  3. The update is accumulated and applied in fp32 on the master, then cast once (in bf16 ~35% of the update's
     elements would round away).
  4. Rewards score the completion only; the reference HF code scored prompt + completion (inflated format reward).
Defaults follow the [ES-LLM] authors' artifact (GSM8K, Qwen2.5-1.5B-Instruct): N=32, σ=1.5e-3, α=2.5e-4, 64 prompts
per iteration, 2 epochs in epoch-wise shuffled order, greedy rollouts of ≤ 2048 tokens. The task default is [Qiu]'s
Countdown. Options beyond both papers, off by default: antithetic ±ε pairs ([ES-LLM] found no gain) and anchored
weight decay θ ← θ₀ + (1 − αλ)(θ − θ₀) ([AWD]). The JS diversity and coverage are logged for greedy rollouts only:
they need p_i(x) ∈ {0, 1}, which one sampled completion per (member, prompt) does not give.

Reproducibility: every seed derives from --seed. On CPU a run is bitwise reproducible and `--resume` continues to
exactly the weights of an uninterrupted run; GPU kernels (and vLLM batching) are only statistically reproducible.

Run it:
  CPU, the embedded SmolLM2-135M-Instruct on small sums (the README's Quickstart, ~10 min on 2 cores):
    python es.py --task arith --chat-template --pop 8 --prompts-per-iter 8 --max-new-tokens 24 --sigma 5e-3 \
        --alpha 5e-3 --iterations 6 --eval-every 3 --eval-prompts 64
  GPU, the [ES-LLM] artifact's GSM8K protocol (234 iterations; data from the hub or a folder, see README):
    python es.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --chat-template --backend vllm --out-dir runs/es-gsm8k
  GPU, [Qiu]'s Countdown settings:
    python es.py --model Qwen/Qwen2.5-1.5B-Instruct --pop 30 --sigma 1e-3 --alpha 5e-4 --train-size 200 \
        --prompts-per-iter 200 --iterations 500 --max-new-tokens 1024 --prompt-order random
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
from tqdm import tqdm

from common import (EMBEDDED_MODEL, HFPolicy, Task, VLLMPolicy, check_run_args, cli, derive_seed, die, evaluate,
                    init_distributed, init_run, interrupted, latest_checkpoint, load_task, log_metrics, plot_curves,
                    render_prompt, require, save_checkpoint, schedule, score, truncate_metrics, uninterruptible)


@dataclass
class Args:
    model: str = EMBEDDED_MODEL
    """model: a Hugging Face folder, a hub id, or 'smollm2-135m' (embedded, offline)"""
    task: Task = "countdown"
    """task to train on (README: Tasks); countdown and arith are generated, gsm8k/math500 read --data or the hub"""
    data: Optional[str] = None
    """folder with train.jsonl/test.jsonl (or a hub dataset id); default: generated or the task's hub dataset"""
    chat_template: bool = False
    """render prompts with the tokenizer's chat template instead of raw text"""
    seed: int = 0
    """run seed: member seeds, prompt order and sampling all derive from it"""
    out_dir: str = "runs/es"
    """run directory: args.json, metrics.jsonl, curves.png, checkpoints/"""
    backend: Literal["hf", "vllm"] = "hf"
    """rollout backend: Hugging Face generate, or a vLLM engine perturbed inside its worker (needs vllm)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype; auto = bf16 on GPU, fp32 on CPU (the master is always fp32)"""
    resume: Optional[str] = None
    """continue the run in this directory from its last checkpoint (its args.json, plus the flags passed here)"""
    eval_every: int = 25
    """evaluate the center θ on held-out problems every this many iterations, before the first and after the last
    (≥ 0; 0 = never)"""
    eval_prompts: int = 200
    """number of held-out test problems per evaluation (≥ 1)"""
    save_every: int = 50
    """write a checkpoint every this many iterations, at every epoch's end, at the end and on Ctrl-C (≥ 0; 0 = only
    at epoch ends and at the end)"""
    max_new_tokens: int = 2048
    """generation budget per completion (≥ 1; [ES-LLM] artifact: 2048, [Qiu]: 1024)"""
    batch_size: int = 64
    """sequences per generate call (≥ 1)"""
    vllm_memory: float = 0.7
    """--backend vllm: the engine's share of GPU memory, in (0, 1] ([ES-LLM] artifact: 0.7); the worker's fp32 master,
    θ₀ and staging copy live outside it"""
    epochs: int = 2
    """passes over the training set when --iterations is unset (≥ 1; [ES-LLM] artifact: 2 = 234 iterations on GSM8K)"""
    iterations: Optional[int] = None
    """ES iterations T (≥ 1); default: epochs × ⌈train size / prompts-per-iter⌉"""
    prompt_order: Literal["epoch", "random"] = "epoch"
    """epoch: a fresh shuffle of the training set per epoch, in contiguous batches ([ES-LLM] artifact); random: an
    independent sample every iteration"""
    pop: int = 32
    """population size N (≥ 2)"""
    sigma: float = 1.5e-3
    """noise scale σ (> 0)"""
    alpha: float = 2.5e-4
    """step size α (> 0; no 1/σ factor)"""
    prompts_per_iter: int = 64
    """prompts per iteration (≥ 1), the same for every member; all of them if ≥ the training set"""
    train_size: Optional[int] = None
    """use only the first this many training problems (≥ 1; [Qiu]: 200)"""
    temperature: float = 0.0
    """rollout temperature (≥ 0); 0 = greedy (all exploration is in parameter space)"""
    antithetic: bool = False
    """mirrored pairs +ε/−ε (N must be even)"""
    awd_lambda: float = 0.0
    """anchored weight decay λ after each update (≥ 0, α·λ ≤ 1; 0 = off; [AWD] uses 10)"""
    master_device: Optional[str] = None
    """where the fp32 master and θ₀ live ('cpu' saves GPU memory; noise is still drawn on the model's device)"""


def check_args(args: Args) -> None:
    """Every numeric flag in its range (the Args docstrings), before anything is loaded or written."""
    check_run_args(args)
    require(args.pop >= 2, f"--pop must be ≥ 2 (a z-score needs two members), got {args.pop}")
    require(not args.antithetic or args.pop % 2 == 0, f"--antithetic needs an even --pop, got {args.pop}")
    for flag in ("sigma", "alpha"):
        value = getattr(args, flag)
        require(value > 0 and math.isfinite(value), f"--{flag} must be a finite number > 0, got {value}")
    require(args.iterations is None or args.iterations >= 1, f"--iterations must be ≥ 1, got {args.iterations}")
    require(args.prompts_per_iter >= 1, f"--prompts-per-iter must be ≥ 1, got {args.prompts_per_iter}")
    require(args.temperature >= 0, f"--temperature must be ≥ 0, got {args.temperature}")
    require(0 <= args.alpha * args.awd_lambda <= 1, f"--awd-lambda must be in [0, 1/α], got {args.awd_lambda}")


def member_seeds(seed: int, t: int, pop: int, antithetic: bool) -> tuple[list[int], np.ndarray]:
    """Seeds s_n and signs: member n is θ + sign_n·σ·ε(s_n). Antithetic pairs share a seed with opposite signs."""
    if not antithetic:
        return [derive_seed(seed, "member", t, n) for n in range(pop)], np.ones(pop)
    return [derive_seed(seed, "member", t, n // 2) for n in range(pop)], np.array([1.0, -1.0] * (pop // 2))


def js_diversity(correct: np.ndarray) -> tuple[float, float]:
    """Verifier-projected Jensen–Shannon diversity (bits) and population coverage ([ES-LLM] §3.1).

    correct: (N, P) success probabilities p_i(x) (0/1 under greedy decoding).
    JS_succ(x) = h(mean_i p_i(x)) − mean_i h(p_i(x)); coverage P_pop(x) = 1 − Π_i (1 − p_i(x)); both averaged over x.
    """
    def h(p: np.ndarray) -> np.ndarray:  # binary entropy in bits, h(0) = h(1) = 0
        p = np.clip(p, 1e-12, 1 - 1e-12)
        return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))

    js = h(correct.mean(0)) - h(correct).mean(0)  # (P,)
    coverage = 1 - np.prod(1 - correct, axis=0)  # (P,)
    return float(js.mean()), float(coverage.mean())


def zscore(rewards: np.ndarray) -> np.ndarray:
    """Z_n = (R_n − mean R) / (std R + 1e-8), population std (ddof 0)."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)


RewardFn = Callable[[int, str], tuple[float, bool]]
"""(prompt index, completion text) -> (reward, correct)."""


def evaluate_population(policy: HFPolicy, prompts: list[str], reward_fn: RewardFn, seeds: list[int],
                        signs: np.ndarray, args: Args, t: int, rank: int = 0,
                        world: int = 1) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Rewards and correctness (N, P) of every member on the same prompts; restores θ after each member.

    Under torchrun, process `rank` evaluates members n ≡ rank (mod world) and the (N, P) results are summed across
    processes: each row is non-zero on exactly one process, so the sum is exact and every process gets all rows.
    """
    rewards, correct = np.zeros((len(seeds), len(prompts))), np.zeros((len(seeds), len(prompts)))
    times, tokens = {"perturb": 0.0, "rollout": 0.0}, 0
    for n in range(rank, len(seeds), world):
        s, sign = seeds[n], signs[n]
        t0 = time.perf_counter()
        policy.perturb(s, sign * args.sigma)  # θ_n = cast(master + sign·σ·ε_n)
        t1 = time.perf_counter()
        samples = policy.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  seed=derive_seed(args.seed, "sample", t, n))
        for x in samples:
            rewards[n, x.prompt_index], correct[n, x.prompt_index] = reward_fn(x.prompt_index, x.text)
            tokens += len(x.token_ids)
        t2 = time.perf_counter()
        policy.restore()  # exact: θ = cast(master)
        times["perturb"] += t1 - t0 + time.perf_counter() - t2
        times["rollout"] += t2 - t1
    if world > 1:  # N·P floats cross the network; the weights never do
        both = torch.from_numpy(np.stack([rewards, correct])).to(policy.device)  # NCCL reduces CUDA tensors only
        torch.distributed.all_reduce(both)
        rewards, correct = both.cpu().numpy()
    return rewards, correct, {**times, "tokens": tokens}


def es_step(policy: HFPolicy, prompts: list[str], reward_fn: RewardFn, args: Args, t: int, rank: int = 0,
            world: int = 1) -> dict[str, float]:
    """One ES iteration on these prompts: evaluate N members, z-score their rewards, update the master θ."""
    # 1. member seeds, derived from (--seed, t, n): nothing else is needed to regenerate ε_n anywhere
    seeds, signs = member_seeds(args.seed, t, args.pop, args.antithetic)

    # 2. evaluate the population: every member on the same prompts
    rewards, correct, perf = evaluate_population(policy, prompts, reward_fn, seeds, signs, args, t, rank, world)
    member_rewards = rewards.mean(1)  # R_n, (N,)
    if not np.isfinite(member_rewards).all():  # a NaN must never reach the master weights
        die(f"iteration {t + 1}: a member's reward is not finite ({member_rewards.tolist()}); θ was not updated")

    # 3. normalize: population z-score; equal rewards carry no information, so no update (and no NaN)
    skip = member_rewards.std() == 0
    z = zscore(member_rewards)

    # 4. update the fp32 master: θ ← θ + α/N · Σ_n Z_n·sign_n·ε(s_n)   (Ctrl-C waits: no half-applied update)
    t_update = time.perf_counter()
    with uninterruptible():
        update_norm = 0.0 if skip else policy.add_noise(seeds, z * signs, scale=args.alpha / args.pop)
        if args.awd_lambda > 0:  # anchored weight decay, L2 form: θ ← θ₀ + (1 − αλ)(θ − θ₀)
            policy.shrink_to_base(1 - args.alpha * args.awd_lambda)
    t_update = time.perf_counter() - t_update

    row = {"train/reward_mean": float(member_rewards.mean()), "train/reward_std": float(member_rewards.std()),
           "train/reward_max": float(member_rewards.max()), "train/accuracy": float(correct.mean()),
           "es/update_norm": update_norm, "es/skipped": int(skip), "perf/rollout_s": perf["rollout"],
           "perf/perturb_s": perf["perturb"], "perf/update_s": t_update,
           "perf/tokens_per_s": perf["tokens"] / max(perf["rollout"], 1e-9)}
    if args.temperature == 0:  # p_i(x) ∈ {0, 1} only for greedy rollouts (see the module docstring)
        row["es/js_succ_bits"], row["es/coverage"] = js_diversity(correct)
    return row


def main(args: Args) -> Path:
    check_args(args)
    rank, world = init_distributed()  # every process holds θ and derives the same seeds; rank 0 logs and saves
    train = load_task(args.task, "train", args.data)[: args.train_size]
    test = load_task(args.task, "test", args.data)[: args.eval_prompts]
    iterations = args.iterations or args.epochs * -(-len(train) // args.prompts_per_iter)
    per_epoch = -(-len(train) // args.prompts_per_iter) if args.prompt_order == "epoch" else iterations + 1
    if args.backend == "vllm":
        policy = VLLMPolicy(args.model, args.dtype, es=True, master_device=args.master_device,
                            batch_size=args.batch_size, gpu_memory=args.vllm_memory)
    else:
        policy = HFPolicy(args.model, args.dtype, es=True, master_device=args.master_device, batch_size=args.batch_size)
    run = init_run(args.out_dir, args, resume=bool(args.resume)) if rank == 0 else Path(args.out_dir)
    start = 0
    if args.resume and (ckpt := latest_checkpoint(run)) is not None:
        policy.load_master(ckpt)
        start = json.loads((ckpt / "state.json").read_text())["step"]
        if rank == 0:
            truncate_metrics(run, "iteration", start)
    prompts = [render_prompt(args.task, p, policy.tokenizer, args.chat_template) for p in train]
    say = tqdm.write if rank == 0 else lambda _: None
    size = min(args.prompts_per_iter, len(train))
    say(f"es: {iterations - start} iterations of {args.pop} members × {size} prompts × ≤ {args.max_new_tokens} new "
        f"tokens (≤ {args.pop * size * args.max_new_tokens:,} generated tokens per iteration)")

    if start == 0 and args.eval_every > 0 and rank == 0:
        log_metrics(run, {"iteration": 0, **evaluate(policy, args.task, test, args.max_new_tokens,
                                                     args.chat_template, "eval θ₀")})
    bar = tqdm(range(start, iterations), initial=start, total=iterations, desc="es", unit="it", disable=rank != 0)
    done, saved, skipped = start, latest_checkpoint(run) if rank == 0 else None, 0
    try:
        for t in bar:
            t_start = time.perf_counter()
            batch = schedule(args.seed, t, len(train), args.prompts_per_iter, args.prompt_order)
            row = {"iteration": t + 1, **es_step(policy, [prompts[i] for i in batch],
                                                 lambda i, text: score(args.task, train[batch[i]], text), args, t,
                                                 rank, world)}
            row.update({"es/d_rel": policy.drift(), "perf/iteration_s": time.perf_counter() - t_start})
            done = t + 1

            # 5. log, evaluate the center θ, checkpoint (rank 0 only: the other ranks hold the identical θ)
            if rank != 0:
                continue
            log_metrics(run, row)
            skipped = skipped + 1 if row["es/skipped"] else 0
            bar.set_postfix(reward=f"{row['train/reward_mean']:.3f}", d_rel=f"{row['es/d_rel']:.1e}",
                            **({"update": "skipped"} if skipped else {}))
            if t == start:
                say(f"iteration {done} took {row['perf/iteration_s']:.0f} s: the remaining {iterations - done} "
                    f"take about {(iterations - done) * row['perf/iteration_s'] / 60:.0f} min")
            if skipped:
                say(f"iteration {t + 1}: every member scored {row['train/reward_mean']:.3f}: no update")
            if skipped == 3:
                say("3 iterations in a row without an update: " + (
                    "no member earned any reward — try more --max-new-tokens, a larger --sigma or an easier --task "
                    "(arith)" if row["train/reward_max"] == 0 else "all members score alike — try a larger --sigma"))
            if args.eval_every > 0 and (done % args.eval_every == 0 or done == iterations):
                log_metrics(run, {"iteration": done, **evaluate(policy, args.task, test, args.max_new_tokens,
                                                                args.chat_template, f"eval θ_{done}")})
            if (args.save_every and done % args.save_every == 0) or done % per_epoch == 0 or done == iterations:
                saved = save_checkpoint(run, done, policy, {"iteration": done})
    except KeyboardInterrupt:
        bar.close()
        if rank == 0 and done > start and args.save_every and (saved is None or saved.name != f"step_{done:06d}"):
            saved = save_checkpoint(run, done, policy, {"iteration": done})
        if rank == 0 and (run / "metrics.jsonl").exists():
            plot_curves({"es": run}, run / "curves.png")
        interrupted(run, done, saved)
    bar.close()
    if rank == 0:
        plot_curves({"es": run}, run / "curves.png")
        say(f"curves: {run / 'curves.png'}; weights: {saved}")
    if args.backend == "vllm":
        policy.close()  # free its memory for whatever runs next in this process (grpo_es.py's second stage)
    if world > 1 and torch.distributed.is_initialized():  # closing a vLLM engine may already have destroyed it
        torch.distributed.destroy_process_group()
    return run


if __name__ == "__main__":
    main(cli(Args))
