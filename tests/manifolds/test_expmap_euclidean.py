"""The Euclidean-metric geodesic (`kernels.expmap_euclidean`) against Edelman's formula.

References: Edelman, Arias & Smith's Y = [X, U] expm([[A, −S], [I, A]]) [I; 0] expm(−A)
written out densely here (float64/complex128, moderate steps), and orthogonality at long
steps to the rounding of a skew exponential, n·eps·‖U‖_F (Note [The Euclidean geodesic
by skew exponentials]).
"""

from __future__ import annotations

import pytest
import torch

from stiefel.manifolds import Stiefel


def _edelman(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    m = x.shape[-1]
    a, s = x.mH @ u, u.mH @ u
    eye = torch.eye(m, dtype=x.dtype).expand_as(a)
    block = torch.cat((torch.cat((a, -s), -1), torch.cat((eye, a), -1)), -2)
    return (
        torch.cat((x, u), -1)
        @ torch.linalg.matrix_exp(block)[..., :m]
        @ torch.linalg.matrix_exp(-a)
    )


@pytest.mark.parametrize("complex_", [False, True])
@pytest.mark.parametrize(("n", "m"), [(7, 3), (5, 4), (9, 5), (4, 4), (12, 2)])
def test_the_geodesic_equals_edelmans_formula(n, m, complex_):
    man = Stiefel(n, m, complex=complex_)
    dtype = torch.complex128 if complex_ else torch.float64
    torch.manual_seed(0)
    x = man.random(3, n, m, dtype=dtype)
    u = 0.7 * man.proju(x, torch.randn_like(x))
    y = man.expmap(x, u, metric="euclidean")
    assert float((y - _edelman(x, u)).abs().max()) < 100 * n * torch.finfo(torch.float64).eps


@pytest.mark.parametrize(
    ("dtype", "length"), [(torch.float32, 1e2), (torch.float32, 1e3), (torch.float64, 1e8)]
)
def test_a_long_step_stays_on_the_manifold(dtype, length):
    # Edelman's block is not skew: 4.8e-4 and 0.019 off in float32, 1.44 in float64
    man = Stiefel(7, 3)
    torch.manual_seed(0)
    x = man.random(dtype=dtype)
    u = man.proju(x, torch.randn_like(x))
    u = u * (length / float(torch.linalg.matrix_norm(u)))
    y = man.expmap(x, u, metric="euclidean")
    assert float(man.orthogonality_error(y)) < 7 * torch.finfo(dtype).eps * length
