"""eval_passk.py — Pass@K curves, majority vote, held-out tasks and functional sparsity, in one file.

[ES-LLM]'s central evidence is measured, not trained: ES keeps (or widens) reasoning coverage where GRPO narrows
it, forgets less on held-out tasks, and most of its parameter change can be reset without losing accuracy.

Per model and task, each problem x gets one greedy completion and n samples (the [ES-LLM] artifact's protocol: n=32,
temperature 0.6, top_p 1.0, ≤ 2048 tokens), c(x) of the samples correct:

    pass@k(x) = 1 − C(n−c, k) / C(n, k)                  unbiased estimator ([Codex] §2.1), k = 1, 2, 4, …, n
              = 1 − Π_{i=n−c+1..n} (1 − k/i)             stable product form (no huge binomials); = 1 if n − c < k
    pass@1(x) = c/n
    maj@k(x)  = 1[the most frequent answer among samples 1..k is correct]     answers normalized by common.py
    pass@k    = mean_x pass@k(x)                          (likewise maj@k, reward, response length in tokens)
    greedy    = mean_x 1[the greedy completion is correct]

Functional sparsity ([ES-LLM] §4.2), base θ₀, trained θ, Δ = θ − θ₀, threshold τ:

    θ_τ = θ₀ + Δ · 1[|Δ| > τ]                             every coordinate with 0 < |Δ| ≤ τ reset to θ₀
    s_τ = #{0 < |Δ| ≤ τ} / #{Δ ≠ 0}                       fraction of the nonzero changes that were reset
    D_rel = ‖Δ‖₂ / ‖θ₀‖₂                                  relative drift (of θ, and of θ_τ)

The paper: at s_τ ≈ 78%, pass@1 of θ_τ stays within ±0.5 pt of the full ES model.

Uncertainty: 95% percentile bootstrap over problems ([Efron & Tibshirani 1993] ch. 13; B = --resamples, from --seed)
of v(x) = 1[greedy correct] and v(x) = pass@k(x) (unbiased per problem: the interval covers c(x)'s sampling noise
too). Paired ([Miller 2024] arXiv 2411.00640): d(x) = v_m(x) − v_ref(x) for every row m ≠ --reference, on the same
resamples; won / lost = #{x: d(x) > 0} / #{x: d(x) < 0}. Labels METHOD@SEED add a row METHOD@* whose interval counts
the seed, which moves every problem at once: m̄ ± t_{0.975,S−1}·sd(m_s)/√S over the seed means m_s of v_s(x) or d_s(x).
Sparsity: each θ_τ's pass@1, and d(x) = pass@1_τ(x) − pass@1_θ(x) paired with its full model, on the same resamples.

Choices the papers leave open (and why):
  1. maj@k tie-break: of the answers with the most votes, the one seen first wins; samples without an answer abstain
     (all k abstaining: wrong). The vote is right iff the first sample giving the winning answer was scored correct
     (the same normalized answer can, rarely, score differently: MATH-500 verifies the whole completion).
  2. Common random numbers: problem x gets the same sampling seeds for every model and every θ_τ, so differences
     between rows come from the weights, not from the sampler's luck (bitwise on CPU; statistical on GPU).
  3. Sparsity is computed in fp32 from the checkpoint's exact weights (its fp32 master when es.py saved one, so bf16
     rounding does not hide small changes); θ_τ is then cast to the model's dtype to evaluate.
     Its pass@1 is measured on the main task with the same n samples per problem as the full model.
  4. One engine (HF or vLLM) serves every model, each model's weights loaded into it as θ_τ is: a closed vLLM engine
     does not reliably give its GPU memory back, so a second one could not start. The models must therefore share one
     architecture (base and fine-tuned checkpoints do); the first one's generation config (EOS ids) applies to all.
Every completion is kept in samples.jsonl (a row per model × problem: the gold answer, the greedy completion and the
n samples, each with its verdict, reward and extracted answer), so a verdict can be audited or re-scored.

Run it:
  CPU, the embedded SmolLM2-135M-Instruct against the Quickstart's es.py checkpoint, a few minutes:
    python eval_passk.py --models base=smollm2-135m es=runs/quickstart/checkpoints/step_000006 --base base \
        --task arith --chat-template --num-problems 16 --n 8 --max-new-tokens 24 --reset-tau 1e-3 1e-2 \
        --out-dir runs/passk-quick
  GPU, the [ES-LLM] artifact's GSM8K evaluation (all 1,319 problems) with MATH-500 held out:
    python eval_passk.py --models base=Qwen/Qwen2.5-1.5B-Instruct es=runs/es-gsm8k/checkpoints/step_000234 \
        --task gsm8k --chat-template --backend vllm --heldout math500 --base base --out-dir runs/passk-gsm8k
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence, get_args

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from common import (EMBEDDED_MODEL, HFPolicy, Problem, Sample, Task, VLLMPolicy, Weights, derive_seed, die,
                    extract_answer, load_task, load_weights, meta_params, render_prompt, require, relative_drift,
                    resolve_model, score, sync_weights)
import common
from harness import cli, require_min, single_process, write_args


@dataclass
class Args:
    models: tuple[str, ...] = (EMBEDDED_MODEL,)
    """models side by side, as label=PATH (a folder, hub id or 'smollm2-135m'); a bare PATH is labelled by its name"""
    task: Task = "countdown"
    """main task (README: Tasks); pass@k, maj@k and the sparsity table are measured on it"""
    data: Optional[str] = None
    """folder with {split}.jsonl for the main task (or a hub dataset id); default: generated or the task's hub data"""
    chat_template: bool = False
    """render prompts with the tokenizer's chat template instead of raw text"""
    seed: int = 0
    """run seed: every sampling seed derives from it (the same for every model: common random numbers)"""
    out_dir: str = "runs/passk"
    """run directory: args.json, passk.json, passk.md, passk.png, samples.jsonl"""
    backend: Literal["hf", "vllm"] = "hf"
    """generation backend: HF generate, or one vLLM engine (n samples = n seeded requests; needs vllm)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype; auto = bf16 on GPU, fp32 on CPU"""
    batch_size: int = 64
    """sequences per generate call (≥ 1)"""
    vllm_memory: float = 0.85
    """--backend vllm: the engine's share of GPU memory, in (0, 1] ([ES-LLM] artifact: 0.85)"""
    split: Literal["train", "test"] = "test"
    """split of the main and held-out tasks"""
    num_problems: Optional[int] = None
    """evaluate the first this many problems of each task (≥ 1; None = the whole split)"""
    n: int = 32
    """samples per problem n (≥ 1; [ES-LLM]: 32); k runs over 1, 2, 4, … up to n"""
    temperature: float = 0.6
    """sampling temperature (> 0; [ES-LLM]: 0.6)"""
    top_p: float = 1.0
    """nucleus sampling top_p (in (0, 1]; [ES-LLM] artifact: 1.0)"""
    max_new_tokens: int = 2048
    """generation budget per completion (≥ 1; [ES-LLM] artifact: 2048)"""
    heldout: tuple[str, ...] = ()
    """held-out tasks (forgetting check) as [NAME:]TASK[=DIR]: a task name, its {split}.jsonl folder, and a table
    name (default: the task) to tell apart two sets scored by one task, e.g. arith2:gsm8k=data/arith2"""
    base: Optional[str] = None
    """base model θ₀ for functional sparsity: a label from --models or a PATH; unset = no sparsity table"""
    reset_tau: tuple[float, ...] = (2.5e-4, 5e-4, 1e-3, 1.5e-3, 2e-3)
    """thresholds τ (≥ 0): reset every coordinate with 0 < |θ−θ₀| ≤ τ to θ₀ ([ES-LLM] §4.2 grid)"""
    reference: Optional[str] = None
    """label from --models that every other row is compared with (paired bootstrap); default: the first model"""
    resamples: int = 2000
    """bootstrap resamples B of the problems for every 95% interval (≥ 1)"""
    verify_timeout: float = 10.0
    """seconds a math-verify verdict may take (> 0; gsm8k, math500); slower ones count as no answer, and are counted"""


