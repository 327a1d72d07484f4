"""The manifold owns its geometry: one retraction table, read by `retr` and every optimizer."""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import RETRACTIONS, Stiefel, StiefelGeometry, Unitary, kernels

CASES = [
    (Stiefel(20, 4), torch.float64),  # SMW path
    (Stiefel(20, 4, complex=True), torch.complex128),
    (Stiefel(7, 5), torch.float64),  # dense path (2M ≥ N)
    (Unitary(4), torch.complex128),
]


@pytest.mark.parametrize("method", list(kernels.RETRACTIONS))
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("man,dtype", CASES, ids=lambda c: repr(c))
def test_retr_equals_one_rgd_step(man, dtype, method, metric):
    gen = torch.Generator().manual_seed(0)
    x = man.random(3, man.n, man.m, dtype=dtype, generator=gen)
    g = torch.randn(3, man.n, man.m, dtype=dtype, generator=gen)
    lr = 0.3
    expected = man.retr(x, -lr * man.egrad2rgrad(x, g, metric=metric), method=method)
    w = geoopt.ManifoldParameter(x.clone(), manifold=man)
    w.grad = g.clone()
    optimizers.create("rgd", [w], lr=lr, metric=metric, retraction=method).step()
    assert float((w.detach() - expected).abs().max()) < 1e-12
    # and the step moved: the comparison is not between two unchanged points
    assert float((expected - x).abs().max()) > 1e-2


def test_retraction_table_is_the_one_list():
    assert RETRACTIONS == tuple(kernels.RETRACTIONS) == tuple(Stiefel.retractions)
    geo = Stiefel(9, 2).geometry(retraction="qr")
    assert isinstance(geo, StiefelGeometry) and geo.retraction == "qr"
    with pytest.raises(ValueError, match="retraction='householder'.*cayley, qr, polar"):
        Stiefel(9, 2).geometry(retraction="householder")


class _CountingStiefel(Stiefel):
    """A subclass that replaces the Cayley kernel: every optimizer must use it."""

    calls = 0

    @staticmethod
    def _cayley(x, d, lr, v=None, *, xx=None):
        _CountingStiefel.calls += 1
        return kernels.cayley_descent(x, d, lr, v, xx=xx)

    retractions = {**Stiefel.retractions, "cayley": _cayley}


class _MistypedStiefel(Stiefel):
    retractions = {
        **Stiefel.retractions,
        "two_args": lambda x, u: torch.linalg.qr(x + u).Q,  # retr(x, u), not a descent kernel
        "number": 42,
    }


