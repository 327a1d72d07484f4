"""A long Cayley step on a tall point (Note [A long Cayley step in the basis of X and the step]).

References: the dense N×N Cayley step (`kernels.cayley_dense`, independent of the 2M×2M
Woodbury system) in float64, and orthogonality to 10·N·eps at step lengths β = lr·‖Pd‖
where the Woodbury system's rounding (about eps·β² along a rank-deficient direction)
had left the manifold.
"""

from __future__ import annotations

import warnings

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel, kernels


def _step(st: Stiefel, x: torch.Tensor, rank: int, beta: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    n, m = x.shape[-2:]
    g = torch.randn(*x.shape[:-2], n, rank, generator=gen, dtype=x.dtype)
    g = g @ torch.randn(*x.shape[:-2], rank, m, generator=gen, dtype=x.dtype)
    u = st.proju(x, g)
    return u * (beta / torch.linalg.matrix_norm(u, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize(("n", "m"), [(16, 4), (256, 16)])
@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("beta", [1e1, 1e3, 1e6])
def test_a_long_step_along_a_low_rank_direction_stays_on_the_manifold(dtype, n, m, rank, beta):
    # float32 St(256, 16), rank 1: 1e-3 off at β = 100, 0.1 at 1e3, 7e2 at 1e4 before
    st = Stiefel(n, m, complex=dtype.is_complex)
    x = st.random(2, n, m, dtype=dtype, generator=torch.Generator().manual_seed(0))
    y = kernels.cayley_retraction(x, _step(st, x, rank, beta))
    tol = 10 * n * torch.finfo(dtype).eps
    assert float(st.orthogonality_error(y).max()) < tol


@pytest.mark.parametrize("complex_", [False, True])
@pytest.mark.parametrize("rank", [1, 6])
def test_a_long_step_and_its_transport_equal_the_dense_cayley_step(complex_, rank):
    dtype = torch.complex128 if complex_ else torch.float64
    st = Stiefel(40, 6, complex=complex_)
    x = st.random(3, 40, 6, dtype=dtype, generator=torch.Generator().manual_seed(0))
    beta = 1e3
    u = _step(st, x, rank, beta)
    v = st.proju(x, torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(2)))
    y, moved = kernels.cayley_retraction_transport(x, u, v)
    y_dense, moved_dense = kernels.cayley_dense(x, u, v)
    tol = 10 * 40 * torch.finfo(dtype).eps * beta  # the Cayley map's own conditioning
    assert float((y - y_dense).abs().max()) < tol
    assert float((moved - moved_dense).abs().max()) < tol


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_an_optimizer_step_along_a_huge_rank_one_gradient_stays_on_the_manifold(name):
    # a batch of one gives a rank-1 gradient: rgd at lr = 0.5 had left the manifold by 43 and
    # the next step projected it back, warning about an in-place edit
    st = Stiefel(16, 4)
    w = geoopt.ManifoldParameter(st.random(generator=torch.Generator().manual_seed(0)), manifold=st)
    g = 1e4 * torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) @ torch.randn(1, 4)
    opt = optimizers.create(name, [w], lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            w.grad = g.clone()
            opt.step()
            assert (
                float(st.orthogonality_error(w.detach())) < 10 * 16 * torch.finfo(torch.float32).eps
            )


def _cayley_float64(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # (I − ½A)⁻¹(I + ½A)X with A = PuXᵀ − XPuᵀ, P = I − ½XXᵀ, by a dense float64 solve
    x, u = x.double(), u.double()
    pu = u - 0.5 * x @ (x.mT @ u)
    a = pu @ x.mT - x @ pu.mT
    eye = torch.eye(x.shape[-2], dtype=torch.float64)
    return torch.linalg.solve(eye - 0.5 * a, (eye + 0.5 * a) @ x)


@pytest.mark.parametrize(("n", "m"), [(40, 6), (256, 16)])
@pytest.mark.parametrize("beta", [1e3, 1e4, 1e6])
def test_a_long_float32_step_along_a_full_rank_direction_is_the_cayley_step(n, m, beta):
    # the basis step's solve had kept its pivot above √eps: beyond β ≈ 3e3 in float32 it took
    # a shorter step (2e-3 off at β = 1.4e4 on St(40, 6), where the Woodbury step was 2e-7)
    st = Stiefel(n, m)
    x = st.random(dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    u = _step(st, x, m, beta)
    y = kernels.cayley_retraction(x, u)
    assert (
        float((y.double() - _cayley_float64(x, u)).abs().max())
        < 10 * n * torch.finfo(torch.float32).eps
    )