def check_args(args: Args) -> None:
    """Every numeric flag in its range (the Args docstrings), before anything is loaded or written."""
    require_min(args, 1, "batch_size", "n", "max_new_tokens", "resamples", "num_problems")
    require(args.temperature > 0, f"--temperature must be > 0 (pass@k needs samples), got {args.temperature}")
    require(0 < args.top_p <= 1 and 0 < args.vllm_memory <= 1, "--top-p and --vllm-memory must be in (0, 1]")
    require(args.verify_timeout > 0, f"--verify-timeout must be > 0 seconds, got {args.verify_timeout}")
    require(all(tau >= 0 for tau in args.reset_tau), f"--reset-tau must be ≥ 0, got {args.reset_tau}")
    require(args.reference in (None, *parse_models(args.models)), f"--reference '{args.reference}' is not a label")
    require(not Path(args.out_dir).is_file(), f"--out-dir '{args.out_dir}' is a file")
    require(not (Path(args.out_dir) / "passk.json").exists(),
            f"'{args.out_dir}' already holds passk.json: choose another --out-dir")


# ---------------------------------------------------------------------------------------------------- metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n−c, k)/C(n, k) = 1 − Π_{i=n−c+1..n} (1 − k/i); 1 when n − c < k ([Codex] §2.1)."""
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def maj_at_k(answers: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> bool:
    """Majority vote over samples 1..k: most votes wins, ties go to the answer seen first; None abstains."""
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return False
    winner = max(votes, key=votes.get)  # max keeps the first maximal key; Counter keeps first-seen order
    return bool(correct[list(answers).index(winner)])


def k_grid(n: int) -> list[int]:
    """k = 1, 2, 4, … ≤ n, and n itself."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def bootstrap_draws(num_problems: int, resamples: int, seed: int) -> np.ndarray:
    """(B, P): how often each problem is drawn in each of B resamples of the P problems: Multinomial(P, 1/P each)."""
    return np.random.default_rng(seed).multinomial(num_problems, np.full(num_problems, 1 / num_problems), resamples)


def interval(values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(3, M): the mean over problems of each column of `values` (P, M) and its 95% percentile interval over `draws`."""
    means = draws @ values / len(values)  # (B, M): the mean of each resample
    return np.vstack([values.mean(0), np.percentile(means, [2.5, 97.5], axis=0)])


def paired(values: np.ndarray, ref_values: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d(x) = v(x) − v_ref(x) of (P, M) values: mean and interval (3, M) on the same resamples; #{d > 0}, #{d < 0}."""
    d = values - ref_values  # (P, M)
    return interval(d, draws), (d > 0).sum(0), (d < 0).sum(0)


def t_table(df: int) -> tuple[np.ndarray, np.ndarray]:
    """Student's t CDF on a grid of φ: t = √ν·tan φ turns F(t) = ½ + c ∫_0^φ cos^{ν−1}ψ dψ, c = Γ((ν+1)/2)/(√π·Γ(ν/2)),
    into a smooth integral on [0, π/2] (trapezoid rule, 2·10⁵ steps: quantiles to ~1e-9). Returns (φ, F(φ))."""
    phi = np.linspace(0, np.pi / 2, 200_001)
    f = np.cos(phi) ** (df - 1) * math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    return phi, 0.5 + np.concatenate([[0.0], np.cumsum(f[1:] + f[:-1]) * (phi[1] - phi[0]) / 2])


def t_quantile(q: float, df: int) -> float:
    """t_{q,ν}: F(t) = q, inverting t_table's monotone F(φ) (symmetric: t_{1−q,ν} = −t_{q,ν})."""
    return math.copysign(math.sqrt(df) * math.tan(float(np.interp(max(q, 1 - q), *t_table(df)[::-1]))), q - 0.5)


def seed_interval(values: np.ndarray) -> np.ndarray:
    """(3, M): m̄ = mean_s m_s, m_s = mean_x v_s(x) of `values` (S ≥ 2, P, M), and m̄ ± t_{0.975,S−1}·sd(m_s)/√S."""
    m = values.mean(1)  # (S, M)
    return m.mean(0) + np.outer([0, -1, 1], t_quantile(0.975, len(m) - 1) * m.std(0, ddof=1) / math.sqrt(len(m)))


def per_problem(result: dict, n: int, ks: Sequence[int]) -> np.ndarray:
    """(P, 1 + K): v(x) = 1[greedy correct] and the unbiased pass@k(x) for each k, from a result's per-problem data."""
    table = np.array([[pass_at_k(n, c, k) for k in ks] for c in range(n + 1)])  # (n + 1, K): pass@k(x) needs c(x) only
    return np.column_stack([result["greedy_correct"], table[result["correct_counts"]]])


def uncertainty(report: dict, reference: str, resamples: int, seed: int) -> dict:
    """Greedy and pass@k of every model and METHOD@* with 95% intervals, and their paired differences from `reference`
    (module docstring): {"rows": {row: {task: {metric: {mean, ci, diff, diff_ci, won, lost}}}}, …}."""
    results, metrics = report["results"], ["greedy"] + [f"pass@{k}" for k in report["ks"]]
    method_of = {label: label.rpartition("@")[0] + "@*" for label in results if "@" in label}  # es@0 → es@*
    methods = {name: [label for label in method_of if method_of[label] == name] for name in method_of.values()}
    methods = {name: labels for name, labels in methods.items() if len(labels) > 1}  # one seed: nothing to pool
    rows: dict[str, dict] = {}
    draws_of: dict[str, np.ndarray] = {}  # task → its resamples of the problems, shared by every row of the task
    for task, ref in results[reference].items():
        draws = draws_of[task] = bootstrap_draws(len(ref["correct_counts"]), resamples,
                                                 derive_seed(seed, "bootstrap", task))
        values = {label: per_problem(r[task], report["n"], report["ks"]) for label, r in results.items()}  # (P, M)
        values |= {name: np.stack([values[label] for label in labels]) for name, labels in methods.items()}  # (S, P, M)
        for label, v in values.items():
            ci = seed_interval(v) if v.ndim == 3 else interval(v, draws)  # METHOD@*: its seeds' spread; else problems'
            cells = [{"mean": mean, "ci": [lo, hi]} for mean, lo, hi in zip(*ci.tolist())]
            if label != reference:  # won/lost of a METHOD@* by its seed-mean d(x); v_ref(x): the same for every seed
                diff, won, lost = paired(v.mean(0) if v.ndim == 3 else v, values[reference], draws)
                diff = seed_interval(v - values[reference]) if v.ndim == 3 else diff
                for cell, d_mean, lo, hi, n_won, n_lost in zip(cells, *diff.tolist(), won.tolist(), lost.tolist()):
                    cell |= {"diff": d_mean, "diff_ci": [lo, hi], "won": n_won, "lost": n_lost}
            rows.setdefault(label, {})[task] = dict(zip(metrics, cells))
    sparsity: dict[str, list] = {}  # each θ_τ's pass@1 and its paired difference from the full θ, on the resamples
    for label, sp in report.get("sparsity", {}).items():  # of the main task's rows
        full = np.array(results[label][report["task"]]["correct_counts"])[:, None] / report["n"]  # (P, 1): c(x)/n
        v = np.reshape([row["correct_counts"] for row in sp["taus"]], (len(sp["taus"]), len(full))).T / report["n"]
        (d, d_lo, d_hi), won, lost = [a.tolist() for a in paired(v, full, draws_of[report["task"]])]  # (P, T): θ_τ's
        mean, lo, hi = interval(v, draws_of[report["task"]]).tolist()
        sparsity[label] = [{"tau": row["tau"], "mean": mean[i], "ci": [lo[i], hi[i]], "diff": d[i], "diff_ci": [
            d_lo[i], d_hi[i]], "won": won[i], "lost": lost[i]} for i, row in enumerate(sp["taus"])]
    return {"reference": reference, "resamples": resamples, "seed": seed, "methods": methods, "rows": rows,
            "sparsity": sparsity}


def reset_small_changes(theta: Weights, theta0: Weights, tau: float) -> tuple[Weights, int, int]:
    """θ_τ = θ₀ + Δ·1[|Δ| > τ] in fp32; returns (θ_τ, #reset = #{0 < |Δ| ≤ τ}, #changed = #{Δ ≠ 0})."""
    out, reset, changed = {}, 0, 0
    for name, t in theta.items():
        t, t0 = t.float(), theta0[name].float()
        delta = (t - t0).abs()
        small = (delta > 0) & (delta <= tau)
        out[name] = torch.where(small, t0, t)  # exact copies of θ₀ / θ values, no arithmetic round-off
        reset, changed = reset + int(small.sum()), changed + int((delta > 0).sum())
    return out, reset, changed


# ---------------------------------------------------------------------------------------------------- plumbing
def parse_models(specs: Sequence[str]) -> dict[str, str]:
    """'label=PATH' (or a bare PATH, labelled by its folder name) → {label: PATH}, in the order given."""
    models = {}
    for spec in specs:
        label, path = spec.split("=", 1) if "=" in spec else (Path(spec.rstrip("/")).name, spec)
        require(bool(label and path), f"--models '{spec}': expected label=PATH")
        require(label not in models, f"--models: label '{label}' is used twice")
        models[label] = path
    return models


def parse_tasks(args: Args) -> dict[str, tuple[Task, Optional[str]]]:
    """The main task first (named after its task), then the held-out ones: {name: (task, data folder or None)}."""
    tasks: dict[str, tuple[Task, Optional[str]]] = {args.task: (args.task, args.data)}
    for spec in args.heldout:
        named, data = spec.split("=", 1) if "=" in spec else (spec, None)
        name, _, task = named.rpartition(":")
        name = name or task
        require(task in get_args(Task), f"--heldout '{spec}': task must be one of {', '.join(get_args(Task))}")
        require(data is None or Path(data).is_dir(), f"--heldout '{spec}': folder '{data}' does not exist")
        require(name not in tasks, f"--heldout '{spec}': the name '{name}' is taken; name this set NAME:{task}=DIR")
        tasks[name] = (task, data)
    return tasks


def check_tokenizers(paths: dict[str, str]) -> None:
    """Compare every vocabulary with the first: pass@k across models means nothing if they tokenize differently."""
    vocabs = {label: AutoTokenizer.from_pretrained(p).get_vocab() for label, p in paths.items()}
    first = next(iter(vocabs))
    for label, vocab in vocabs.items():
        if vocab != vocabs[first]:
            die(f"models '{first}' and '{label}' have different tokenizers "
                f"({len(vocabs[first])} vs {len(vocab)} tokens, {len(vocabs[first].items() ^ vocab.items())} differ)")


def check_shapes(theta: Weights, reference: Weights, label: str, first: str) -> None:
    """One engine serves every model: each must have the first one's parameter names and shapes."""
    if theta.keys() != reference.keys():
        example = sorted(theta.keys() ^ reference.keys())[0]
        die(f"'{label}' and '{first}' have different parameter names (e.g. {example}); one engine serves every "
            "model, so they must share one architecture")
    for k, shape in ((k, p.shape) for k, p in reference.items()):
        if theta[k].shape != shape:
            die(f"'{label}' and '{first}' differ in the shape of {k}: {tuple(shape)} vs {tuple(theta[k].shape)}")


def generate(policy: HFPolicy | VLLMPolicy, prompts: list[str], args: Args, name: str, desc: str) -> list[list[Sample]]:
    """n samples per prompt, grouped per problem (vLLM: the batch is n·P requests, each with its own seed). Seeds
    depend on (run seed, problem set name, problem chunk) only, never on the model: common random numbers."""
    per_call = max(1, args.batch_size // args.n)  # problems per generate call
    grouped: list[list[Sample]] = [[] for _ in prompts]
    with tqdm(total=len(prompts), desc=desc, unit="problem", leave=False) as bar:
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start:start + per_call]
            for s in policy.generate(chunk, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=derive_seed(args.seed, name, start)):
                grouped[start + s.prompt_index].append(s)
            bar.update(len(chunk))
    return grouped


def evaluate(policy: HFPolicy | VLLMPolicy, task: Task, problems: list[Problem], args: Args, desc: str,
             name: str, greedy: bool = True) -> tuple[dict, list[dict]]:
    """pass@k, maj@k, greedy accuracy, mean reward and response length of the loaded weights on one problem set
    (`name`, scored by `task`), + per-problem counts; and a row per problem with every completion for samples.jsonl."""
    prompts = [render_prompt(task, p, policy.tokenizer, args.chat_template) for p in problems]
    timeouts = common.verify_timeouts
    greedy_samples = [s for i in range(0, len(prompts), args.batch_size) if greedy
                      for s in policy.generate(prompts[i:i + args.batch_size], max_new_tokens=args.max_new_tokens)]
    grouped = generate(policy, prompts, args, name, desc)
    # (P, n) per problem x and sample j; samples keep generation order, so maj@k votes over the first k
    rewards, correct, answers = (np.zeros((len(problems), args.n)), np.zeros((len(problems), args.n), bool),
                                 [[extract_answer(task, s.text) for s in g] for g in grouped])
    rows = []
    for x, (problem, group) in enumerate(zip(problems, grouped)):
        for j, s in enumerate(group):
            rewards[x, j], correct[x, j] = score(task, problem, s.text)
        row = {"set": name, "problem": x, "gold": problem.answer or [list(problem.numbers), problem.target],
               "samples": [{"response": s.text, "correct": bool(c), "reward": r, "answer": a}
                           for s, c, r, a in zip(group, correct[x], rewards[x], answers[x])]}
        if greedy:
            text = greedy_samples[x].text
            reward, right = score(task, problem, text)
            row["greedy"] = {"response": text, "correct": right, "reward": reward, "answer": extract_answer(task, text)}
        rows.append(row)
    counts = correct.sum(1)  # c(x), (P,): enough to recompute pass@k for any k ≤ n later
    ks = k_grid(args.n)
    metrics = {"pass@k": {k: float(np.mean([pass_at_k(args.n, int(c), k) for c in counts])) for k in ks},
               "maj@k": {k: float(np.mean([maj_at_k(a, r, k) for a, r in zip(answers, correct)])) for k in ks},
               "reward": float(rewards.mean()),
               "response_tokens": float(np.mean([len(s.token_ids) for g in grouped for s in g])),
               "num_problems": len(problems), "correct_counts": counts.astype(int).tolist(),
               "verify_timeouts": common.verify_timeouts - timeouts}
    if metrics["verify_timeouts"]:
        tqdm.write(f"{desc}: {metrics['verify_timeouts']} math-verify verdicts ran past --verify-timeout "
                   f"{args.verify_timeout:g} s and count as no answer")
    if greedy:  # per problem too: the paired bootstrap needs it
        metrics["greedy_correct"] = [int(r["greedy"]["correct"]) for r in rows]
        metrics["greedy"] = float(np.mean(metrics["greedy_correct"]))
    return metrics, rows


# ---------------------------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    """Greedy and pass@k with 95% intervals and their paired differences from the reference (a row per model or pooled
    method × task), and with --base the sparsity table."""
    ks, u = report["ks"], report["uncertainty"]

    def ci(mean: float, bounds: list[float], fmt: str = ".1f") -> str:
        return f"{100 * mean:{fmt}} [{100 * bounds[0]:{fmt}}, {100 * bounds[1]:{fmt}}]"

    head = "| model | task | greedy |" + "".join(f" pass@{k} |" for k in ks)
    lines = [f"In %: the mean over problems [95% bootstrap interval, {u['resamples']} resamples]; METHOD@*: its seeds' "
             "mean [95% seed-level t interval]", "", head + f" maj@{ks[-1]} | reward | tokens |",
             "|" + "---|" * (len(ks) + 6)]
    diffs = ["", f"Paired difference from {u['reference']} in points [95% interval] and the problems won/lost (per "
                 "problem: 1[greedy correct]; the unbiased pass@k(x))", "", head, "|" + "---|" * (len(ks) + 3)]
    for label, tasks in u["rows"].items():
        for task, cells in tasks.items():
            r = report["results"].get(label, {}).get(task)  # None for a pooled METHOD@*
            lines.append(f"| {label} | {task} | " + "".join(f"{ci(c['mean'], c['ci'])} | " for c in cells.values()) + (
                f"{100 * r['maj@k'][ks[-1]]:.1f} | {r['reward']:.3f} | {r['response_tokens']:.0f} |" if r else
                "— | — | — |"))
            if label != u["reference"]:
                diffs.append(f"| {label} | {task} | " + "".join(f"{ci(c['diff'], c['diff_ci'], '+.1f')} {c['won']}/"
                                                                f"{c['lost']} | " for c in cells.values()).rstrip())
    lines += diffs if len(u["rows"]) > 1 else []  # the reference alone: nothing to compare
    if report.get("sparsity"):
        lines += ["", f"Functional sparsity on {report['task']} (pass@1 in %, n = {report['n']}; base: "
                      f"{report['base']}; Δ: the paired difference from the full model, won/lost problems)", "",
                  "| model | τ | s_τ | D_rel | pass@1 | Δ vs full |", "|---|---|---|---|---|---|"]
        for label, sp in report["sparsity"].items():
            full = u["rows"][label][report["task"]]["pass@1"]
            lines.append(f"| {label} | full | 0.0% | {sp['d_rel']:.2e} | {ci(full['mean'], full['ci'])} | — |")
            for row, c in zip(sp["taus"], u["sparsity"][label]):
                lines.append(f"| {label} | {row['tau']:g} | {100 * row['s_tau']:.1f}% | {row['d_rel']:.2e} | "
                             f"{ci(c['mean'], c['ci'])} | {ci(c['diff'], c['diff_ci'], '+.1f')} "
                             f"{c['won']}/{c['lost']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, file: Path) -> None:
    """pass@k vs k on a log2 axis: one panel per task, one line (and 95% band) per row (as in Yue et al. 2025)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # not pyplot: no display, no global state

    first, ks = next(iter(report["results"].values())), report["ks"]
    fig = Figure(figsize=(4.5 * len(first) + 1.5, 3.6), layout="constrained")
    axes = fig.subplots(1, len(first), squeeze=False)
    for ax, task in zip(axes[0], first):
        ax.set_prop_cycle(color=colormaps["tab10" if len(report["uncertainty"]["rows"]) <= 10 else "tab20"].colors)
        for label, row in report["uncertainty"]["rows"].items():
            curve = np.array([[row[task][f"pass@{k}"]["mean"], *row[task][f"pass@{k}"]["ci"]] for k in ks]).T  # (3, K)
            (line,) = ax.plot(ks, 100 * curve[0], marker="o", label=label, ls="--" if label.endswith("@*") else "-")
            ax.fill_between(ks, 100 * curve[1], 100 * curve[2], color=line.get_color(), alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(title=f"{task} ({first[task]['num_problems']} problems)", xlabel="k", ylabel="pass@k (%), 95% interval")
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.0))  # a flat 0% curve stays on the axis, not mid-panel
        ax.grid(alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)  # off the data
    fig.savefig(file, dpi=120)


