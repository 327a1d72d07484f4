"""geoopt's conventions: random/origin sizes, ProductManifold components, samplers."""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel.manifolds import Orthogonal, Stiefel, Unitary


@pytest.mark.parametrize("man", [Stiefel(6, 2), Stiefel(5, 3, complex=True), Orthogonal(3)])
def test_random_and_origin_sizes(man):
    n, m = man.n, man.m
    for fn in (man.random, man.origin):
        assert fn().shape == (n, m)
        assert fn(n, m).shape == fn((n, m)).shape == (n, m)
        assert fn(4, n, m).shape == fn((4, n, m)).shape == (4, n, m)
        x = fn(2, 3, n, m, dtype=torch.complex128 if man.complex else torch.float64)
        assert isinstance(x, geoopt.ManifoldTensor) and x.manifold is man
        assert float(man.orthogonality_error(x).max()) < 1e-12
        for bad in [(4,), (4, 1), (n, m + 1), (m, n) if m != n else (n + 1, n)]:
            with pytest.raises(ValueError, match=rf"\({n}, {m}\)"):
                fn(*bad)


def test_origin_is_identity_block_and_draws_no_random_numbers():
    man = Stiefel(5, 2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    o = man.origin(3, 5, 2, dtype=torch.float64)
    assert torch.equal(torch.rand(3), expected)  # the global generator did not move
    ref = torch.zeros(5, 2, dtype=torch.float64)
    ref[0, 0] = ref[1, 1] = 1
    assert torch.equal(o.as_subclass(torch.Tensor), ref.expand(3, 5, 2))


def test_product_manifold_with_our_components():
    st, un = Stiefel(5, 2), Unitary(2)
    prod = geoopt.ProductManifold((st, (5, 2)), (Stiefel(4, 4), (4, 4)))
    x = prod.random(3, prod.n_elements, dtype=torch.float64)
    for i, man in enumerate(prod.manifolds):
        assert float(man.orthogonality_error(prod.take_submanifold_value(x, i)).max()) < 1e-12
    o = prod.origin(prod.n_elements, dtype=torch.float64)
    assert torch.equal(prod.take_submanifold_value(o, 0), torch.eye(5, 2, dtype=torch.float64))
    a, b = st.random(dtype=torch.float64), Stiefel(3, 1).random(dtype=torch.float64)
    pm = geoopt.ProductManifold.from_point(a, b)  # needs ManifoldTensors: random gives them
    assert pm.manifolds[0] is st and pm.shapes == [(5, 2), (3, 1)]
    point = pm.pack_point(a, b)
    assert torch.equal(pm.take_submanifold_value(point, 1), b.as_subclass(torch.Tensor))
    assert un.reversible and st.reversible


@pytest.mark.parametrize("man,dtype", [(Stiefel(8, 3), torch.float64), (Unitary(3), None)])
def test_cayley_retr_transp_is_reversible(man, dtype):
    dtype = dtype or torch.complex128
    gen = torch.Generator().manual_seed(2)
    x = man.random(dtype=dtype, generator=gen).as_subclass(torch.Tensor)
    u = man.proju(x, torch.randn(man.n, man.m, dtype=dtype, generator=gen))
    y, v = man.retr_transp(x, u, u)
    back, _ = man.retr_transp(y, -v, -v)
    assert float((back - x).abs().max()) < 1e-14
    assert float((y - x).abs().max()) > 0.1


def test_geoopt_sampler_accepts_our_manifold():
    man = Stiefel(6, 2)
    x = man.random(dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w = geoopt.ManifoldParameter(x.as_subclass(torch.Tensor).clone(), manifold=man)
    target = torch.randn(6, 2, dtype=torch.float64)
    sampler = geoopt.samplers.RSGLD([w], epsilon=1e-3)

    def closure():
        return -((w - target) ** 2).sum()

    for _ in range(3):
        sampler.step(closure)
    assert float(man.orthogonality_error(w.detach())) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_points_work_in_float32(dtype):
    st = Stiefel(20, 4)
    gen = torch.Generator().manual_seed(6)
    x = st.random(2, 20, 4, dtype=dtype, generator=gen)
    g = torch.randn(2, 20, 4, generator=gen).to(dtype)
    xi = st.egrad2rgrad(x, g)
    bound = 4**0.5 * torch.finfo(dtype).eps
    for y in (x, st.retr(x, -0.1 * xi), st.retr_transp(x, -0.1 * xi, xi)[0], st.projx(g)):
        assert y.dtype == dtype
        err = torch.linalg.matrix_norm(y.double().mH @ y.double() - torch.eye(4).double())
        assert float(err.max()) <= bound
    # the float32 work: the result is the rounding of the float32 computation
    u = -0.1 * xi
    assert torch.equal(st.retr(x, u), st.retr(x.float(), u.float()).to(dtype))
    assert st.inner(x, xi).dtype == dtype and st.check_point_on_manifold(x)


def test_meta_device_random_origin_and_checks():
    st = Stiefel(6, 2)
    for x in (st.random(3, 6, 2, device="meta"), st.origin(device="meta")):
        assert x.is_meta and x.shape[-2:] == (6, 2)
        assert st.check_point_on_manifold(x)
