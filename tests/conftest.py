"""Shared fixtures: small random-weight HF models (Qwen3, Llama) and the bundled zoo models."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark.api import load_causal_lm
from dspark.target import CausalLM
from dspark.zoo import default_target_path, zoo_dir

VOCAB = 96


def tiny_qwen3(layers: int = 3, hidden: int = 64, vocab: int = VOCAB, seed: int = 0) -> Qwen3ForCausalLM:
    """A random-weight Qwen3 causal LM in float32."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
    )
    cfg.eos_token_id = None
    return Qwen3ForCausalLM(cfg).eval()


def tiny_llama(layers: int = 3, hidden: int = 64, vocab: int = VOCAB, seed: int = 1) -> LlamaForCausalLM:
    """A random-weight Llama causal LM in float32."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    cfg.eos_token_id = None
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def qwen3_target() -> CausalLM:
    return CausalLM(tiny_qwen3())


@pytest.fixture(scope="session")
def llama_target() -> CausalLM:
    return CausalLM(tiny_llama())


@pytest.fixture(scope="session")
def bundled_target() -> CausalLM:
    """The bundled target in float32 (greedy-identity tests run in float32)."""
    path = default_target_path()
    if not (path / "config.json").exists():
        pytest.fail(f"the bundled target is missing at {path}; run scripts/build_zoo.sh")
    return load_causal_lm(path, "float32")


@pytest.fixture(scope="session")
def bundled_draft(bundled_target) -> CausalLM:
    return load_causal_lm(zoo_dir() / "draft-model", "float32")
