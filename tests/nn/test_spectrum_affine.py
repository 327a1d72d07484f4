"""`singular_values` and `lipschitz_bound` refuse a layer that is not affine.

Reference: a ReLU after a convolution whose output is negative on positive impulses;
its "singular values" came out all zero (the conv alone has σ_max = 9) and its power
iteration a number, without an error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stiefel.nn import lipschitz_bound, singular_values


def _negative_conv() -> nn.Conv2d:
    conv = nn.Conv2d(1, 1, 3, padding=1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.fill_(-1.0)
    return conv


@pytest.mark.parametrize("measure", [singular_values, lipschitz_bound])
def test_a_nonlinear_layer_is_refused(measure):
    with pytest.raises(ValueError, match="not affine on inputs of shape \\(1, 4, 4\\)"):
        measure(nn.Sequential(_negative_conv(), nn.ReLU()), (1, 4, 4))


def test_an_affine_composition_is_measured_as_its_dense_matrix():
    conv, second = _negative_conv(), nn.Conv2d(1, 2, 3, padding=1, dtype=torch.float64)
    layer = nn.Sequential(conv, second)
    basis = torch.eye(16, dtype=torch.float64).reshape(16, 1, 4, 4)
    with torch.no_grad():
        dense = (
            (layer(basis) - layer(torch.zeros(1, 1, 4, 4, dtype=torch.float64))).reshape(16, -1).T
        )
    reference = torch.linalg.svdvals(dense)
    assert torch.allclose(singular_values(layer, (1, 4, 4)), reference, atol=1e-12)
    assert (
        abs(lipschitz_bound(layer, (1, 4, 4), iterations=500, rtol=0) - float(reference[0])) < 1e-6
    )


def test_an_affine_layer_with_a_large_offset_is_measured():
    # the check's tolerance had left out layer(0): a bias of 1e4 made a Linear "not affine"
    lin = nn.Linear(16, 16)
    with torch.no_grad():
        lin.bias.fill_(1e4)
    reference = float(torch.linalg.matrix_norm(lin.weight.detach().double(), 2))
    assert abs(float(singular_values(lin, (16,))[0]) - reference) < 1e-3 * reference
    assert abs(lipschitz_bound(lin, (16,), iterations=300, rtol=0) - reference) < 1e-3 * reference
