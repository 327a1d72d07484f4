"""geoopt's ProductManifold ``random``/``origin``/``from_point``
with our manifolds as components (geoopt's test_product_manifold.py: test_from_point,
test_from_point_checks_shapes, test_unpack_tensor_method). geoopt calls
``manifold.random(*batch, *shape)`` and reads ``.manifold`` from the parts given to
``from_point``, so both need geoopt's size semantics (pending/test_random_origin_size.py).
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _interop_cases import MANIFOLDS, dtype_of, manifold, shape_of


@pytest.fixture(params=list(MANIFOLDS))
def case(request):
    return request.param


def product(case):
    ours = manifold(case)
    return geoopt.ProductManifold((ours, shape_of(case)), (ours, shape_of(case))), ours


@pytest.mark.parametrize("fn", ["random", "origin"])
def test_random_and_origin_then_unpack(case, fn):
    pman, ours = product(case)
    point = getattr(pman, fn)(4, pman.n_elements, dtype=dtype_of(case))
    assert point.shape == (4, pman.n_elements)
    for part in point.unpack_tensor():
        assert part.shape == (4, *shape_of(case))
        ours.assert_check_point_on_manifold(part)
    assert pman.check_point_on_manifold(point)


def test_from_point(case):
    ours = manifold(case)
    dtype = dtype_of(case)
    point = [
        ours.random(5, *shape_of(case), dtype=dtype),
        ours.random(5, *shape_of(case), dtype=dtype),
    ]
    pman = geoopt.ProductManifold.from_point(*point, batch_dims=1)
    n, m = shape_of(case)
    assert pman.n_elements == 2 * n * m
    packed = pman.pack_point(*point)
    for old, new in zip(point, pman.unpack_tensor(packed), strict=True):
        torch.testing.assert_close(new, old.as_subclass(torch.Tensor), atol=0.0, rtol=0.0)


def test_from_point_checks_shapes(case):
    ours = manifold(case)
    dtype = dtype_of(case)
    point = [
        ours.random(5, *shape_of(case), dtype=dtype),
        ours.random(3, *shape_of(case), dtype=dtype),
    ]
    pman = geoopt.ProductManifold.from_point(*point)
    n, m = shape_of(case)
    assert pman.n_elements == 5 * n * m + 3 * n * m
    with pytest.raises(ValueError, match="Not all parts have same batch shape"):
        geoopt.ProductManifold.from_point(*point, batch_dims=1)
