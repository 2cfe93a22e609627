"""Small random Hugging Face checkpoints for the tests, made with transformers itself (no hub download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# Llama 3's scaling with a short original context, so that the scaled band covers frequencies a 16-token
# sequence actually uses (with Llama-3.2's 8192 it would change nothing here).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}


def make_config(family: str, **over: Any):
    """A transformers config of ``family`` (llama, qwen2, mistral) at :data:`SMALL`'s size."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    base: dict[str, Any] = dict(SMALL)
    if family == "llama":
        base.update(rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling=dict(LLAMA3_ROPE))
    if family == "mistral":
        base.update(sliding_window=None)
    base.update(over)
    return cls(**base)


def save_random(folder: Path, family: str, seed: int = 0, shard: str | None = None, **over: Any):
    """A model of ``family`` with every parameter (biases and norms too) random, saved to ``folder``; returns it.

    transformers initialises biases at 0 and norms at 1; a mapping that put a bias or a
    norm in the wrong place would go unseen, so every tensor is moved away from those.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **over)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return model
