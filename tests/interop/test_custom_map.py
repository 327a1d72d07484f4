"""geotorch's custom trivialization (test_orthogonal.py,
``_test_custom_trivialization``: a user-supplied map registered on a Linear layer, trained
with SGD, orthogonal at every step). Here a user ``OrthogonalMap`` subclass passed as
``method=`` (``method`` may also be an `OrthogonalMap` subclass), without
registering it. Today ``orthogonalize`` accepts names only:
ValueError "method=<class ...> is not allowed".
"""

from __future__ import annotations

import torch
from _interop_cases import eps_tol, orth_err
from torch import nn
from torch.nn.utils import parametrize

from stiefel import orthogonalize
from stiefel.parametrizations import OrthogonalMap


class UserCayley(OrthogonalMap):
    """Q = (I + A)⁻¹(I − A)[:, :m] with A = X − Xᴴ (X the free n×n parameter)."""

    def matrix(self, original):
        a = original - original.mH
        eye = torch.eye(self.n, dtype=a.dtype, device=a.device)
        return torch.linalg.solve(eye + a, eye - a)[..., : self.m]

    def inverse(self, q):
        """The original of [I; 0] (the one point this test assigns): zero."""
        eye = torch.eye(self.n, self.m, dtype=q.dtype, device=q.device).expand_as(q)
        if not torch.allclose(q, eye):
            raise ValueError("UserCayley.inverse is written for [I; 0] only")
        return torch.zeros(*self.batch, self.n, self.n, dtype=q.dtype, device=q.device)


def test_custom_map_class_as_method():
    layer = nn.Linear(5, 3)
    orthogonalize(layer, "weight", method=UserCayley, init="identity")
    assert isinstance(layer.parametrizations.weight[0], UserCayley)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.rand(5, layer.in_features)
    for _ in range(2):
        with parametrize.cached():
            assert orth_err(layer.weight) <= eps_tol(torch.float32, 5, 100)
            loss = layer(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert orth_err(layer.weight) <= eps_tol(torch.float32, 5, 100)
