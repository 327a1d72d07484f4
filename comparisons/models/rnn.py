"""The LSTM baseline of the sequence tasks.

The orthogonal/unitary recurrent layers live in `stiefel.nn`; they are
re-exported here so the harness keeps importing them from ``comparisons.models``.
"""

from __future__ import annotations

import torch
from torch import nn

from ...nn import ModReLU, OrthogonalRNN, henaff_init

__all__ = ["ModReLU", "OrthogonalRNN", "LSTMBaseline", "henaff_init"]


class LSTMBaseline(nn.Module):
    """The LSTM baseline (forget-gate bias 1, as in the scaled Cayley paper's settings)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lstm = nn.LSTM(n_in, n_hidden, batch_first=True, dtype=dtype)
        with torch.no_grad():
            for name, p in self.lstm.named_parameters():
                if name.startswith("bias"):
                    p.zero_()
                    p[n_hidden : 2 * n_hidden] = 0.5  # two biases add up to 1
        self.out = nn.Linear(n_hidden, n_out, dtype=dtype)

    def forward(self, x: torch.Tensor, all_steps: bool = False) -> torch.Tensor:
        hs, _ = self.lstm(x.to(self.out.weight.dtype))
        y = self.out(hs)
        return y if all_steps else y[:, -1]
