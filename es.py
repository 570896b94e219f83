"""es.py — Evolution Strategies fine-tuning of an LLM on a verifiable reasoning task, in one file.

The update ([ES-LLM] §2, [Qiu] Alg. 1, the shared-seed trick of [OpenAI-ES] Alg. 2). Per iteration t:

    s_n = seed(run seed, t, n)                  n = 1..N; noise is never stored, only regenerated from s_n
    R_n = mean_x reward(θ + σ·ε_n, x)           the same prompts x for every member, greedy decoding
    Z_n = (R_n − mean R) / (std R + 1e-8)       population z-score (ddof 0); std R = 0 → no update
    θ  ← θ + α · (1/N) · Σ_n Z_n · ε_n         no 1/σ: [Qiu] folds it into α; Σ accumulated in fp32

Deviations from the reference code ([Qiu], VsonicV/es-fine-tuning-paper), and why:
  1. ε is i.i.d. across tensors: each tensor's generator is seeded from (s_n, tensor name). The reference seeds
     every tensor with s_n, so equal-shaped tensors (every q_proj, say) receive identical noise.
  2. An fp32 master copy of θ (`common.Master`). Member n is cast(master + σ·ε_n) and the restore copies the master
     back, bit-exact in fp32/bf16/fp16. The reference adds then subtracts the noise in bf16: a random drift per
     member about as large as the real update.
  3. The update is summed and applied in fp32 on the master, then cast once (in bf16 ~35% of the update's elements
     would round away).
  4. Rewards score the completion only; the reference HF code scored prompt + completion (inflated format reward).
Defaults follow the [ES-LLM] authors' artifact (GSM8K, Qwen2.5-1.5B-Instruct): N=32, σ=1.5e-3, α=2.5e-4, 64 prompts
per iteration, 2 epochs in epoch-wise shuffled order, greedy rollouts of ≤ 2048 tokens. The task default is [Qiu]'s
Countdown. Options beyond both papers, off by default: antithetic ±ε pairs ([ES-LLM] found no gain) and anchored
weight decay θ ← θ₀ + (1 − αλ)(θ − θ₀) ([AWD]); ε sliced from one shared table instead of drawn per member
(--noise-table, [OpenAI-ES] §2.3: perturb + update fall from 36 % to 4 % of the Quickstart's rollout time, but the
members' ε overlap; docs/benchmarks.md). The JS diversity and coverage are logged for greedy rollouts only:
they need p_i(x) ∈ {0, 1}, which one sampled completion per (member, prompt) does not give.

Backends: `--backend hf` generates with the HF model that holds θ; `--backend vllm` generates with a vLLM engine into
which each member's weights are written (`sync_weights`, one engine load per member), as grpo.py writes its trained
weights: the same seeds give the same weights, bit for bit, in both. es_lowrank.py runs this file's loop with
low-rank members ([EGGROLL]), the whole population in one batched rollout.

Reproducibility: every seed derives from --seed. On CPU a run is bitwise reproducible, and a run stopped at any
instant (Ctrl-C, kill) and resumed ends with exactly the weights of an uninterrupted run; GPU kernels (and vLLM
batching) are only statistically reproducible.

Run it:
  CPU, the embedded SmolLM2-135M-Instruct on small sums (the README's Quickstart, 3–10 min on 2 cores):
    python es.py --task arith --chat-template --pop 8 --prompts-per-iter 8 --max-new-tokens 24 --sigma 5e-3 \
        --alpha 5e-3 --iterations 6 --eval-every 3 --eval-prompts 64
  GPU, the [ES-LLM] artifact's GSM8K protocol (234 iterations; data from the hub or a folder, see README):
    python es.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --chat-template --backend vllm --out-dir runs/es-gsm8k
  GPU, [Qiu]'s Countdown settings:
    python es.py --model Qwen/Qwen2.5-1.5B-Instruct --pop 30 --sigma 1e-3 --alpha 5e-4 --train-size 200 \
        --prompts-per-iter 200 --iterations 500 --max-new-tokens 1024 --prompt-order random
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from common import (EMBEDDED_MODEL, HFPolicy, Master, Task, VLLMPolicy, derive_seed, die, evaluate_greedy, load_task,
                    noise_table, render_prompt, require, resolve_dtype, resolve_model, score, sync_weights)
from harness import (CURVES, Run, check_gpu_memory, check_run_dir, cli, held_interrupts, init_distributed, plan,
                     require_min)


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
    resume: Optional[str] = None
    """continue the run in this directory from its last checkpoint (the flags it last ran with, plus those passed)"""
    eval_every: int = 25
    """evaluate the center θ on held-out problems every this many iterations, first and last (≥ 0; 0 = never)"""
    eval_prompts: int = 200
    """number of held-out test problems per evaluation (≥ 1)"""
    save_every: int = 50
    """also write a checkpoint every this many iterations (≥ 0); always at epoch ends, the end and on Ctrl-C"""
    keep_last: int = 2
    """checkpoints kept besides every epoch's end and the final one: the newest this many (≥ 1)"""
    tracker: Optional[Literal["tensorboard", "wandb"]] = None
    """also log the metrics to TensorBoard (run/tensorboard) or W&B (needs the package)"""
    schedule_start: int = 0
    """first update index of the prompt schedule (≥ 0; grpo_es.py's second stage continues the first one's order)"""
    pop: int = 32
    """population size N (≥ 2)"""
    sigma: float = 1.5e-3
    """noise scale σ (> 0)"""
    alpha: float = 2.5e-4
    """step size α (> 0; no 1/σ factor)"""
    prompts_per_iter: int = 64
    """prompts per iteration (≥ 1), the same for every member; all of them if ≥ the training set"""
    iterations: Optional[int] = None
    """ES iterations T (≥ 1); default: epochs × ⌈train size / prompts-per-iter⌉"""
    epochs: int = 2
    """passes over the training set when --iterations is unset (≥ 1; [ES-LLM] artifact: 2 = 234 iterations on GSM8K)"""
    prompt_order: Literal["epoch", "random"] = "epoch"
    """epoch: a fresh shuffle of the training set per epoch, in contiguous batches ([ES-LLM] artifact); random: an
    independent sample every iteration"""
    train_size: Optional[int] = None
    """use only the first this many training problems (≥ 1; [Qiu]: 200)"""
    antithetic: bool = False
    """mirrored pairs +ε/−ε (N must be even)"""
    noise_table: int = 0
    """ε from a shared table of this many N(0, 1) values ([OpenAI-ES] §2.3; ≥ the largest tensor, e.g. 268435456 =
    1 GiB; 0 = off): no drawing per member, but the ε of members and tensors overlap (docs/benchmarks.md)"""
    awd_lambda: float = 0.0
    """anchored weight decay λ after each update (≥ 0, α·λ ≤ 1; 0 = off; [AWD] uses 10)"""
    temperature: float = 0.0
    """rollout temperature (≥ 0); 0 = greedy (all exploration is in parameter space)"""
    max_new_tokens: int = 2048
    """generation budget per completion (≥ 1; [ES-LLM] artifact: 2048, [Qiu]: 1024)"""
    backend: Literal["hf", "vllm"] = "hf"
    """rollout backend: the HF model's generate, or a vLLM engine loaded with each member's weights (needs vllm)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype; auto = bf16 on GPU, fp32 on CPU (the master is always fp32)"""
    batch_size: int = 64
    """sequences per generate call (≥ 1)"""
    vllm_memory: float = 0.7
    """--backend vllm: the engine's share of GPU memory, in (0, 1] ([ES-LLM]: 0.7); the master lives outside it"""
    master_device: Optional[Literal["cpu", "cuda"]] = None
    """where the fp32 master and θ₀ live (default: beside the model; 'cpu' saves GPU memory)"""


