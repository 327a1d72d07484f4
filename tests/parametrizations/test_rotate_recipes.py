"""`rotate` under autocast and on unbatched convolution input (torch's standard recipes).

References: Q's orthogonality to 10·n·eps(float32); the gradient of one forward taken
with ``backward()`` outside autocast (the autograd Functions' backward must not run
in bfloat16 when called inside); the batched convolution's output for its one sample.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stiefel import rotate

BF16 = torch.bfloat16


def _moved(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.rotation.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


@pytest.mark.parametrize("method", ["cayley", "exp", "cwy", "householder"])
def test_q_is_float32_under_bfloat16_autocast(method):
    # Note [Autocast off for the maps' own products]: the rotated rows of the identity are
    # Qᵀ; bfloat16 products had left max |QᵀQ − I| about 4e-3
    torch.manual_seed(0)
    lin = _moved(rotate(nn.Linear(64, 64), method=method, blocks=4))
    seen = []
    lin.register_forward_pre_hook(lambda m, args: seen.append(args[0]))  # after rotate's
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        lin(torch.eye(64))
    q = seen[0].double()
    assert seen[0].dtype == torch.float32
    error = float((q @ q.T - torch.eye(64, dtype=q.dtype)).abs().max())
    assert error < 10 * 64 * torch.finfo(torch.float32).eps


# the maps with an autograd Function of this package: exp (Padé), householder (blocked
# reflections), cayley on n > kernels' pivot block with a small ‖A‖ (unpivoted solve)
FUNCTIONS = [("exp", 64, 2), ("householder", 64, 2), ("cayley", 2 * 128 + 64, 1)]


@pytest.mark.parametrize(("method", "n", "blocks"), FUNCTIONS)
def test_backward_called_inside_autocast_runs(method, n, blocks):
    # torch advises backward() outside autocast, where it takes the forward's dtypes; inside,
    # torch's own backward ops run in bfloat16 and so may differ by bfloat16's rounding, but
    # the Functions' backward runs with autocast off, as their forward (custom_bwd): `exp`'s
    # had raised "lu_solve: Expected LU and B to have the same dtype (Float and BFloat16)"
    grads = []
    for inside in (True, False):
        torch.manual_seed(0)
        lin = nn.Linear(n, 8)
        lin.requires_grad_(False)
        rotate(lin, method=method, blocks=blocks)
        with torch.no_grad():
            for p in lin.rotation.parameters():
                p.mul_(0.01)  # a small ‖A‖: cayley takes its unpivoted solve
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=BF16):
            loss = lin(x).float().square().sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([p.grad.clone() for p in lin.rotation.parameters()])
    for inside, outside in zip(*grads, strict=True):
        assert torch.isfinite(inside).all()
        scale = float(outside.abs().max())
        assert float((inside - outside).abs().max()) <= 16 * torch.finfo(BF16).eps * scale


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize(("conv", "shape"), [(nn.Conv1d, (8, 8)), (nn.Conv2d, (8, 8, 8))])
def test_unbatched_convolution_input_rotates_the_channels(conv, shape, side):
    # torch's convolutions take (C, L) and (C, H, W); the rotation had mapped axis 1 (L or H),
    # silently wrong when that size equals the channels
    torch.manual_seed(0)
    layer = _moved(rotate(conv(8, 8, 3, padding=1), method="cayley", blocks=2, side=side))
    x = torch.randn(shape)
    with torch.no_grad():
        assert torch.allclose(layer(x), layer(x[None])[0], atol=1e-6)