@pytest.mark.parametrize(
    ("entry", "why"), [("two_args", "too many positional"), ("number", "not a callable")]
)
def test_a_retraction_entry_that_is_not_a_descent_kernel_is_refused_when_selected(entry, why):
    # it was accepted and failed at the first step with "unexpected keyword argument 'xx'"
    # or "'int' object is not callable"
    man = _MistypedStiefel(8, 3)
    w = geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man)
    match = rf"retraction='{entry}'.*not a descent kernel \(.*{why}.*fn\(x, d, lr, v=None"
    with pytest.raises(TypeError, match=match):
        optimizers.create("rgd", [w], lr=0.1, retraction=entry)
    with pytest.raises(TypeError, match=match):
        man.retr(w.detach(), torch.zeros_like(w), method=entry)
    optimizers.create("rgd", [w], lr=0.1, retraction="qr")  # the table's other entries work


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_subclass_kernels_reach_every_optimizer(name):
    man = _CountingStiefel(12, 3)
    x = man.random(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = geoopt.ManifoldParameter(x.clone(), manifold=man)
    hyper = dict(momentum=0.5) if name == "rgd" else {}
    opt = optimizers.create(name, [w], lr=0.1, **hyper)
    before = _CountingStiefel.calls
    for _ in range(3):
        w.grad = torch.randn(12, 3, dtype=torch.float64)
        opt.step()
    assert _CountingStiefel.calls - before == 3
    assert float(man.orthogonality_error(w.detach())) < 1e-12
    # Stiefel.retr reads the same table
    man.retr(x, 0 * x)
    assert _CountingStiefel.calls - before == 4


def test_geoopt_stiefel_gets_our_geometry():
    w = geoopt.ManifoldParameter(
        Stiefel(10, 2).random(dtype=torch.float64).as_subclass(torch.Tensor),
        manifold=geoopt.CanonicalStiefel(),
    )
    opt = optimizers.create("rgd", [w], lr=0.1)
    geo = opt._bindings[0][0].bind(opt.param_groups[0])
    assert isinstance(geo, StiefelGeometry) and geo.metric == "canonical"


def _dense_rgrad(x, g, metric):
    xh = x.mH
    return g - x @ (0.5 * (xh @ g + g.mH @ x)) if metric == "euclidean" else g - x @ g.mH @ x


@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("n,dtype", [(6, torch.float64), (5, torch.complex128)])
def test_frame_geometry_against_the_ambient_operations(n, dtype, metric):
    """Ω of ξ = XΩ (Note [Moments in the frame of X]): the gradient, its squared length
    and the step against dense float64 formulas; the transported vector is Y·Ω."""
    man = Stiefel(n, n, complex=dtype.is_complex, metric=metric)
    base = man.geometry()
    gen = torch.Generator().manual_seed(n)
    x = man.random(3, n, n, dtype=dtype, generator=gen)
    g = torch.randn(3, n, n, dtype=dtype, generator=gen)
    fg = base.frame(x)
    omega = fg.rgrad(x, g)
    xi = _dense_rgrad(x, g, metric)
    tol = 100 * n * torch.finfo(dtype).eps
    torch.testing.assert_close(omega, -omega.mH, atol=0.0, rtol=0.0)  # skew-Hermitian
    torch.testing.assert_close(fg.lift(x, omega), xi, atol=tol, rtol=0.0)
    torch.testing.assert_close(fg.lower(x, xi), omega, atol=tol, rtol=0.0)
    sq = (xi.conj() * xi).real.sum((-2, -1), keepdim=True)
    if metric == "canonical":
        xhxi = x.mH @ xi
        sq = sq - 0.5 * (xhxi.conj() * xhxi).real.sum((-2, -1), keepdim=True)
    torch.testing.assert_close(fg.component_inner(x, omega), sq, atol=tol, rtol=0.0)
    lr = torch.tensor([0.05, 0.3, 2.0], dtype=sq.dtype).view(3, 1, 1)
    y, moved = fg.descend_transport(x, omega, lr)
    # the dense Cayley map of A = (Pu)Xᴴ − X(Pu)ᴴ, u = −lr·ξ (XᴴX = I, P = I − ½XXᴴ)
    u = -lr * xi
    pu = u - 0.5 * x @ (x.mH @ u)
    a = pu @ x.mH - x @ pu.mH
    eye = torch.eye(n, dtype=dtype)
    q = torch.linalg.solve(eye - 0.5 * a, eye + 0.5 * a)
    torch.testing.assert_close(y, q @ x, atol=tol, rtol=0.0)
    assert moved is omega
    torch.testing.assert_close(y @ moved, q @ xi, atol=tol, rtol=0.0)


def test_frame_geometry_only_where_the_step_has_a_frame():
    """Tall points, the QR retraction and plain tensors keep tangent vectors as they are."""
    x = Stiefel(6, 6).random(dtype=torch.float64)
    assert Stiefel(6, 6).geometry().frame(x) is not None
    assert Stiefel(6, 6).geometry(retraction="qr").frame(x) is None
    assert Stiefel(9, 3).geometry().frame(Stiefel(9, 3).random(dtype=torch.float64)) is None
    assert optimizers.geometry.EuclideanGeometry().frame(x) is None


@pytest.mark.parametrize("retraction", ["cayley", "qr", "polar"])
def test_a_row_split_geometry_hands_its_group_to_every_reduction(monkeypatch, retraction):
    # a group of one rank: each all-reduce is the identity, so the split geometry must
    # equal the plain one to rounding, and every sum over the rows must name the group
    import torch.distributed as dist

    group, seen = object(), []

    def all_reduce(t, op=None, group=None):
        seen.append(group)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    st = Stiefel(12, 3)
    plain = st.geometry(retraction=retraction)
    split = plain.on_rows(group)
    assert plain.on_rows(None) is plain and split is not plain and plain.group is None
    x = st.random(dtype=torch.float64)
    g = torch.randn(12, 3, dtype=torch.float64)
    tol = 100 * torch.finfo(torch.float64).eps
    for name, args in [
        ("rgrad", (x, g)),
        ("gradient_step", (x, g, 0.1)),
        ("descend", (x, g, 0.1)),
        ("component_inner", (x, g)),
        ("project", (3 * x,)),
        ("error", (x,)),
    ]:
        seen.clear()
        want, got = getattr(plain, name)(*args), getattr(split, name)(*args)
        assert seen and all(s is group for s in seen), name  # reduced over the group only
        assert torch.allclose(got, want, atol=tol, rtol=tol), name
    assert split.off_manifold(x, step=0) is not None and seen[-1] is group
    assert not hasattr(kernels.reduce, "rows_split") and not hasattr(kernels.reduce, "_GROUP")
