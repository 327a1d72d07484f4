"""A tiny pre-norm transformer encoder classifier, built locally (no download).

Tokens are feature vectors (e.g. the 8 rows of an 8×8 digit); the model
embeds them, adds a learned position embedding, runs ``layers`` blocks of
multi-head self-attention (``q``, ``k``, ``v``, ``o``) and an MLP (``up``,
``down``), mean-pools and classifies (``head``). The Linear layers inside the
blocks carry those short names so that adapters target them by name (PEFT's
``target_modules``, `stiefel.rotate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyEncoder", "BLOCK_LINEARS"]

#: the names of the Linear layers of one block (adapter targets)
BLOCK_LINEARS = ("q", "k", "v", "o", "up", "down")


class Block(nn.Module):
    """Pre-norm block: x + attention(LN(x)), then x + MLP(LN(x)) (GELU, width 2·d)."""

    def __init__(self, width: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, dtype=dtype)
        self.ln2 = nn.LayerNorm(width, dtype=dtype)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, dtype=dtype) for _ in range(4))
        self.up = nn.Linear(width, 2 * width, dtype=dtype)
        self.down = nn.Linear(2 * width, width, dtype=dtype)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        att = F.scaled_dot_product_attention(
            self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        )
        x = x + self.o(att.transpose(1, 2).reshape(x.shape))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyEncoder(nn.Module):
    """Embedding, ``layers`` pre-norm blocks, mean pooling, LayerNorm and a linear head.

    Args:
        features: size of each input token.
        tokens: sequence length (the position embedding's).
        classes: number of output classes.
        width: model width d (divisible by ``heads``).
        layers: number of blocks.
        heads: attention heads.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        features: int,
        tokens: int,
        classes: int,
        width: int = 32,
        layers: int = 2,
        heads: int = 4,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}")
        self.embed = nn.Linear(features, width, dtype=dtype)
        self.position = nn.Parameter(0.02 * torch.randn(tokens, width, dtype=dtype))
        self.blocks = nn.ModuleList(Block(width, heads, dtype) for _ in range(layers))
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.head = nn.Linear(width, classes, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h.mean(1)))
