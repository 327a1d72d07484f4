"""geotorch's "the layer stays in the manifold while being optimised" (test_integration.py,
_test_training), pushed to runs whose free parameters grow large, in float32 (issue 13,
item 1). A map must return a point on the manifold (to 100·n·eps) for every finite free
parameter, never a silently non-orthogonal or NaN weight.

Before the fix (float32): ``exp`` lost orthogonality as ‖A‖ grew (1e-3 at entries ~1e3,
4e-2 at ~1e5, NaN at ~1e10; Padé squarings), ``householder`` returned NaN at entries ~1e20
(‖v‖² overflowed), and after five SGD steps with lr = 1 on Conv2d(8, 4, 3) ``cayley`` /
``scaled_cayley`` weights were off O(3) by 3e-3–1e-2 (cond(I + A)·eps). See
Note [Large skew-Hermitian matrices go through eigh] and
Note [Reflection vectors scaled by their max-abs].
"""

from __future__ import annotations

import pytest
import torch
from _interop_cases import eps_tol, maps, orth_err
from torch import nn

SCALES = [1e1, 1e3, 1e5, 1e10, 1e20]


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:.0e}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=str)
@pytest.mark.parametrize("shape", [(6, 6), (6, 3)], ids=str)
@pytest.mark.parametrize("method", maps())
def test_map_output_on_manifold_for_large_free_parameters(method, shape, dtype, scale):
    from stiefel import orthogonalize

    torch.manual_seed(0)
    w = orthogonalize(torch.randn(*shape, dtype=dtype), method=method)
    original = w.parametrizations.weight.original
    with torch.no_grad():
        original.copy_(torch.randn_like(original) * scale)
        q = w()
    assert bool(torch.isfinite(q).all())
    assert orth_err(q) <= eps_tol(torch.float32, max(shape), 100.0)


@pytest.mark.parametrize("method", maps())
def test_divergent_training_keeps_conv_kernels_orthogonal(method):
    from stiefel import orthogonalize

    torch.manual_seed(0)
    layer = nn.Conv2d(8, 4, 3)
    orthogonalize(layer, "weight", method=method)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    x = torch.randn(2, 8, 6, 6)
    for _ in range(5):
        opt.zero_grad()
        layer(x).pow(2).sum().backward()
        opt.step()
    with torch.no_grad():
        w = layer.weight
    assert bool(torch.isfinite(w).all())
    assert orth_err(w) <= eps_tol(torch.float32, 3, 100.0)
