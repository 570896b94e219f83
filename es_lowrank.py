"""es_lowrank.py — low-rank population ES ([EGGROLL]): every member is a rank-r change of each weight matrix, so the
whole population generates in ONE batched rollout instead of N rollouts of N perturbed models.

The update ([EGGROLL] §3, on es.py's loop, seeds and z-score). Per iteration t, for every weight matrix W (out × in)
inside the transformer blocks:

    s_n = seed(run seed, t, n)                   es.member_seeds, as in es.py
    [A_n; B_n] ~ N(0, 1), (out + in) × r         from (s_n, tensor name) in fp32 (common.noise), never stored
    ε_n = A_n·B_nᵀ / √r                          rank r; the 1/√r keeps each element's variance 1, as es.py's ε has
    R_n = mean_x reward(W + σ·ε_n, x)           all N×P rows in one batched generate; row b belongs to member b // P
    Z_n = (R_n − mean R) / (std R + 1e-8)       es.zscore; std R = 0 → no update
    W  ← W + α/N · Σ_n Z_n·ε_n  =  W + α/(N√r) · (A·diag(Z))·Bᵀ      A: (out, N·r), B: (in, N·r); one matmul, fp32

Member n's layer computes x·Wᵀ + σ/√r·(x·B_n)·A_nᵀ: the model keeps the center θ, and a row pays two thin matmuls
(r(out + in) flops per token) for its own member. On the HF backend these are forward hooks on the Linear layers
(`member_hooks`); on vLLM each member is a LoRA adapter (lora_B = sign·σ/√r·A_n, lora_A = B_nᵀ, scale 1), all N in
the same batch, and the center θ reaches the engine once per iteration (`common.sync_weights`).

Deviations from full-rank ES (es.py), and why:
  1. Only the 2-D weights inside the transformer blocks (q/k/v/o and gate/up/down projections) are perturbed and
     updated: 79 % of SmolLM2-135M's parameters (72 % of Qwen2.5-0.5B's, 85 % of 1.5B's). Embeddings and the LM head
     stay θ₀: a per-row correction of an embedding is a gather, not the batched matmul that makes this cheap, and both
     are tied in these models, so a change would couple input and output. Norm weights and biases (0.03 %) stay θ₀
     too: a per-row vector is cheap but adds a second noise path for a negligible share.
  2. Each member's noise has rank r per matrix, so the update of one iteration has rank ≤ N·r: larger N, which costs
     little here, buys a higher-rank step. [EGGROLL] shows the low-rank update approaches the full-rank one as r grows.
  3. No per-member weight writes: the perturb/restore passes over all parameters that dominate es.py on small models
     are gone; a member's weights exist only as hooks or an adapter. In bf16 the correction is computed in fp32 on
     top of cast(θ) instead of being rounded into bf16 weights.
Deviations from [EGGROLL] (its reference code, ESHyperscale/HyperscaleES), and why:
  1. Vectors get no noise ([EGGROLL] gives non-matrix parameters full-rank noise, or freezes them with
     `freeze_nonlora`): see 1 above.
  2. es.py's update: z-score with 1e-8, plain step α, no 1/σ; [EGGROLL] feeds its estimate to an optimizer (SGD or
     Adam), normalizes with √(var + 1e-5), and may reuse noise across epochs. One algorithm, two noise shapes: a
     comparison with es.py changes one thing.
  3. Antithetic pairs are a flag (off by default, as in es.py); [EGGROLL] always mirrors.
  4. Factors are drawn per (member seed, HF tensor name) with common.noise ([EGGROLL]: jax fold_in(key, epoch,
     member)), so they are the same on both backends and on resume.
Defaults: es.py's (the [ES-LLM] artifact's N, σ, α) and rank 1 ([EGGROLL]'s). The CPU command below is the README's
Quickstart with N = 16 (one iteration costs about what es.py's N = 8 does) and α = 1e-2 (README, Low-rank ES).
Reproducibility: as es.py (bitwise on CPU with the HF backend, statistical on GPU and with vLLM). Runs in one process.

Run it:
  CPU, the embedded SmolLM2-135M-Instruct on small sums (the Quickstart's task, a larger population):
    python es_lowrank.py --task arith --chat-template --pop 16 --prompts-per-iter 8 --max-new-tokens 24 \
        --sigma 5e-3 --alpha 1e-2 --iterations 6 --eval-every 3 --eval-prompts 64 --out-dir runs/lowrank-quick
  GPU, the [ES-LLM] GSM8K protocol with 4x the population, every member an adapter in one vLLM batch:
    python es_lowrank.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --chat-template --backend vllm --pop 128 \
        --batch-size 8192 --out-dir runs/es-lowrank-gsm8k
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

import es
from common import HFPolicy, Master, VLLMPolicy, Weights, die, noise, require, sync_weights
from harness import cli, single_process


@dataclass
class Args(es.Args):
    out_dir: str = "runs/es-lowrank"
    """run directory: args.json, metrics.jsonl, curves.png, checkpoints/"""
    batch_size: int = 256
    """sequences per generate call (≥ 1): ⌊batch_size / P⌋ members share one call, so ≥ N·P puts the whole population
    in one batch (vLLM: the engine's max_num_seqs)"""
    noise_rank: int = 1
    """rank r of each member's change A_n·B_nᵀ/√r of a weight matrix (≥ 1; [EGGROLL]: 1; vLLM: ≤ 512)"""


def targets(params: Weights) -> list[str]:
    """The perturbed tensors: the 2-D weights inside the transformer blocks (HF names model.layers.<i>.<…>.weight)."""
    return [k for k, p in params.items() if p.ndim == 2 and ".layers." in k]


def factors(seed: int, name: str, weight: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_n (out × r) and B_n (in × r) ~ N(0, 1) in fp32 for one weight, from (member seed, tensor name)."""
    out = weight.shape[0]
    ab = noise(seed, name, torch.Size((out + weight.shape[1], r)), weight.device)  # [A; B], one draw per tensor
    return ab[:out], ab[out:]


@contextlib.contextmanager
def member_hooks(model: torch.nn.Module, params: Weights, seeds: Sequence[int], coefs: Sequence[float],
                 r: int) -> Iterator[None]:
    """While open, row b of a batch of M·P rows computes every target W as W + coefs[m]·A_m·B_mᵀ, m = b // P (rows
    are member-major). A batch of one member's rows may have any size (HFPolicy.generate cuts P > batch_size)."""
    handles = []
    for name in targets(params):
        a, b = (torch.stack(f) for f in zip(*(factors(s, name, params[name], r) for s in seeds)))  # (M,out,r),(M,in,r)
        a *= torch.tensor(coefs, dtype=torch.float32, device=a.device).view(-1, 1, 1)  # sign·σ/√r folded into A_m

        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor,
                 a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
            x = inputs[0].reshape(len(a), -1, inputs[0].shape[-1]).float()  # (M, rows/M·T, in): a member's rows
            return output + torch.bmm(torch.bmm(x, b), a.transpose(1, 2)).view_as(output).to(output.dtype)

        handles.append(model.get_submodule(name.removesuffix(".weight")).register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def write_adapter(folder: Path, params: Weights, seed: int, coef: float, r: int) -> str:
    """Member (seed, coef) as a PEFT LoRA folder for vLLM, in HF module names (vLLM packs q/k/v and gate/up itself):
    ΔW = lora_B·lora_A·lora_alpha/r with lora_B = coef·A_n (out × r), lora_A = B_nᵀ (r × in), lora_alpha = r."""
    from safetensors.torch import save_file

    tensors = {}
    for name in targets(params):
        a, b = factors(seed, name, params[name], r)
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = b.T.contiguous().cpu()  # (r, in)
        tensors[f"{module}.lora_B.weight"] = (coef * a).cpu()  # (out, r)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    modules = sorted({name.split(".")[-2] for name in targets(params)})  # q_proj, k_proj, …
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": r, "target_modules": modules}))
    return str(folder)


def evaluate_population(engine: HFPolicy | VLLMPolicy, master: Master, prompts: list[str], reward_fn: es.RewardFn,
                        seeds: Sequence[int], signs: np.ndarray, sigma: float, max_new_tokens: int,
                        temperature: float, sample_seeds: Sequence[int], rank: int = 0, world: int = 1, *,
                        r: int = 1) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Rewards and correctness (N, P) of every member on the same prompts, members batched side by side (es.py's
    signature; `rank`/`world` are the process's, always 0/1 here: main refuses torchrun). θ is never written."""
    pop, size = len(seeds), len(prompts)
    rewards, correct = np.zeros((pop, size)), np.zeros((pop, size))
    t0 = time.perf_counter()
    sync_weights(engine, master.params)  # vLLM: the center θ once per iteration (drops the last adapters); HF: no-op
    perf = {"perturb_s": time.perf_counter() - t0, "rollout_s": 0.0, "tokens": 0}
    per_call = pop if isinstance(engine, VLLMPolicy) else max(1, engine.batch_size // size)  # members per generate
    with tempfile.TemporaryDirectory(prefix="es-lowrank-") as tmp:
        for start in range(0, pop, per_call):
            group = range(start, min(start + per_call, pop))
            coefs = [signs[n] * sigma / math.sqrt(r) for n in group]  # member n: W + sign·σ/√r·A_n·B_nᵀ
            rows = [p for _ in group for p in prompts]  # (M·P,), member-major: row b is member group[b // P]
            options = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=sample_seeds[start])
            t0 = time.perf_counter()
            if isinstance(engine, HFPolicy):
                with member_hooks(engine.model, master.params, [seeds[n] for n in group], coefs, r):
                    t1 = time.perf_counter()
                    samples = engine.generate(rows, **options)
            else:
                folders = [write_adapter(Path(tmp) / str(n), master.params, seeds[n], c, r)
                           for n, c in zip(group, coefs)]
                t1 = time.perf_counter()
                samples = engine.generate(rows, loras=[folders[b // size] for b in range(len(rows))], **options)
            for x in samples:
                n, i = group[x.prompt_index // size], x.prompt_index % size
                rewards[n, i], correct[n, i] = reward_fn(i, x.text)
                perf["tokens"] += len(x.token_ids)
            perf["perturb_s"] += t1 - t0
            perf["rollout_s"] += time.perf_counter() - t1
    return rewards, correct, perf


@torch.no_grad()
def es_update(master: Master, seeds: Sequence[int], signs: np.ndarray, member_rewards: np.ndarray, alpha: float,
              awd_lambda: float = 0.0, *, r: int = 1) -> dict[str, float]:
    """Normalize the member rewards R (N,) and move every target W of the fp32 master along Σ_n Z_n·ε_n."""
    if not np.isfinite(member_rewards).all():  # a NaN must never reach the master weights
        die(f"a member's reward is not finite ({member_rewards.tolist()}); θ was not updated")

    # 3. normalize: population z-score; equal rewards carry no information, so no update (and no NaN)
    skip = member_rewards.std() == 0
    coefs = torch.tensor(es.zscore(member_rewards) * signs, dtype=torch.float32)  # Z_n·sign_n, (N,)

    # 4. W ← W + α/(N√r)·(A·diag(Z))·Bᵀ for every target W, in fp32 on the master, then cast once into the model
    sq = 0.0
    for name in [] if skip else targets(master.params):
        weight = master.params[name]
        a, b = (torch.stack(f) for f in zip(*(factors(s, name, weight, r) for s in seeds)))  # (N, out, r), (N, in, r)
        a *= coefs.to(a.device).view(-1, 1, 1)
        delta = a.permute(1, 0, 2).flatten(1) @ b.permute(1, 0, 2).flatten(1).T  # (out, N·r) @ (N·r, in)
        delta *= alpha / (len(seeds) * math.sqrt(r))
        master.theta[name].add_(delta.to(master.theta[name].device))
        sq += float(torch.linalg.vector_norm(delta)) ** 2
    master.restore()
    if awd_lambda > 0:  # anchored weight decay [AWD], L2 form: θ ← θ₀ + (1 − αλ)(θ − θ₀); untouched tensors stay θ₀
        master.shrink_to_base(1 - alpha * awd_lambda)
    return {"es/update_norm": sq ** 0.5, "es/skipped": int(skip)}


def stages(r: int) -> tuple[Callable[..., tuple[np.ndarray, np.ndarray, dict[str, float]]], Callable[..., dict]]:
    """Stages 2 and 4 at rank r, with the signatures of es.evaluate_population and es.es_update (for es.main)."""
    return functools.partial(evaluate_population, r=r), functools.partial(es_update, r=r)


def check_args(args: Args) -> None:
    """es.py's checks and the rank's, before anything is loaded or written."""
    require(args.noise_rank >= 1, f"--noise-rank must be ≥ 1, got {args.noise_rank}")
    require(args.noise_table == 0, "--noise-table is es.py's: low-rank factors are drawn per (member, tensor)")
    es.check_args(args)


def main(args: Args) -> Path:
    """es.main's loop (Ctrl-C, resume, checkpoints, evaluation) with the batched stages 2 and 4."""
    check_args(args)
    single_process("es_lowrank.py")
    population, update = stages(args.noise_rank)
    return es.main(args, population, update, lora=(args.pop, args.noise_rank))


if __name__ == "__main__":
    main(cli(Args))