def check_args(args: Args) -> None:
    """Every flag in its range (the Args docstrings), before anything is loaded or written."""
    require_min(args, 1, "eval_prompts", "max_new_tokens", "batch_size", "epochs", "iterations", "prompts_per_iter",
                "train_size", "keep_last")
    require_min(args, 0, "eval_every", "save_every", "schedule_start", "temperature", "awd_lambda", "noise_table")
    require(args.pop >= 2, f"--pop must be ≥ 2 (a z-score needs two members), got {args.pop}")
    require(not args.antithetic or args.pop % 2 == 0, f"--antithetic needs an even --pop, got {args.pop}")
    for flag in ("sigma", "alpha"):
        value = getattr(args, flag)
        require(value > 0 and math.isfinite(value), f"--{flag} must be a finite number > 0, got {value}")
    require(args.alpha * args.awd_lambda <= 1, f"--awd-lambda must be in [0, 1/α], got {args.awd_lambda}")
    require(0 < args.vllm_memory <= 1, f"--vllm-memory must be in (0, 1], got {args.vllm_memory}")
    check_run_dir(args.out_dir, args.resume)


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


def evaluate_population(engine: HFPolicy | VLLMPolicy, master: Master, prompts: list[str], reward_fn: RewardFn,
                        seeds: Sequence[int], signs: np.ndarray, sigma: float, max_new_tokens: int,
                        temperature: float, sample_seeds: Sequence[int], rank: int = 0,
                        world: int = 1) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Rewards and correctness (N, P) of every member on the same prompts; θ is restored after each member.

    Under torchrun, process `rank` evaluates members n ≡ rank (mod world) and the (N, P) results are summed across
    processes: each row is non-zero on exactly one process, so the sum is exact and every process gets all rows.
    """
    rewards, correct = np.zeros((len(seeds), len(prompts))), np.zeros((len(seeds), len(prompts)))
    perf = {"perturb_s": 0.0, "rollout_s": 0.0, "tokens": 0}
    for n in range(rank, len(seeds), world):
        t0 = time.perf_counter()
        master.perturb(seeds[n], signs[n] * sigma)  # θ_n = cast(θ + sign·σ·ε_n) in the HF model
        sync_weights(engine, master.params)  # vLLM: one load per member; HF: these are its weights, nothing to do
        t1 = time.perf_counter()
        samples = engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=sample_seeds[n])
        for x in samples:
            rewards[n, x.prompt_index], correct[n, x.prompt_index] = reward_fn(x.prompt_index, x.text)
            perf["tokens"] += len(x.token_ids)
        t2 = time.perf_counter()
        master.restore()  # exact: θ = cast(master)
        perf["perturb_s"] += t1 - t0 + time.perf_counter() - t2
        perf["rollout_s"] += t2 - t1
    if world > 1:  # N·P floats cross the network; the weights never do
        device = next(iter(master.params.values())).device
        both = torch.from_numpy(np.stack([rewards, correct])).to(device)  # NCCL reduces CUDA tensors only
        torch.distributed.all_reduce(both)
        rewards, correct = both.cpu().numpy()
    return rewards, correct, perf


def es_update(master: Master, seeds: Sequence[int], signs: np.ndarray, member_rewards: np.ndarray, alpha: float,
              awd_lambda: float = 0.0) -> dict[str, float]:
    """Normalize the member rewards R (N,) and move the fp32 master θ along the rewarded noise."""
    if not np.isfinite(member_rewards).all():  # a NaN must never reach the master weights
        die(f"a member's reward is not finite ({member_rewards.tolist()}); θ was not updated")

    # 3. normalize: population z-score; equal rewards carry no information, so no update (and no NaN)
    skip = member_rewards.std() == 0
    z = zscore(member_rewards)

    # 4. θ ← θ + α/N · Σ_n Z_n·sign_n·ε(s_n), summed in fp32 on the master, then cast once into the model
    update_norm = 0.0 if skip else master.add_noise(seeds, z * signs, scale=alpha / len(seeds))
    if awd_lambda > 0:  # anchored weight decay [AWD], L2 form: θ ← θ₀ + (1 − αλ)(θ − θ₀)
        master.shrink_to_base(1 - alpha * awd_lambda)
    return {"es/update_norm": update_norm, "es/skipped": int(skip)}


ES_CURVES = (("es/js_succ_bits", "ES: JS diversity (bits)"),)
"""es.py's panel in curves.png, beside harness.CURVES."""


