"""A map from outside the package is checked at its first point (Note [A map from elsewhere
is checked at its first point]): shape and orthonormality, refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stiefel import orthogonalize
from stiefel.parametrizations import OrthogonalMap, available, maps

F64 = torch.float64


class DropColumn(OrthogonalMap):
    """Returns one column fewer than the weight has."""

    def matrix(self, original):
        return original[..., :-1]

    def inverse(self, q):
        return q


class Doubled(OrthogonalMap):
    """Not orthogonal: its inverse stores 2Q and its matrix returns the original."""

    def matrix(self, original):
        return original

    def inverse(self, q):
        return 2 * q


class Polar(OrthogonalMap):
    """A correct map: the polar factor."""

    def matrix(self, original):
        u, _, vh = torch.linalg.svd(original, full_matrices=False)
        return u @ vh

    def inverse(self, q):
        return q


def plus_identity(a):  # f(0) = I, the only point the right inverse reads
    return a + torch.eye(a.shape[-1], dtype=a.dtype)


def not_a_tensor(a):
    return 3


CASES = [
    (DropColumn, r"'DropColumn' map's matrix\(\) returned \(6, 3\) for Linear.weight; "
                 r"allowed: a tensor of shape \(6, 4\)"),
    (Doubled, r"'Doubled' map's point for Linear.weight is not on Stiefel\(n=6, m=4.*"
              r"‖QᴴQ − I‖_F = 6\.000e\+00"),
    (plus_identity, r"function plus_identity is not orthogonal at a skew A"),
    (not_a_tensor, r"function not_a_tensor returned int for a skew A of shape \(6, 6\)"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "match"), CASES)
def test_a_map_that_is_not_orthogonal_is_refused_and_the_module_is_untouched(method, match):
    # before: the first forward failed in a matmul naming neither (wrong shape), or the
    # model trained with ‖WᵀW − I‖_F = 6 (Doubled) or 0.44 after one step (plus_identity)
    lin = nn.Linear(4, 6, dtype=F64)
    weight, values = lin.weight, lin.weight.detach().clone()
    with pytest.raises(ValueError, match=match):
        orthogonalize(lin, method=method)
    assert not hasattr(lin, "parametrizations") and lin.weight is weight
    assert torch.equal(lin.weight.detach(), values)


@pytest.mark.parametrize("method", [Polar, torch.linalg.matrix_exp])
@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5)])
def test_an_orthogonal_map_from_elsewhere_is_accepted_at_the_polar_factor(method, shape):
    lin = nn.Linear(shape[1], shape[0], dtype=F64)
    u, _, vh = torch.linalg.svd(lin.weight.detach(), full_matrices=False)
    orthogonalize(lin, method=method)
    torch.testing.assert_close(lin.weight.detach(), u @ vh, rtol=0, atol=1e-12)
    fmap = lin.parametrizations.weight[0]
    assert not fmap.tested_here and not fmap._unchecked  # checked once, at registration


def test_the_package_s_own_maps_are_tested_here_and_not_checked_per_point():
    assert all(cls.tested_here for cls in maps().values())
    assert not Polar.tested_here and len(available()) >= len(maps())


def test_a_method_that_is_neither_a_name_a_map_nor_a_function_names_what_is_allowed():
    with pytest.raises(TypeError, match=r"method=42 is not allowed; allowed: a name \(.*cwy.*\), "
                       "an OrthogonalMap subclass or a function"):  # fmt: skip
        orthogonalize(nn.Linear(4, 4), method=42)
