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


PHASED = ["householder", "cwy", "tcwy", "scaled_cayley"]  # complex maps with trainable phases


def _unitary_error(w: torch.Tensor) -> float:
    w = w.detach().to(torch.complex128)
    return float((w.mH @ w - torch.eye(w.shape[-1], dtype=w.dtype)).norm())


@pytest.mark.parametrize("name", PHASED)
def test_a_complex_model_cast_to_complex128_keeps_its_phases_real(name):
    # module.to(torch.complex128) casts every floating tensor to complex, the phases θ
    # too; the map then failed ("Expected both inputs to be Half, Float or Double")
    torch.manual_seed(0)
    lin = orthogonalize(torch.nn.Linear(5, 5, bias=False, dtype=torch.complex64), method=name)
    with torch.no_grad():
        lin.parametrizations.weight[0].phases.uniform_(-3, 3)
    before = lin.weight.detach()
    lin.to(torch.complex128)
    phases = lin.parametrizations.weight[0].phases
    assert phases.dtype == torch.float64 and isinstance(phases, torch.nn.Parameter)
    w = lin.weight
    assert w.dtype == torch.complex128
    assert torch.allclose(w.detach(), before.to(torch.complex128), atol=1e-5)
    assert _unitary_error(w) < 100 * 5 * torch.finfo(torch.float64).eps
    w.abs().square().mul(torch.arange(5.0, dtype=torch.float64)).sum().backward()
    assert phases.grad.dtype == torch.float64 and torch.isfinite(phases.grad).all()


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", PHASED)
def test_a_complex_model_lowered_by_half_computes_its_phases_in_float32(name, low):
    # module.half() leaves the complex64 weight and lowers its real phases: the map
    # computes them in float32 (torch.polar has no half kernel; the map raised)
    torch.manual_seed(0)
    lin = orthogonalize(torch.nn.Linear(5, 5, bias=False, dtype=torch.complex64), method=name)
    with torch.no_grad():
        lin.parametrizations.weight[0].phases.uniform_(-3, 3)
    lin.half() if low == torch.float16 else lin.bfloat16()  # .to(low) would cast the weight
    phases = lin.parametrizations.weight[0].phases
    assert phases.dtype == low
    w = lin.weight
    assert w.dtype == torch.complex64
    assert _unitary_error(w) < 100 * 5 * torch.finfo(torch.float32).eps
    # the reference: the same phases, read in float32, through the same map
    reference = orthogonalize(torch.nn.Linear(5, 5, bias=False, dtype=torch.complex64), method=name)
    with torch.no_grad():
        reference.parametrizations.weight.original.copy_(lin.parametrizations.weight.original)
        reference.parametrizations.weight[0].phases.copy_(phases.float())
    assert torch.allclose(w.detach(), reference.weight.detach(), atol=1e-6)
    w.abs().square().mul(torch.arange(5.0)).sum().backward()
    assert phases.grad.dtype == low and torch.isfinite(phases.grad).all()
