"""torch modules change dtype with ``.double()``; a
float32-trained Riemannian weight converted to float64 must still be accepted by the
Riemannian optimizers (issue 13, item 6: "the default tolerance after .double() must not
reject a float32-trained point"). Today ``create("rgd", …)`` raises ValueError:
‖XᴴX − I‖_F ≈ 1e-6 exceeds the float64 tolerance 2.2e-13.
"""

from __future__ import annotations

import pytest
import torch
from _interop_cases import eps_tol, orth_err
from torch import nn

from stiefel import optimizers, orthogonalize


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_float32_riemannian_weight_then_double(name):
    torch.manual_seed(0)
    layer = orthogonalize(nn.Linear(3, 10), method="riemannian")
    opt = optimizers.create(name, layer.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for _ in range(3):
        opt.zero_grad()
        layer(x).sum().backward()
        opt.step()
    layer = layer.double()
    opt = optimizers.create(name, layer.parameters(), lr=0.1)
    opt.zero_grad()
    layer(x.double()).sum().backward()
    opt.step()
    assert orth_err(layer.weight) <= eps_tol(torch.float32, 10, 100.0)
