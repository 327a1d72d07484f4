"""Tiny models built from local configs (nothing is downloaded), shared by the test suites."""

from __future__ import annotations

import pytest
import torch

#: a one-layer Llama small enough for a unit test: 32 tokens, hidden 16
TINY_LLAMA = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=16,
)


def tiny_llama(seed: int | None = 0, **config) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of `TINY_LLAMA`'s sizes (``config`` overrides them), drawn
    after ``torch.manual_seed(seed)`` (None: from the current generator); skips the test
    without transformers."""
    transformers = pytest.importorskip("transformers")
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **config}))
