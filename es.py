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
  5. Defaults are [ES-LLM]'s (N=32, σ=1.5e-3, α=2.5e-4, 64 sampled prompts per iteration). [Qiu]'s are a flag set
     away (below). Options beyond both papers, off by default: antithetic ±ε pairs ([ES-LLM] found no gain) and
     anchored weight decay θ ← θ₀ + (1 − αλ)(θ − θ₀) ([AWD]).

Reproducibility: every seed derives from --seed. On CPU a run is bitwise reproducible and `--resume` continues to
exactly the weights of an uninterrupted run; GPU kernels (and vLLM batching) are only statistically reproducible.

Run it:
  CPU, embedded SmolLM2-135M-Instruct, a few minutes:
    python es.py --pop 4 --prompts-per-iter 8 --max-new-tokens 64 --iterations 3 --eval-every 3 --eval-prompts 8
  GPU, [ES-LLM] GSM8K settings (data from a folder with train.jsonl/test.jsonl):
    python es.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --data data/gsm8k --chat-template
  GPU, [Qiu] Countdown settings:
    python es.py --model Qwen/Qwen2.5-1.5B-Instruct --pop 30 --sigma 1e-3 --alpha 5e-4 --train-size 200 \
        --prompts-per-iter 200 --iterations 500
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import tyro
from tqdm import tqdm

from common import (EMBEDDED_MODEL, HFPolicy, Task, VLLMPolicy, derive_seed, die, evaluate, init_distributed,
                    init_run, latest_checkpoint, load_task, log_metrics, render_prompt, resume_args, save_checkpoint,
                    score, truncate_metrics)


@dataclass
class Args:
    model: str = EMBEDDED_MODEL
    """model: a Hugging Face folder, a hub id, or 'smollm2-135m' (embedded, offline)"""
    task: Task = "countdown"
    """task to train on (SPEC §6)"""
    data: Optional[str] = None
    """folder with train.jsonl/test.jsonl (or a hub dataset id); Countdown is generated when unset"""
    chat_template: bool = False
    """render prompts with the tokenizer's chat template instead of the raw [Qiu] prompt"""
    seed: int = 0
    """run seed: member seeds, prompt batches and sampling all derive from it"""
    out_dir: str = "runs/es"
    """run directory: args.json, metrics.jsonl, checkpoints/"""
    backend: Literal["hf", "vllm"] = "hf"
    """rollout backend: Hugging Face generate, or a vLLM engine perturbed inside its worker (needs vllm)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype; auto = bf16 on GPU, fp32 on CPU (the master is always fp32)"""
    resume: Optional[str] = None
    """continue the run in this directory from its last checkpoint (its args.json, plus flags you change here)"""
    eval_every: int = 25
    """evaluate the center θ on held-out problems every this many iterations (and before the first)"""
    eval_prompts: int = 200
    """number of held-out test problems per evaluation"""
    save_every: int = 50
    """write a checkpoint every this many iterations (and at the end)"""
    max_new_tokens: int = 1024
    """generation budget per completion"""
    batch_size: int = 64
    """sequences per generate call"""
    iterations: int = 500
    """ES iterations T"""
    pop: int = 32
    """population size N"""
    sigma: float = 1.5e-3
    """noise scale σ"""
    alpha: float = 2.5e-4
    """step size α (no 1/σ factor)"""
    prompts_per_iter: int = 64
    """prompts per iteration, sampled from the training set; all of them if ≥ its size"""
    train_size: Optional[int] = None
    """use only the first this many training problems ([Qiu]: 200)"""
    temperature: float = 0.0
    """rollout temperature; 0 = greedy (all exploration is in parameter space)"""
    antithetic: bool = False
    """mirrored pairs +ε/−ε (N must be even)"""
    awd_lambda: float = 0.0
    """anchored weight decay λ after each update; 0 = off ([AWD] uses 10)"""
    master_device: Optional[str] = None
    """where the fp32 master and θ₀ live ('cpu' saves GPU memory); default: the model's device"""


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
        both = torch.from_numpy(np.stack([rewards, correct]))
        torch.distributed.all_reduce(both)
        rewards, correct = both.numpy()
    return rewards, correct, {**times, "tokens": tokens}


