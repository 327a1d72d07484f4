"""Port of geotorch's test_orthogonal.py, test_stiefel.py and test_integration.py (their
orthogonal-manifold properties) to ``stiefel.orthogonalize``, for every map.

geotorch's properties, checked for every registered map on O(n), U(n) and real/complex
St(N, M), on Linear layers of every aspect (square, tall, wide, 1×1, 1×k, k×1) and on a
Conv2d (its weight a batch of kernel matrices):
- registering keeps the weight's size; the weight is orthogonal at the start and after
  SGD steps taken under ``parametrize.cached()``;
- assigning a sampled manifold point stores that point (geotorch's ``layer.weight = X``);
- re-basing at the current point (geotorch's ``update_base``; here ``layer.weight =
  layer.weight``, the map's right inverse of its own output) leaves the weight and the
  layer's output unchanged (float64 here; float32 after training is in pending/);
- two descriptions of the same constrained matrix evolve identically under the same
  SGD steps: a wide weight and its transposed tall weight (geotorch's Stiefel vs
  StiefelTall), a batch of matrices and the same matrices one by one, a module's weight
  and a bare tensor;
- a bad method name and a 1-D tensor raise ValueError.

Deliberate convention differences, asserted (geotorch's behaviour documented):
geotorch's SO(n) and its ``uniform_init_``/``torus_init_`` give det = +1; O(n) here has
both components and the default initialisation is the nearest point (polar factor), so
a weight whose polar factor has det = −1 keeps det = −1, and assigning a det = −1 point
works. geotorch's custom trivialization (a callable) corresponds to a user
``OrthogonalMap`` class passed as ``method``: pending/test_custom_map.py.
"""

from __future__ import annotations

import pytest
import torch
from _interop_cases import (
    MANIFOLDS,
    dtype_of,
    eps_tol,
    manifold,
    maps,
    orth_err,
    polar,
    randn,
    shape_of,
)
from torch import nn
from torch.nn.utils import parametrize

from stiefel import optimizers, orthogonalize

LINEAR_SHAPES = [(5, 3), (3, 5), (4, 4), (1, 1), (1, 4), (4, 1)]  # weight (rows, cols)


def assert_orthogonal(w: torch.Tensor, factor: float = 10.0) -> None:
    n = max(w.shape[-2:])
    assert orth_err(w) <= eps_tol(w.dtype, n, factor), orth_err(w)


