"""Port of geoopt's ``tests/test_product_manifold.py`` with our manifolds as components.

geoopt's properties that hold on this branch: the product's ``n_elements`` and ``name``;
``pack_point``/``unpack_tensor`` round trip; ``inner`` gives one value per batch element
(``keepdim`` keeps a trailing 1); ``component_inner`` one per packed element; and here
also that projx/proju/retr of the product act component by component and keep each part
on its manifold. ``random``, ``origin`` and ``from_point`` need geoopt's size
semantics in our manifolds: pending/test_geoopt_product_random.py.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _interop_cases import MANIFOLDS, manifold, randn, random_point, shape_of


def product(case: str):
    ours = manifold(case)
    shape = shape_of(case)
    pman = geoopt.ProductManifold((ours, shape), (geoopt.Sphere(), 4), (geoopt.Euclidean(), ()))
    return pman, ours


def parts(case: str, batch: int = 5):
    x = random_point(case, 1, batch)
    dtype = x.dtype
    sphere = geoopt.Sphere().random_uniform(batch, 4, dtype=dtype.to_real())
    eucl = torch.randn(batch, dtype=dtype.to_real())
    if x.is_complex():  # a product holds one dtype: use complex parts throughout
        sphere, eucl = sphere.to(dtype), eucl.to(dtype)
    return [x, sphere, eucl]


@pytest.fixture(params=list(MANIFOLDS))
def case(request):
    return request.param


def test_init(case):
    pman, ours = product(case)
    n, m = shape_of(case)
    assert pman.n_elements == n * m + 4 + 1
    assert pman.name == f"({ours.name})x(Sphere)x(Euclidean)"


def test_reshaping(case):
    pman, _ = product(case)
    point = parts(case)
    tensor = pman.pack_point(*point)
    assert tensor.shape == (5, pman.n_elements)
    for old, new in zip(point, pman.unpack_tensor(tensor), strict=True):
        torch.testing.assert_close(new, old, atol=0.0, rtol=0.0)


def test_inner_product(case):
    pman, ours = product(case)
    tensor = pman.pack_point(*parts(case))
    tangent = pman.proju(tensor, randn(tensor.shape, tensor.dtype, 2))
    inner = pman.inner(tensor, tangent)
    assert inner.shape == (5,)
    assert pman.inner(tensor, tangent, keepdim=True).shape == (5, 1)
    if tensor.is_complex():  # geoopt's Sphere/Euclidean inner products are real-only
        return
    # the Stiefel part contributes our metric's inner product
    x, u = pman.unpack_tensor(tensor)[0], pman.unpack_tensor(tangent)[0]
    rest = sum((a * a).reshape(5, -1).sum(-1) for a in pman.unpack_tensor(tangent)[1:])
    torch.testing.assert_close(inner, ours.inner(x, u) + rest, atol=1e-12, rtol=1e-12)


def test_component_inner_product(case):
    pman, _ = product(case)
    tensor = pman.pack_point(*parts(case))
    tangent = pman.proju(tensor, randn(tensor.shape, tensor.dtype, 3))
    assert pman.component_inner(tensor, tangent).shape == (5, pman.n_elements)


def test_componentwise_projx_proju_retr(case):
    pman, ours = product(case)
    tensor = pman.pack_point(*parts(case))
    ex = tensor + 0.1 * randn(tensor.shape, tensor.dtype, 4)
    px = pman.projx(ex)
    torch.testing.assert_close(
        pman.unpack_tensor(px)[0], ours.projx(pman.unpack_tensor(ex)[0]), atol=0.0, rtol=0.0
    )
    u = pman.proju(px, randn(tensor.shape, tensor.dtype, 5))
    y = pman.retr(px, u)
    assert pman.check_point_on_manifold(y)
    ours.assert_check_point_on_manifold(pman.unpack_tensor(y)[0])
    x0, u0 = pman.unpack_tensor(px)[0], pman.unpack_tensor(u)[0]
    torch.testing.assert_close(pman.unpack_tensor(y)[0], ours.retr(x0, u0), atol=0.0, rtol=0.0)
