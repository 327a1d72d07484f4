"""The package's own work called inside an autocast region is the work outside it.

Note [Autocast off for the maps' own products]: inside ``torch.autocast(bfloat16)`` the
nearest point of `orthogonalize` ran in bfloat16 (a weight 3e-2 off its manifold, or a
refusal blaming a bad checkpoint), ``W.linear``/``W.operator()`` failed
(``householder``: no bfloat16 triangular solve) or came out 3e-2 off (``cwy``,
``tcwy``), and `rotation` of a butterfly came out in bfloat16, 3.5e-2 off. The
reference is the same call outside the region.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stiefel
from stiefel.parametrizations import maps


def _region():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("method", [*maps(), "riemannian"])
def test_orthogonalize_inside_a_region_starts_at_the_same_point(method):
    def build() -> nn.Linear:
        torch.manual_seed(0)
        return stiefel.orthogonalize(nn.Linear(16, 24), method=method)

    outside = build().weight.detach()
    with _region():
        inside = build().weight.detach()
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["householder", "cwy", "tcwy", "exp"])
def test_the_operator_form_inside_a_region_is_the_one_outside(method):
    torch.manual_seed(0)
    w = stiefel.orthogonalize(torch.randn(16, 16), method=method)
    x = torch.randn(5, 16)
    outside, one = w.linear(x), w.operator()(x[0])
    with _region():
        inside, step = w.linear(x), w.operator()(x[0])
    assert inside.dtype == step.dtype == torch.float32
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    torch.testing.assert_close(step, one, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["householder", "cwy", "tcwy", "exp", "cayley"])
def test_the_operator_form_takes_the_regions_bfloat16_activations(method):
    # the region's activations are bfloat16: the operator computes in the weight's dtype
    # and returns bfloat16 (it raised on mixed dtypes); the reference is float32 outside
    torch.manual_seed(0)
    w = stiefel.orthogonalize(torch.randn(16, 16), method=method)
    x = torch.randn(5, 16).bfloat16()
    outside = w.linear(x.float())
    with _region():
        inside = w.linear(x)
    assert inside.dtype == torch.bfloat16
    torch.testing.assert_close(inside, outside.bfloat16(), rtol=0, atol=0)


def test_the_dense_q_of_a_butterfly_inside_a_region_is_the_one_outside():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    lin.requires_grad_(False)
    stiefel.rotate(lin, method="cayley", blocks=4, butterfly=2)
    with torch.no_grad():
        for p in lin.rotation.parameters():
            p.add_(0.1 * torch.randn_like(p))
    outside = stiefel.rotation(lin)
    with _region():
        inside = stiefel.rotation(lin)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
