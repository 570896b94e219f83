"""Helpers shared by the bench/ scripts: random-init models of real architectures, fixed-length rollouts, machine
line, markdown tables. Plumbing only; each bench script holds its own measurement."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/x.py` from the repo root imports common, es, grpo

import torch  # noqa: E402

# Real architectures written out by hand from their published config.json (no download): random weights only.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
RANDOM_PREFIX = "random:"


def setup_threads(threads: Optional[int]) -> int:
    """Pin torch's intra-op threads (this CPU is shared: 2 cores); returns the number used."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def machine_line(device: str) -> str:
    """One line: CPU/GPU, torch version and threads, 1-minute load average (the machine is shared)."""
    load = os.getloadavg()
    what = torch.cuda.get_device_name() if device.startswith("cuda") else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    return (f"{what}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)")


def resolve_bench_model(name: str, folder: Path, layers: Optional[int], tokenizer: str) -> str:
    """A local model folder for `name`: what common.resolve_model takes, or 'random:<arch>': a random-init model of that architecture built
    from its config (seed 0), saved with the tokenizer from `tokenizer` (a model name or a tokenizer folder) to
    `folder` ('char': the tests' character-level tokenizer). The tokenizer's ids must fit the architecture's vocabulary (SmolLM2's 49152 < Qwen2.5's 151936)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from common import resolve_model

    if not name.startswith(RANDOM_PREFIX):
        return resolve_model(name)

    arch = name[len(RANDOM_PREFIX):]
    config = dict(RANDOM_CONFIGS[arch])
    if layers:
        config["num_hidden_layers"] = layers
    target = folder / f"{arch}-{config['num_hidden_layers']}l"
    if (target / "config.json").is_file():
        return str(target)
    if tokenizer == "char":  # no tokenizer files at hand (a bare GPU box): the tests' character-level one
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_tiny_model

        tokenizer = str(make_tiny_model(folder / "char-tokenizer"))
    tok = AutoTokenizer.from_pretrained(tokenizer if Path(tokenizer).is_dir() else resolve_model(tokenizer))
    if len(tok) > config["vocab_size"]:
        raise SystemExit(f"error: tokenizer has {len(tok)} ids, more than {arch}'s vocabulary {config['vocab_size']}")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising 1.5B on CPU is slow
        model = Qwen2ForCausalLM(Qwen2Config(**config, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.to(torch.bfloat16).save_pretrained(target)  # bf16 on disk: half the bytes; loaded in the bench's dtype
    tok.save_pretrained(target)
    return str(target)


def fixed_length(policy: Any) -> None:
    """Make generate() run exactly max_new_tokens for every sequence: no EOS can stop it (fixed work on both sides)."""
    policy.eos_ids = set()
    if hasattr(policy, "model"):
        policy.model.generation_config.eos_token_id = None


def param_count(policy: Any) -> int:
    return sum(p.numel() for p in policy.params.values()) if hasattr(policy, "params") else 0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Timer:
    """`with timer("name"):` adds the elapsed seconds (GPU synchronised) to timer.seconds["name"]."""

    def __init__(self, device: str):
        self.device, self.seconds, self._name = device, {}, None

    def __call__(self, name: str) -> "Timer":
        self._name = name
        return self

    def __enter__(self) -> None:
        sync(self.device)
        self._start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        sync(self.device)
        self.seconds[self._name] = self.seconds.get(self._name, 0.0) + time.perf_counter() - self._start


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats with 3 significant digits."""
    def cell(x: Any) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(lines: Sequence[str], out: Optional[str]) -> str:
    """Print the report and, if `out` is set, also write it there."""
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
    return text