def main(args: Args, population: Callable[..., tuple[np.ndarray, np.ndarray, dict[str, float]]] = evaluate_population,
         update: Callable[..., dict[str, float]] = es_update, lora: Optional[tuple[int, int]] = None) -> Path:
    """Train. `population` and `update` are stages 2 and 4, with the signatures of `evaluate_population` and
    `es_update`: es_lowrank.py runs this same loop with its own, and `lora` (adapters, rank) for its vLLM engine."""
    check_args(args)
    rank, world = init_distributed()  # every process holds θ and derives the same seeds; rank 0 logs and saves
    train = load_task(args.task, "train", args.data)[: args.train_size]
    test = load_task(args.task, "test", args.data)[: args.eval_prompts]
    size = min(args.prompts_per_iter, len(train))
    iterations, per_epoch, batches = plan(args.seed, len(train), size, args.iterations, args.epochs, args.prompt_order)
    model = resolve_model(args.model)
    dtype = resolve_dtype(args.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    if args.backend == "vllm":  # before anything is loaded: the HF model and the master live beside the engine
        check_gpu_memory(model, dtype, args.vllm_memory, args.master_device)
    run = Run(args.out_dir, args, args.resume is not None, iterations, per_epoch, args.eval_every, args.save_every,
              args.keep_last, args.tracker, rank)

    # θ twice: in the model dtype (the HF model) and in fp32 (the master); a vLLM engine gets copies of the former
    policy = HFPolicy(model, args.dtype, batch_size=args.batch_size)
    table = noise_table(args.noise_table, args.seed, policy.device) if args.noise_table else None
    master = Master(policy.params, args.master_device, table)
    if run.checkpoint:
        master.load(run.checkpoint)
    engine = policy if args.backend == "hf" else VLLMPolicy(model, args.dtype, batch_size=args.batch_size,
                                                            gpu_memory=args.vllm_memory, lora=lora)
    prompts = [render_prompt(args.task, p, policy.tokenizer, args.chat_template) for p in train]
    bytes_per_param = dtype.itemsize + (4 if dtype != torch.float32 else 0)  # + the exact fp32 master in bf16
    run.say_start(f"es: {iterations - run.start} iterations of {args.pop} members × {size} prompts × ≤ "
                  f"{args.max_new_tokens} new tokens (≤ {args.pop * size * args.max_new_tokens:,} generated tokens "
                  "per iteration)", sum(p.numel() for p in policy.params.values()) * bytes_per_param)

    def save(folder: Path) -> None:  # a from_pretrained folder of cast(θ) (+ the fp32 θ if the dtype loses bits)
        master.restore()  # a stop inside a rollout leaves the model holding θ + σ·ε_n: θ is what is saved
        policy.save(folder)
        master.save(folder)

    def evaluate_center(step: int) -> None:  # greedy, held out; the engine may still hold the last member
        if run.eval_due(step):
            sync_weights(engine, master.params)
            run.log({"step": step, **evaluate_greedy(engine, args.task, test, args.max_new_tokens,
                                                     args.chat_template, f"eval θ_{step}")})

    bar = tqdm(range(run.start, iterations), initial=run.start, total=iterations, desc="es", unit="it",
               disable=rank != 0)
    done, skipped, seconds = run.start, 0, []
    try:
        evaluate_center(run.start)  # θ₀, or an evaluation a stop cut short
        for t in bar:
            t_start = time.perf_counter()
            batch = batches(args.schedule_start + t)

            # 1. member seeds from (--seed, t, n): nothing else is needed to regenerate ε_n anywhere
            seeds, signs = member_seeds(args.seed, t, args.pop, args.antithetic)

            # 2. evaluate the population: every member on the same prompts (R: (N, P))
            rewards, correct, perf = population(
                engine, master, [prompts[i] for i in batch], lambda i, text: score(args.task, train[batch[i]], text),
                seeds, signs, args.sigma, args.max_new_tokens, args.temperature,
                [derive_seed(args.seed, "sample", t, n) for n in range(args.pop)], rank, world)
            member_rewards = rewards.mean(1)  # R_n, (N,)

            # 3–4. normalize and update θ. Ctrl-C waits until the iteration is logged as done: a checkpoint holds
            # whole updates only, and a resume never applies one twice
            with held_interrupts():
                t_update = time.perf_counter()
                stats = update(master, seeds, signs, member_rewards, args.alpha, args.awd_lambda)
                row = {"step": t + 1, "train/reward_mean": float(member_rewards.mean()),
                       "train/reward_std": float(member_rewards.std()), "train/reward_max": float(member_rewards.max()),
                       "train/accuracy": float(correct.mean()), **stats, "es/d_rel": master.drift(),
                       "perf/rollout_s": perf["rollout_s"], "perf/perturb_s": perf["perturb_s"],
                       "perf/update_s": time.perf_counter() - t_update,
                       "perf/tokens_per_s": perf["tokens"] / max(perf["rollout_s"], 1e-9),
                       "perf/iteration_s": time.perf_counter() - t_start}
                if args.temperature == 0:  # p_i(x) ∈ {0, 1} only for greedy rollouts (module docstring)
                    row["es/js_succ_bits"], row["es/coverage"] = js_diversity(correct)
                run.log(row)
                done = t + 1

            # 5. report, evaluate the center θ, checkpoint (rank 0: the other ranks hold the identical θ)
            skipped = skipped + 1 if row["es/skipped"] else 0
            bar.set_postfix(reward=f"{row['train/reward_mean']:.3f}", d_rel=f"{row['es/d_rel']:.1e}",
                            **({"update": "skipped"} if skipped else {}))
            seconds.append(row["perf/iteration_s"])
            run.say_eta(done, seconds, "iteration")
            if skipped and rank == 0:
                hint = ("no member earned any reward — try more --max-new-tokens, a larger --sigma or an easier "
                        "--task (arith)" if row["train/reward_max"] == 0 else "try a larger --sigma")
                tqdm.write(f"iteration {done}: every member scored {row['train/reward_mean']:.3f}: no update"
                           + (f"; 3 in a row: {hint}" if skipped == 3 else ""))
            evaluate_center(done)
            run.save_due(done, save)
        bar.close()
        run.finish(save, CURVES + ES_CURVES)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM anywhere above: save θ_done (never a member), exit 130/143
        bar.close()
        run.interrupted(done, save, CURVES + ES_CURVES)
    if engine is not policy:
        engine.close()  # its memory back for whatever this process runs next
    if world > 1 and torch.distributed.is_initialized():  # closing a vLLM engine may already have destroyed it
        torch.distributed.destroy_process_group()
    return run.dir


if __name__ == "__main__":
    main(cli(Args))
