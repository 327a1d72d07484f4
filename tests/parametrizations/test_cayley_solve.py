"""The Cayley transform's solve without pivoting (`_cayley`), against float64 LU solves."""

import math

import pytest
import torch

from stiefel.parametrizations import kernels as K
from stiefel.parametrizations import orthogonalize
from stiefel.parametrizations._cayley import BLOCK, cayley_solve, unpivoted
from stiefel.parametrizations._spectral import LazyNorm, one_norm

LOW = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def _skew(n, norm1, dtype, gen, batch=()):
    """A random skew-Hermitian A (float64 or complex128) scaled to max ‖A‖₁ = norm1."""
    x = torch.randn(*batch, n, n, dtype=LOW.get(dtype, dtype), generator=gen)
    a = K.skew_from_raw(x)
    return a * (norm1 / torch.linalg.matrix_norm(a, ord=1).max())


def _path(device):
    """The elimination without pivoting that ``device`` has (`_cayley.PATHS`)."""
    return "unpivoted_lu" if torch.device(device).type == "cuda" else "unpivoted_blocks"


def _reference(a, b):
    """(I + A)⁻¹(I − A)B by LAPACK's pivoted LU in float64 / complex128."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye + a, (eye - a) @ b)


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128, torch.float32, torch.complex64))
@pytest.mark.parametrize(
    "n, m, batch, rhs_batch",
    [(BLOCK + 2, BLOCK + 2, (), (3,)), (300, 7, (2,), ()), (200, 200, (2, 1), (3,))],
)
def test_unpivoted_solve_against_float64(dtype, n, m, batch, rhs_batch, device):
    # on CUDA the elimination is torch's unpivoted LU (Note [Unpivoted LU by device type])
    gen = torch.Generator().manual_seed(n + m)
    eps = torch.finfo(dtype).eps
    for norm1 in (0.1, 1.0, 0.99 * 4 * math.sqrt(n)):  # up to the limit of the path
        a = _skew(n, norm1, dtype, gen, batch)
        assert unpivoted(n, one_norm(a)), norm1  # the path under test
        b = torch.linalg.qr(torch.randn(*rhs_batch, n, m, dtype=a.dtype, generator=gen))[0]
        ref = _reference(a, b)
        q = cayley_solve(a.to(device, dtype), b.to(device, dtype), _path(device))
        assert q.shape == torch.broadcast_shapes(batch, rhs_batch) + (n, m)
        qd = q.to("cpu", a.dtype)
        assert float((qd - ref).abs().max()) < 10 * n * eps
        gram = qd.mH @ qd - torch.eye(m, dtype=a.dtype)
        assert float(torch.linalg.matrix_norm(gram).max()) < 10 * n * eps


def test_unpivoted_solve_growth_beyond_its_range(device):
    # Outside the range the route gives it, the elimination is still finite and within the
    # Golub–Van Loan bound n(1 + ‖A‖₂²)·eps of Note [Elimination without pivoting for I + A]
    gen = torch.Generator().manual_seed(3)
    n = 2 * BLOCK
    eps = torch.finfo(torch.float64).eps
    for norm1 in (1e2, 1e4):
        a = _skew(n, norm1, torch.float64, gen)
        assert not unpivoted(n, norm1)
        b = torch.eye(n, dtype=torch.float64)
        q = cayley_solve(a.to(device), b.to(device), _path(device)).cpu()
        spectral = float(torch.linalg.matrix_norm(a, ord=2))
        assert float((q - _reference(a, b)).abs().max()) < n * (1 + spectral**2) * eps


def test_route_takes_the_pivoted_solve_where_the_norm_is_large_or_unknown():
    n = 2 * BLOCK
    limit = 4 * math.sqrt(n)
    assert unpivoted(n, limit) and not unpivoted(n, 1.01 * limit)
    assert not unpivoted(n, None) and not unpivoted(BLOCK, 0.0)
    gen = torch.Generator().manual_seed(4)
    a = _skew(n, 4 * n, torch.float64, gen)  # pivoted LU, just below the eigh threshold
    b = torch.randn(n, 3, dtype=torch.float64, generator=gen)
    ref = _reference(a, b)
    assert K.cayley_path(a, LazyNorm(a)) == "solve"
    assert float((K.cayley_map(a, b) - ref).abs().max()) < 1e-10
    with pytest.raises(ValueError, match="path='pivoted' is not supported"):
        cayley_solve(a, b, "pivoted")


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_unpivoted_solve_gradcheck(dtype, device):
    gen = torch.Generator().manual_seed(5)
    n = BLOCK + 3  # two pivot blocks, the second ragged
    a = _skew(n, 2.0, dtype, gen).to(device).requires_grad_()
    b = torch.randn(n, 2, dtype=dtype, generator=gen).to(device).requires_grad_()
    fn = lambda x, y: cayley_solve(x, y, _path(device))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b), fast_mode=True)


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_unpivoted_gradients_against_pivoted_autograd(dtype, device):
    # The written-out backward against autograd through torch.linalg.solve (batched, broadcast)
    gen = torch.Generator().manual_seed(6)
    n, m = 2 * BLOCK + 5, 4
    a = _skew(n, 3.0, dtype, gen, (2,)).to(device)
    b = torch.randn(n, m, dtype=dtype, generator=gen).to(device)
    g = torch.randn(2, n, m, dtype=dtype, generator=gen).to(device)
    grads = []
    for fn in (lambda x, y: cayley_solve(x, y, _path(device)), _reference):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(x, y), (x, y), g))
    for ours, ref in zip(*grads, strict=True):
        assert float((ours - ref).abs().max()) < 1e-11 * float(ref.abs().max())


@pytest.mark.parametrize("method", ["cayley", "scaled_cayley"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.complex64))
def test_maps_on_the_unpivoted_path_against_float64(method, dtype, device):
    gen = torch.Generator().manual_seed(7)
    n = K.UNPIVOTED_BLOCKS_FROM + 40  # where the CPU takes the blocks
    high = LOW[dtype]
    w = orthogonalize(torch.randn(n, n, dtype=dtype, generator=gen).to(device), method=method)
    original = w.parametrizations.weight.original
    with torch.no_grad():
        original.copy_(torch.randn(n, n, dtype=dtype, generator=gen) / math.sqrt(n))
        if method == "scaled_cayley" and dtype.is_complex:
            phases = w.map.phases
            phases.copy_(
                torch.empty(phases.shape, dtype=phases.dtype).uniform_(-3, 3, generator=gen)
            )
    params = [original] + list(w.map.parameters())

    def reference(raw, *phases):
        if method == "cayley":
            rhs = w.map.base.to(high)
        elif phases:
            rhs = torch.diag(torch.polar(torch.ones_like(phases[0]), phases[0]).to(high))
        else:
            rhs = torch.diag(w.map.diagonal().to(high))
        return _reference(K.skew_from_raw(raw), rhs)

    wide = [p.detach().to(high if p.is_complex() else torch.float64) for p in params]
    assert unpivoted(n, one_norm(K.skew_from_raw(wide[0])))
    eps = torch.finfo(dtype).eps
    q = w()
    ref = reference(*wide)
    assert float((q.detach().to(high) - ref).abs().max()) < 10 * n * eps
    c = torch.randn(n, n, dtype=dtype, generator=gen).to(device)
    grads = torch.autograd.grad((q * c.conj()).real.sum(), params)
    wide = [t.requires_grad_() for t in wide]
    refs = torch.autograd.grad((reference(*wide) * c.to(high).conj()).real.sum(), wide)
    for ours, expected in zip(grads, refs, strict=True):
        scale = float(expected.abs().max())
        assert float((ours.to(expected.dtype) - expected).abs().max()) < 10 * n * eps * scale


def _plain_skew(y):
    t = torch.triu(y, 1)
    a = t - t.mH
    if y.is_complex():
        a = a + torch.diag_embed(1j * torch.diagonal(y, dim1=-2, dim2=-1).imag)
    return a


def _plain_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The plain formula's gradient on the CPU: the reference of every device."""
    x = x.detach().cpu().requires_grad_()
    return torch.autograd.grad(_plain_skew(x), x, g.cpu())[0]


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_skew_from_raw_backward_forward_ad_and_vmap(device, dtype):
    # Note [Skew part by copies]: the panels' Function (the path of large n on the CPU;
    # tests/test_dispatch.py compares it there) under autograd, forward AD and vmap,
    # against the plain formula's values and autograd on the CPU
    skew = K._SkewFromRaw.apply
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 6, 6, dtype=dtype, generator=gen).to(device).requires_grad_()
    assert torch.equal(skew(x).cpu(), _plain_skew(x.detach().cpu()))
    assert torch.autograd.gradcheck(skew, (x,), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(skew, (x,))
    g = torch.randn(3, 6, 6, dtype=dtype, generator=gen).to(device)
    ours = torch.autograd.grad(skew(x), x, g)[0]
    assert torch.equal(ours.cpu(), _plain_grad(x, g))
    per_sample = torch.func.vmap(torch.func.grad(lambda y: skew(y).abs().sum()))
    reference = torch.func.vmap(torch.func.grad(lambda y: _plain_skew(y).abs().sum()))
    want = reference(x.detach().cpu())
    assert torch.allclose(per_sample(x.detach()).cpu(), want, atol=1e-14)


def test_one_norm_is_the_column_norm_of_a_skew_matrix():
    gen = torch.Generator().manual_seed(9)
    for dtype in (torch.float64, torch.complex128):
        a = K.skew_from_raw(torch.randn(2, 9, 9, dtype=dtype, generator=gen))
        expected = float(torch.linalg.matrix_norm(a, ord=1).max())
        assert one_norm(a) == pytest.approx(expected, rel=1e-14)
