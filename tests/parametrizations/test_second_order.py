"""Second derivatives through the maps: right where autograd takes them, refused where not.

A Hessian-vector product (MAML's inner step, a gradient penalty) differentiates the
gradient again. The maps whose backward is written by hand (Note [A second derivative
through a first-order backward]) must raise, never give zeros, also when the caller
passes ``allow_unused=True``; the others must match finite differences of the
gradient, also at the coordinates `orthogonalize` writes (complex CWY ones hold exact
zeros: Note [|v|² as a sum of squares]).
"""

from __future__ import annotations

import pytest
import torch

import stiefel
from stiefel.parametrizations._cayley import cayley_solve
from stiefel.parametrizations._spectral import SPECTRAL_THRESHOLD, skew_spectral

DTYPES = [torch.float64, torch.complex128]


def _linear(method: str, dtype: torch.dtype, n: int = 4) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(n, n, bias=False, dtype=dtype)
    stiefel.orthogonalize(lin, method=method)
    return lin


def _hvp_and_difference(lin: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """H·v by double backward and by central differences of the gradient, in float64."""
    theta = lin.parametrizations.weight.original
    c = torch.randn(
        lin.weight.shape, dtype=lin.weight.dtype, generator=torch.Generator().manual_seed(1)
    )

    def loss() -> torch.Tensor:
        w = lin.weight
        return (c * w * w * w).real.sum()

    v = torch.randn(theta.shape, dtype=theta.dtype, generator=torch.Generator().manual_seed(2))
    (g,) = torch.autograd.grad(loss(), theta, create_graph=True)
    (hv,) = torch.autograd.grad((g.conj() * v).real.sum(), theta)
    eps = 1e-6
    grads = []
    for sign in (1, -1):
        with torch.no_grad():
            theta.add_(sign * eps * v)
        grads.append(torch.autograd.grad(loss(), theta)[0])
        with torch.no_grad():
            theta.sub_(sign * eps * v)
    return hv, (grads[0] - grads[1]) / (2 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["cwy", "tcwy", "cayley", "scaled_cayley"])
def test_a_hessian_vector_product_matches_differences_of_the_gradient(method, dtype):
    lin = _linear(method, dtype)
    theta = lin.parametrizations.weight.original
    if dtype.is_complex and method in ("cwy", "tcwy"):
        assert (theta == 0).any()  # the case the modulus got wrong
    hv, fd = _hvp_and_difference(lin)
    assert fd.norm() > 1e-3
    assert torch.allclose(hv, fd, rtol=1e-6, atol=1e-6 * float(fd.norm()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_complex_cwy_passes_gradgradcheck_at_its_initial_coordinates(dtype):
    lin = _linear("cwy", dtype, n=3)
    fmap = lin.parametrizations.weight[0]
    theta = lin.parametrizations.weight.original.detach().clone().requires_grad_()
    assert torch.autograd.gradgradcheck(fmap, (theta,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["exp", "householder"])
def test_a_second_derivative_through_a_first_order_map_raises_naming_it(method, dtype):
    lin = _linear(method, dtype)
    theta = lin.parametrizations.weight.original
    (g,) = torch.autograd.grad(lin.weight.abs().pow(3).sum(), theta, create_graph=True)
    with pytest.raises(RuntimeError, match=f"second derivative through the {method} map"):
        torch.autograd.grad(g.abs().square().sum(), theta, allow_unused=True, retain_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        g.abs().square().sum().backward()
    # the first derivative is unchanged by the refusal's node
    (again,) = torch.autograd.grad(lin.weight.abs().pow(3).sum(), theta)
    assert torch.equal(g.detach(), again)


def test_the_hand_written_solve_paths_refuse_a_second_derivative_too():
    torch.manual_seed(0)
    n = 200  # past the pivot blocks: the unpivoted solve
    a = torch.randn(n, n, dtype=torch.float64) * 0.01
    a = (a - a.mT).requires_grad_()
    b = torch.randn(n, 2, dtype=torch.float64)
    out = cayley_solve(a, b, path="unpivoted_blocks")
    (g,) = torch.autograd.grad(out.square().sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="unpivoted Cayley solve"):
        torch.autograd.grad(g.square().sum(), a, allow_unused=True)
    big = torch.randn(6, 6, dtype=torch.float64) * SPECTRAL_THRESHOLD
    big = (big - big.mT).requires_grad_()
    (g,) = torch.autograd.grad(skew_spectral(big, "exp").sin().sum(), big, create_graph=True)
    with pytest.raises(RuntimeError, match="spectral path"):
        torch.autograd.grad(g.square().sum(), big, allow_unused=True)


def test_first_order_maps_still_run_under_torch_func_grad():
    lin = _linear("exp", torch.float64)
    params = dict(lin.named_parameters())
    x = torch.randn(3, 4, dtype=torch.float64)

    def loss(p):
        return torch.func.functional_call(lin, p, (x,)).square().sum()

    grads = torch.func.grad(loss)(params)
    key = "parametrizations.weight.original"
    expected = torch.autograd.grad(loss(params), params[key])[0]
    assert torch.allclose(grads[key], expected, atol=1e-12)


def test_the_squared_modulus_takes_a_conjugated_view():
    from stiefel.manifolds.kernels.reduce import abs_square

    v = torch.randn(5, 3, dtype=torch.complex128)
    assert torch.allclose(abs_square(v.mH), v.mH.abs().square(), rtol=1e-15)
