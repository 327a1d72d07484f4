"""Port of torch's ``test_orthogonal_parametrization`` and ``test_orthogonal_errors``
(pytorch test/nn/test_parametrization.py) to ``stiefel.orthogonalize``, for every map.

torch's properties, each checked here for every registered map on a Linear layer of
shape square / tall / wide, float32 and complex64: the weight keeps its shape and is
orthogonal to 10·n·eps; assigning an orthogonal matrix stores exactly it; training with
SGD gives the free parameter a finite gradient and keeps the weight orthogonal; an
unknown method, a 1-D tensor and a wrongly shaped assignment raise ValueError.

Deliberate convention differences, asserted (torch's behaviour documented):
- initialisation: ours is the nearest point, the polar factor U Vᴴ of W; torch's is the Q
  factor of W's QR decomposition (R with a positive diagonal), a different point;
- assigning a non-orthogonal matrix: torch stores the Q factor of its QR; ours raises
  ValueError pointing to ``projx`` (the nearest point) and leaves the weight unchanged;
- complex weights: torch's ``householder`` refuses them; every map here serves them;
- ``method="riemannian"`` (no parametrization: the weight becomes a manifold parameter)
  accepts square and tall weights only (Note [Riemannian weights must be tall]).
"""

from __future__ import annotations

import pytest
import torch
from _interop_cases import eps_tol, maps, orth_err, polar, qr_q
from torch import nn
from torch.nn.utils import parametrize

from stiefel import optimizers, orthogonalize

SHAPES = {"square": (4, 4), "tall": (5, 3), "wide": (3, 5)}  # (rows, cols) of the weight
DTYPES = {"float32": torch.float32, "complex64": torch.complex64}


def linear(shape, dtype, seed=0):
    torch.manual_seed(seed)
    rows, cols = shape
    return nn.Linear(cols, rows, dtype=dtype)


def assert_orthogonal(w: torch.Tensor) -> None:
    n = max(w.shape[-2:])
    assert orth_err(w) <= eps_tol(w.dtype, n), orth_err(w)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", maps())
def test_orthogonal_parametrization(method, shape, dtype):
    dtype, shape = DTYPES[dtype], SHAPES[shape]
    m = linear(shape, dtype)
    w_init = m.weight.detach().clone()
    orthogonalize(m, "weight", method=method)
    # forward works: same shape, orthogonal
    assert m.weight.shape == w_init.shape and m.weight.dtype == dtype
    assert_orthogonal(m.weight)
    # convention: the nearest point (polar factor), not torch's QR factor
    torch.testing.assert_close(m.weight.detach(), polar(w_init), atol=1e-5, rtol=0.0)
    assert float((polar(w_init) - qr_q(w_init)).abs().max()) > 1e-2
    # assigning an orthogonal matrix stores it
    w_new = qr_q(torch.randn_like(w_init))
    m.weight = w_new
    torch.testing.assert_close(m.weight.detach(), w_new, atol=1e-5, rtol=0.0)
    # convention: a non-orthogonal matrix is refused (torch would store its QR factor)
    before = m.parametrizations.weight.original.detach().clone()
    with pytest.raises(ValueError, match="projx"):
        m.weight = torch.randn_like(w_init)
    torch.testing.assert_close(m.parametrizations.weight.original.detach(), before)
    torch.testing.assert_close(m.weight.detach(), w_new, atol=1e-5, rtol=0.0)
    # SGD keeps it orthogonal; the free parameter gets a finite gradient
    x = torch.randn(3, shape[1], dtype=dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        m(x).norm().backward()
        grad = m.parametrizations.weight.original.grad
        assert grad is not None and bool(torch.isfinite(grad).all())
        assert float(grad.abs().max()) > 0
        opt.step()
        assert_orthogonal(m.weight)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", ["square", "tall"])
def test_orthogonal_riemannian(shape, dtype):
    """The same properties for ``method="riemannian"``, trained by ``rgd``."""
    dtype, shape = DTYPES[dtype], SHAPES[shape]
    m = linear(shape, dtype)
    w_init = m.weight.detach().clone()
    orthogonalize(m, "weight", method="riemannian")
    assert m.weight.shape == w_init.shape
    assert_orthogonal(m.weight)
    torch.testing.assert_close(m.weight.detach(), polar(w_init), atol=1e-5, rtol=0.0)
    x = torch.randn(3, shape[1], dtype=dtype)
    opt = optimizers.create("rgd", [m.weight], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        m(x).norm().backward()
        assert m.weight.grad is not None and bool(torch.isfinite(m.weight.grad).all())
        opt.step()
        assert_orthogonal(m.weight)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_riemannian_refuses_wide(dtype):
    m = linear(SHAPES["wide"], DTYPES[dtype])
    w = m.weight.detach().clone()
    with pytest.raises(ValueError, match="wide"):
        orthogonalize(m, "weight", method="riemannian")
    torch.testing.assert_close(m.weight.detach(), w, atol=0.0, rtol=0.0)


def test_orthogonal_errors():
    m = nn.Linear(3, 4)
    with pytest.raises(ValueError, match="allowed") as err:
        orthogonalize(m, "weight", method="foo")
    for name in maps():  # the message lists what exists
        assert name in str(err.value)
    with pytest.raises(ValueError, match="dimensions"):
        orthogonalize(m, "bias")
    assert not parametrize.is_parametrized(m)
    orthogonalize(m, "weight")
    with pytest.raises(ValueError, match="shape"):
        m.weight = torch.randn(5, 5)
    parametrize.remove_parametrizations(m, "weight")
    assert not parametrize.is_parametrized(m)