def es_step(policy: HFPolicy, prompts: list[str], reward_fn: RewardFn, args: Args, t: int, rank: int = 0,
            world: int = 1) -> dict[str, float]:
    """One ES iteration on these prompts: evaluate N members, z-score their rewards, update the master θ."""
    # 1. member seeds, derived from (--seed, t, n): nothing else is needed to regenerate ε_n anywhere
    seeds, signs = member_seeds(args.seed, t, args.pop, args.antithetic)

    # 2. evaluate the population: every member on the same prompts
    rewards, correct, perf = evaluate_population(policy, prompts, reward_fn, seeds, signs, args, t, rank, world)
    member_rewards = rewards.mean(1)  # R_n, (N,)

    # 3. normalize: population z-score; equal rewards carry no information, so no update (and no NaN)
    skip = member_rewards.std() == 0
    z = zscore(member_rewards)

    # 4. update the fp32 master: θ ← θ + α/N · Σ_n Z_n·sign_n·ε(s_n)
    t_update = time.perf_counter()
    update_norm = 0.0 if skip else policy.add_noise(seeds, z * signs, scale=args.alpha / args.pop)
    if args.awd_lambda > 0:  # anchored weight decay, L2 form: θ ← θ₀ + (1 − αλ)(θ − θ₀)
        policy.shrink_to_base(1 - args.alpha * args.awd_lambda)
    t_update = time.perf_counter() - t_update

    js, coverage = js_diversity(correct)
    return {"train/reward_mean": float(member_rewards.mean()), "train/reward_std": float(member_rewards.std()),
            "train/reward_max": float(member_rewards.max()), "train/accuracy": float(correct.mean()),
            "es/js_succ_bits": js, "es/coverage": coverage, "es/update_norm": update_norm, "es/skipped": int(skip),
            "perf/rollout_s": perf["rollout"], "perf/perturb_s": perf["perturb"], "perf/update_s": t_update,
            "perf/tokens_per_s": perf["tokens"] / max(perf["rollout"], 1e-9)}


def main(args: Args) -> Path:
    rank, world = init_distributed()  # every process holds θ and derives the same seeds; rank 0 logs and saves
    if args.resume:
        args = resume_args(args)
    if args.antithetic and args.pop % 2:
        die(f"--antithetic needs an even --pop, got {args.pop}")
    train = load_task(args.task, "train", args.data)[: args.train_size]
    test = load_task(args.task, "test", args.data)[: args.eval_prompts]
    backend = VLLMPolicy if args.backend == "vllm" else HFPolicy
    policy = backend(args.model, args.dtype, es=True, master_device=args.master_device, batch_size=args.batch_size)
    run = init_run(args.out_dir, args, resume=bool(args.resume)) if rank == 0 else Path(args.out_dir)
    start = 0
    if args.resume and (ckpt := latest_checkpoint(run)) is not None:
        policy.load_master(ckpt)
        start = json.loads((ckpt / "state.json").read_text())["step"]
        if rank == 0:
            truncate_metrics(run, "iteration", start)
    prompts = [render_prompt(args.task, p, policy.tokenizer, args.chat_template) for p in train]

    if start == 0 and args.eval_every > 0 and rank == 0:
        log_metrics(run, {"iteration": 0, **evaluate(policy, args.task, test, args.max_new_tokens,
                                                     args.chat_template)})
    bar = tqdm(range(start, args.iterations), initial=start, total=args.iterations, desc="es", unit="it",
               disable=rank != 0)
    for t in bar:
        t_start = time.perf_counter()
        # this iteration's prompts, sampled without replacement (derived from --seed and t)
        rng = np.random.default_rng(derive_seed(args.seed, "prompts", t))
        batch = rng.choice(len(train), min(args.prompts_per_iter, len(train)), replace=False)
        row = {"iteration": t + 1, **es_step(policy, [prompts[i] for i in batch],
                                             lambda i, text: score(args.task, train[batch[i]], text), args, t,
                                             rank, world)}
        row.update({"es/d_rel": policy.drift(), "perf/iteration_s": time.perf_counter() - t_start})

        # 5. evaluate the center θ, log, checkpoint (rank 0 only: the other ranks hold the identical θ)
        if rank != 0:
            continue
        if args.eval_every > 0 and ((t + 1) % args.eval_every == 0 or t + 1 == args.iterations):
            row.update(evaluate(policy, args.task, test, args.max_new_tokens, args.chat_template))
        log_metrics(run, row)
        bar.set_postfix(reward=f"{row['train/reward_mean']:.3f}", acc=f"{row['train/accuracy']:.3f}",
                        d_rel=f"{row['es/d_rel']:.1e}")
        if (t + 1) % args.save_every == 0 or t + 1 == args.iterations:
            save_checkpoint(run, t + 1, policy, {"iteration": t + 1})
    if args.backend == "vllm":
        policy.close()  # free its memory for whatever runs next in this process (grpo_es.py's second stage)
    if world > 1:
        torch.distributed.destroy_process_group()
    return run


if __name__ == "__main__":
    main(tyro.cli(Args))