def sgd_steps(layer: nn.Module, x: torch.Tensor, steps: int = 3, lr: float = 0.1):
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    for _ in range(steps):
        with parametrize.cached():
            loss = layer(x).abs().sum()
            assert_orthogonal(layer.weight, 100.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert_orthogonal(layer.weight, 100.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("size", LINEAR_SHAPES, ids=str)
@pytest.mark.parametrize("method", maps())
def test_linear_stays_orthogonal(method, size, dtype):
    torch.manual_seed(8888)
    layer = nn.Linear(size[1], size[0], dtype=dtype)
    old = layer.weight.shape
    orthogonalize(layer, "weight", method=method)
    assert layer.weight.shape == old
    assert_orthogonal(layer.weight)
    sgd_steps(layer, torch.rand(3, size[1], dtype=dtype))


@pytest.mark.parametrize("kernel", [(3, 2), (2, 3), (2, 2)], ids=str)
@pytest.mark.parametrize("method", maps())
def test_conv2d_batch_of_kernels_stays_orthogonal(method, kernel):
    torch.manual_seed(8888)
    layer = nn.Conv2d(3, 2, kernel)
    old = layer.weight.shape
    orthogonalize(layer, "weight", method=method)
    assert layer.weight.shape == old
    assert_orthogonal(layer.weight)
    sgd_steps(layer, torch.rand(2, 3, kernel[0] + 4, kernel[1] + 3))


@pytest.mark.parametrize("case", list(MANIFOLDS))
@pytest.mark.parametrize("method", maps())
def test_assign_sample_then_train_then_rebase(method, case):
    """geotorch's test_integration: X sampled on the manifold, ``layer.weight = X`` gives
    X; SGD keeps the weight on the manifold; ``update_base`` changes nothing."""
    dtype, (n, m) = dtype_of(case), shape_of(case)
    torch.manual_seed(8888)
    layer = nn.Linear(m, n, dtype=dtype)
    orthogonalize(layer, "weight", method=method)
    man = manifold(case)
    x_sample = man.random(dtype=dtype, generator=torch.Generator().manual_seed(1))
    layer.weight = x_sample
    with parametrize.cached():
        assert layer.weight.shape == (n, m)
        torch.testing.assert_close(layer.weight.detach(), x_sample, atol=1e-12, rtol=0.0)
    inp = torch.rand(4, m, dtype=dtype)
    sgd_steps(layer, inp)
    assert man.check_point_on_manifold(layer.weight.detach())
    with torch.no_grad():
        w_old, out_old = layer.weight.clone(), layer(inp)
        layer.weight = layer.weight  # geotorch.utils.update_base
        torch.testing.assert_close(layer.weight, w_old, atol=1e-12, rtol=0.0)
        torch.testing.assert_close(layer(inp), out_old, atol=1e-12, rtol=0.0)


@pytest.mark.parametrize("case", ["stiefel_real", "stiefel_complex"])
@pytest.mark.parametrize("method", maps())
def test_wide_and_transposed_tall_evolve_identically(method, case):
    """geotorch's Stiefel vs StiefelTall: the wide weight A and the tall weight Aᵀ, with
    losses f(W) and f(Vᵀ), stay transposes of each other under the same SGD steps."""
    dtype = dtype_of(case)
    a = randn(shape_of(case)[::-1], dtype, 3)  # wide
    wide, tall_ = orthogonalize(a, method=method), orthogonalize(a.mT.clone(), method=method)
    target = randn(a.shape, dtype, 4)
    opts = [torch.optim.SGD(w.parameters(), lr=0.1) for w in (wide, tall_)]
    for _ in range(3):
        for w, opt, t in ((wide, opts[0], False), (tall_, opts[1], True)):
            q = w().mT if t else w()
            opt.zero_grad()
            (q - target).abs().pow(2).sum().backward()
            opt.step()
    tol = 1e3 * torch.finfo(dtype).eps
    torch.testing.assert_close(wide().detach(), tall_().mT.detach(), atol=tol, rtol=0.0)


@pytest.mark.parametrize("case", list(MANIFOLDS))
@pytest.mark.parametrize("method", maps())
def test_batch_and_single_matrices_evolve_identically(method, case):
    """A batch of 2 matrices trains exactly like the 2 matrices one by one, and a module's
    parametrized weight exactly like the bare tensor (geotorch: the parametrizations of a
    matrix agree pairwise)."""
    dtype = dtype_of(case)
    a = randn((2, *shape_of(case)), dtype, 5)
    target = randn(a.shape, dtype, 6)
    batch = orthogonalize(a, method=method)
    singles = [orthogonalize(a[i].clone(), method=method) for i in range(2)]
    lin = nn.Linear(a.shape[-1], a.shape[-2], bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(a[0])
    orthogonalize(lin, "weight", method=method)
    mods = [batch, *singles, lin]
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in mods]
    outs = [lambda: batch(), lambda: singles[0](), lambda: singles[1](), lambda: lin.weight]
    tgts = [target, target[0], target[1], target[0]]
    for _ in range(3):
        for opt, out, t in zip(opts, outs, tgts, strict=True):
            opt.zero_grad()
            (out() - t).abs().pow(2).sum().backward()
            opt.step()
    tol = 1e3 * torch.finfo(dtype).eps
    with torch.no_grad():
        for i in range(2):
            torch.testing.assert_close(batch()[i], singles[i](), atol=tol, rtol=0.0)
        torch.testing.assert_close(lin.weight, singles[0](), atol=tol, rtol=0.0)


@pytest.mark.parametrize("size", [(5, 3), (4, 4)], ids=str)
def test_riemannian_layer_stays_orthogonal(size):
    """geotorch trains with any torch optimizer; ``method="riemannian"`` trains with ours."""
    torch.manual_seed(8888)
    layer = nn.Linear(size[1], size[0])
    orthogonalize(layer, "weight", method="riemannian")
    assert layer.weight.shape == size
    assert_orthogonal(layer.weight)
    opt = optimizers.create("rgd", layer.parameters(), lr=0.1)
    x = torch.rand(3, size[1])
    for _ in range(3):
        opt.zero_grad()
        layer(x).sum().backward()
        opt.step()
        assert_orthogonal(layer.weight, 100.0)


@pytest.mark.parametrize("method", maps())
def test_constructor_errors(method):
    layer = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=method):  # the message lists the maps
        orthogonalize(layer, "weight", method="wrong")
    with pytest.raises(ValueError):
        orthogonalize(layer, "bias", method=method)  # a vector, not a matrix
    with pytest.raises(ValueError):
        orthogonalize(torch.randn(7), method=method)
    assert not parametrize.is_parametrized(layer)


# ---------------------------------------------------------------- conventions (asserted)
@pytest.mark.parametrize("method", maps())
def test_convention_both_components_of_o_n(method):
    """geotorch's SO(n) initialisers give det = +1. Here the default initialisation is the
    nearest point, which keeps det = −1 for a weight whose polar factor has it, and a
    det = −1 point can be assigned."""
    w = randn((4, 4), torch.float64, 7)
    if float(torch.linalg.det(polar(w))) > 0:
        w[0] = -w[0]
    assert float(torch.linalg.det(polar(w))) < 0
    q = orthogonalize(w, method=method)
    torch.testing.assert_close(q().detach(), polar(w), atol=1e-10, rtol=0.0)
    assert float(torch.linalg.det(q().detach())) == pytest.approx(-1.0, abs=1e-10)
    layer = nn.Linear(4, 4, dtype=torch.float64)
    orthogonalize(layer, "weight", method=method)
    reflect = polar(randn((4, 4), torch.float64, 8))
    reflect = reflect if float(torch.linalg.det(reflect)) < 0 else reflect.flip(0)
    layer.weight = reflect
    torch.testing.assert_close(layer.weight.detach(), reflect, atol=1e-10, rtol=0.0)


@pytest.mark.parametrize("case", list(MANIFOLDS))
@pytest.mark.parametrize("method", maps())
def test_initialisations_land_on_the_manifold(method, case):
    """geotorch's ``uniform_init_``/``torus_init_`` counterparts: ``init="haar"``,
    ``"identity"`` ([I; 0]) and ``"random"`` give points of the manifold."""
    dtype, shape = dtype_of(case), shape_of(case)
    w = randn(shape, dtype, 9)
    gen = torch.Generator().manual_seed(0)
    for init in ("haar", "identity", "random"):
        q = orthogonalize(w, method=method, init=init, generator=gen)()
        assert_orthogonal(q)
        if init == "identity":
            eye = torch.eye(*shape, dtype=dtype)
            torch.testing.assert_close(q.detach(), eye, atol=1e-12, rtol=0.0)
