"""float16 / bfloat16 weights: every map computes in float32 and stores the weight's dtype."""

import math

import pytest
import torch

from stiefel.parametrizations import maps, orthogonalize

LOW = [torch.bfloat16, torch.float16]


def err64(w):
    w = w.detach().cpu().double()
    w = w.mT if w.shape[-2] < w.shape[-1] else w
    return float(torch.linalg.matrix_norm(w.mT @ w - torch.eye(w.shape[-1], dtype=w.dtype)).max())


def bound(dtype, m):
    return math.sqrt(m) * torch.finfo(dtype).eps  # ‖QᴴQ − I‖_F of a stored low-precision weight


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", list(maps()))
def test_low_precision_weight_on_the_manifold_and_trainable(name, dtype, device):
    torch.manual_seed(0)
    lin = orthogonalize(torch.nn.Linear(24, 16).to(device=device, dtype=dtype), method=name)
    original = lin.parametrizations.weight.original
    assert lin.weight.dtype == dtype and original.dtype == dtype
    assert lin.weight.device.type == device and original.device.type == device
    assert err64(lin.weight) <= bound(dtype, 16)
    # the map computed under autocast (on the weight's device) still runs in float32
    with torch.autocast(device, dtype=torch.bfloat16):
        under = lin.weight
    assert torch.equal(under, lin.weight)  # autocast does not lower the map's products
    opt = torch.optim.SGD(lin.parameters(), lr=1e-2)
    lin(torch.randn(4, 24, dtype=dtype).to(device)).float().pow(2).sum().backward()
    assert original.grad is not None and original.grad.dtype == dtype
    opt.step()
    assert err64(lin.weight) <= bound(dtype, 16)
    lin.weight = lin.weight  # a stored low-precision weight is assignable back
    assert err64(lin.weight) <= bound(dtype, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", list(maps()))
def test_module_dtype_conversions(name, dtype):
    """model.to(dtype) / .half() / .bfloat16() after orthogonalize keep a valid weight."""
    lin = orthogonalize(torch.nn.Linear(12, 12), method=name)
    lin.to(dtype)
    assert lin.weight.dtype == dtype
    if dtype == torch.float64:  # Note [Changing the dtype of a based map]: re-store once
        lin.weight = lin.weight
    assert err64(lin.weight) <= max(bound(dtype, 12), 100 * 12 * torch.finfo(dtype).eps)
