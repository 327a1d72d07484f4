"""OrthoConv2d's kernel construction: a fixed number of ATen ops, the per-factor kernel's values."""

from __future__ import annotations

import copy
import importlib
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from stiefel.nn import OrthoConv2d, OrthoConvTranspose2d
from stiefel.nn.orthokernel import projector_chain, projector_step

ROOT = pathlib.Path(__file__).resolve().parents[2]
DT = torch.float64
#: ops of one forward+backward of the projector steps (the per-factor steps take 228 at k = 3)
CHAIN_BOUND = 160
#: ops of one forward+backward of a whole cwy kernel (the per-factor steps take 428 at k = 3)
KERNEL_BOUND = 360


@pytest.fixture(scope="module")
def counter():
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("benchmarks.launch").StepCounter
    finally:
        sys.path.remove(str(ROOT))


def per_factor_steps(isometry: torch.Tensor, projectors: torch.Tensor) -> torch.Tensor:
    """The reference: one `projector_step` per factor, width then height, in turn."""
    kernel = isometry[..., None, None]
    for j in range(projectors.shape[1] // 2):
        kernel = projector_step(kernel, projectors[:, 2 * j], -1)
        kernel = projector_step(kernel, projectors[:, 2 * j + 1], -2)
    return kernel


def _factors(k: int, c: int = 8, g: int = 1):
    torch.manual_seed(k)
    h = torch.linalg.qr(torch.randn(g, c, c, dtype=DT)).Q.requires_grad_()
    v = torch.linalg.qr(torch.randn(g, 2 * (k - 1), c, c // 2, dtype=DT)).Q.requires_grad_()
    return h, v


def _count(counter, fn) -> int:
    fn()  # warm-up: first calls may dispatch one-off ops
    with counter() as c:
        fn()
    return c.ops


@pytest.mark.parametrize("k", [2, 3, 4, 7])
def test_projector_chain_equals_the_per_factor_steps(k):
    h, v = _factors(k, c=6, g=2)
    ref = per_factor_steps(h, v)
    out = projector_chain(h, v)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= 100 * torch.finfo(DT).eps
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), (h, v))
    g_out = torch.autograd.grad((out * w).sum(), (h, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert (a - b).abs().max() <= 100 * torch.finfo(DT).eps


def test_projector_steps_dispatch_a_fixed_number_of_ops(counter):
    counts, reference = [], []
    for k in (3, 5, 7):
        h, v = _factors(k)
        counts.append(_count(counter, lambda h=h, v=v: projector_chain(h, v).sum().backward()))
        reference.append(_count(counter, lambda h=h, v=v: per_factor_steps(h, v).sum().backward()))
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0] <= CHAIN_BOUND < reference[0], (counts, reference)
    assert reference[0] < reference[1] < reference[2]  # the per-factor steps grow with k


def test_kernel_construction_ops_do_not_grow_with_the_kernel_size(counter):
    counts = []
    for k in (3, 5):
        layer = OrthoConv2d(8, 8, k, bias=False)
        counts.append(_count(counter, lambda layer=layer: layer.kernel().sum().backward()))
    assert counts[0] == counts[1] <= KERNEL_BOUND, counts


def _reference_forward(layer, x64: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer in float64 with its kernel from the per-factor steps: output, parameter grads."""
    ref = copy.deepcopy(layer).double()
    kern = ref.kernel
    weight = per_factor_steps(kern.isometry, kern.projectors)
    if kern.plan["transpose"]:
        weight = weight.transpose(1, 2)
    weight = weight.reshape(kern.weight_shape)
    y = F.conv2d(F.pad(x64, layer.pads, mode="circular"), weight, None, 1, 0, 1, layer.groups)
    return y, ref


@pytest.mark.parametrize("cfg", [(4, 4, 3, 1), (3, 5, 3, 1), (6, 4, 4, 2), (4, 4, 5, 1)])
def test_layer_output_and_gradients_match_the_float64_per_factor_layer(cfg):
    ci, co, k, groups = cfg
    torch.manual_seed(0)
    layer = OrthoConv2d(ci, co, k, groups=groups, bias=False)
    x = torch.randn(2, ci, 8, 8)
    w = torch.randn(2, co, 8, 8, dtype=DT)
    y = layer(x)
    (y.double() * w).sum().backward()
    y_ref, ref = _reference_forward(layer, x.double())
    (y_ref * w).sum().backward()
    tol = 10 * ci * k * k * torch.finfo(torch.float32).eps
    assert (y.double() - y_ref).abs().max() <= tol * y_ref.abs().max()
    grads = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        g, g_ref = p.grad.double(), grads[name].grad
        assert (g - g_ref).abs().max() <= tol * max(1.0, float(g_ref.abs().max())), name


def test_transposed_and_strided_layers_are_unchanged_by_the_batched_steps():
    """The strided and transposed layers share the kernel: their kernels against the steps."""
    torch.manual_seed(1)
    for layer in (
        OrthoConv2d(4, 8, 4, stride=2, bias=False, dtype=DT),
        OrthoConvTranspose2d(8, 4, 3, bias=False, dtype=DT),
    ):
        kern = layer.kernel
        bcop = per_factor_steps(kern.isometry, kern.projectors)
        got = projector_chain(kern.isometry, kern.projectors)
        assert (got - bcop).abs().max() <= 100 * torch.finfo(DT).eps
        assert layer.weight.shape == kern.weight_shape