def main(args: Args) -> Path:
    check_args(args)
    single_process("eval_passk.py")
    common.VERIFY_TIMEOUT_S = args.verify_timeout
    # 1. task specs, then models: fail early on a bad spec, a missing path, a tokenizer or architecture mismatch
    tasks = parse_tasks(args)
    models = {label: resolve_model(path) for label, path in parse_models(args.models).items()}
    base_path = None if args.base is None else models.get(args.base) or resolve_model(args.base)
    check_tokenizers({**models, **({"--base": base_path} if base_path else {})})
    first = next(iter(models))
    reference = meta_params(models[first])  # its parameter names and shapes, without its weights
    problems = {name: load_task(task, args.split, data)[: args.num_problems] for name, (task, data) in tasks.items()}
    run = Path(args.out_dir)
    write_args(run, args)
    report = {"task": args.task, "split": args.split, "n": args.n, "ks": k_grid(args.n), "models": models,
              "base": args.base, "results": {}, "sparsity": {}}
    # one engine for every model (deviation 4), built with the first model's weights
    policy = (VLLMPolicy(models[first], args.dtype, batch_size=args.batch_size, gpu_memory=args.vllm_memory)
              if args.backend == "vllm" else HFPolicy(models[first], args.dtype, batch_size=args.batch_size))
    theta0 = None
    try:
        with open(run / "samples.jsonl", "w") as samples:
            for label, path in tqdm(models.items(), desc="models", unit="model"):
                # 2. load the model's weights; sample n completions per problem on every task, score, compute metrics
                theta = None if label == first else load_weights(path)  # fp32: 4 bytes/param each for θ, θ₀, θ_τ
                if theta is not None:
                    check_shapes(theta, reference, label, first)
                    sync_weights(policy, theta)
                report["results"][label] = {}
                for name, (task, _) in tasks.items():
                    metrics, rows = evaluate(policy, task, problems[name], args, f"{label}/{name}", name)
                    report["results"][label][name] = metrics
                    samples.writelines(json.dumps({"model": label, **row}) + "\n" for row in rows)
                main_result = report["results"][label][args.task]
                tqdm.write(f"{label}: " + "  ".join(f"{t} pass@1 {100 * r['pass@k'][1]:.1f}%"
                                                    for t, r in report["results"][label].items()))
                if base_path is None or Path(path).resolve() == Path(base_path).resolve():
                    continue

                # 3. functional sparsity: reset the small changes, re-measure pass@1 on the main task
                if theta0 is None:
                    theta0 = load_weights(base_path)
                    check_shapes(theta0, reference, "--base", first)
                theta = load_weights(path) if theta is None else theta
                sparsity = {"d_rel": relative_drift(theta, theta0), "pass@1": main_result["pass@k"][1], "taus": []}
                for tau in args.reset_tau:
                    theta_tau, reset, changed = reset_small_changes(theta, theta0, tau)
                    sync_weights(policy, theta_tau)
                    r, _ = evaluate(policy, args.task, problems[args.task], args, f"{label}/τ={tau:g}", args.task,
                                    greedy=False)
                    # s_τ = #reset / #changed; D_rel of θ_τ shows how much of ‖Δ‖ the large coordinates carry
                    sparsity["taus"].append({"tau": tau, "s_tau": reset / changed if changed else 0.0, "reset": reset,
                                             "changed": changed, "d_rel": relative_drift(theta_tau, theta0),
                                             "pass@1": r["pass@k"][1], "correct_counts": r["correct_counts"]})
                report["sparsity"][label] = sparsity
                del theta  # fp32 copies: free them before the next model
    finally:
        if args.backend == "vllm":
            policy.close()

    # 4. intervals; write passk.json (per-problem counts: curves and intervals can be recomputed), passk.md, passk.png
    report["uncertainty"] = uncertainty(report, args.reference or first, args.resamples, args.seed)
    (run / "passk.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (run / "passk.md").write_text(table)
    print(table)
    plot(report, run / "passk.png")
    return run


if __name__ == "__main__":
    main(cli(Args))
