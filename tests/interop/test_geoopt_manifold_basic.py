"""Port of geoopt's ``tests/test_manifold_basic.py`` to O(n), U(n) and real/complex St(N, M).

geoopt checks, for every manifold (and the same manifold wrapped in ``geoopt.Scaled``):
projx fixes points, projx lands on the manifold at the reference nearest point, proju
lands in the tangent space at the reference projection, and projx, proju, retr and
transp_follow_retr broadcast over a batch exactly as element by element; and
retr_transp is reversible. The references here are dense float64 formulas (SVD polar
factor, U − X sym(XᴴU)). geoopt's ``logmap``/``dist`` checks are skipped by geoopt itself
for its Stiefel manifolds (not implemented there either) and are not ported.

Deliberate convention differences are asserted, with geoopt's behaviour documented:
``proju`` is the Euclidean-orthogonal projection under either metric (geoopt's
``CanonicalStiefel.proju`` is G − XGᴴX, which is not idempotent; that map is our
``egrad2rgrad(..., metric="canonical")``), and the Cayley retraction satisfies
retr(x, t·u) = x + t·u + O(t²), where geoopt's ``CanonicalStiefel.retr`` moves with
initial velocity (I + XXᴴ)u.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _interop_cases import MANIFOLDS, METRICS, dtype_of, manifold, polar, randn, random_point

SCALES = {"NotScaled": None, "Scaled": 2.0}


def make(case: str, metric: str, scaled: float | None):
    man = manifold(case, metric)
    return man if scaled is None else geoopt.Scaled(man, scaled)


def atol(case: str) -> float:
    n = MANIFOLDS[case][1][0]
    return 100 * n * torch.finfo(dtype_of(case)).eps


def sym(a: torch.Tensor) -> torch.Tensor:
    return (a + a.mH) / 2


def tangent_ref(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The Euclidean-orthogonal projection onto T_x St: V − X sym(XᴴV)."""
    return v - x @ sym(x.mH @ v)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.detach(), b.detach(), atol=tol, rtol=0.0)


@pytest.fixture(params=list(SCALES), ids=list(SCALES))
def scaled(request):
    return SCALES[request.param]


@pytest.fixture(params=METRICS)
def metric(request):
    return request.param


@pytest.fixture(params=list(MANIFOLDS))
def case(request):
    return request.param


@pytest.mark.parametrize("seed", [1, 2])
def test_projection_identity(case, metric, scaled, seed):
    man = make(case, metric, scaled)
    x = random_point(case, seed)
    close(man.projx(x), x, atol(case))


@pytest.mark.parametrize("seed", [1, 2])
def test_projection_via_assert(case, metric, scaled, seed):
    man = make(case, metric, scaled)
    ex = randn(MANIFOLDS[case][1], dtype_of(case), seed)
    px = man.projx(ex)
    man.assert_check_point_on_manifold(px)
    close(px, polar(ex), atol(case))


@pytest.mark.parametrize("seed", [1, 2])
def test_vector_projection_via_assert(case, metric, scaled, seed):
    man = make(case, metric, scaled)
    x = random_point(case, seed)
    ev = randn(x.shape, x.dtype, seed + 100)
    pv = man.proju(x, ev)
    man.assert_check_vector_on_tangent(x, pv)
    close(pv, tangent_ref(x, ev), atol(case))


def test_broadcast_projx(case, metric, scaled):
    man = make(case, metric, scaled)
    xs = randn((4, *MANIFOLDS[case][1]), dtype_of(case), 3)
    px = man.projx(xs)
    man.assert_check_point_on_manifold(px)
    for x, p in zip(xs, px, strict=True):
        man.assert_check_point_on_manifold(p)
        close(p, man.projx(x), atol(case))


def test_broadcast_proju(case, metric, scaled):
    man = make(case, metric, scaled)
    xs = random_point(case, 4, 4)
    us = randn(xs.shape, xs.dtype, 5)
    pu = man.proju(xs, us)
    man.assert_check_vector_on_tangent(xs, pu)
    for x, u, p in zip(xs, us, pu, strict=True):
        man.assert_check_vector_on_tangent(x, p)
        close(p, man.proju(x, u), atol(case))


def test_broadcast_retr(case, metric, scaled):
    man = make(case, metric, scaled)
    xs = random_point(case, 6, 4)
    us = man.proju(xs, randn(xs.shape, xs.dtype, 7))
    ys = man.retr(xs, us)
    man.assert_check_point_on_manifold(ys)
    for x, u, y in zip(xs, us, ys, strict=True):
        man.assert_check_point_on_manifold(y)
        close(y, man.retr(x, u), atol(case))


def test_broadcast_transp(case, metric, scaled):
    man = make(case, metric, scaled)
    xs = random_point(case, 8, 4)
    us = man.proju(xs, randn(xs.shape, xs.dtype, 9))
    vs = man.proju(xs, randn(xs.shape, xs.dtype, 10))
    ys = man.retr(xs, us)
    qs = man.transp_follow_retr(xs, us, vs)
    man.assert_check_vector_on_tangent(ys, qs)
    for x, u, v, y, q in zip(xs, us, vs, ys, qs, strict=True):
        man.assert_check_vector_on_tangent(y, q)
        close(q, man.transp_follow_retr(x, u, v), atol(case))


def test_reversibility_of_retr_transp(case, metric, scaled):
    """geoopt's reversibility property: (z, q) = retr_transp(x, u, u) and then
    retr_transp(z, −q, q) gives back (x, u) (the Cayley retraction with its own transport).
    The ``reversible`` flag itself is checked in pending/test_reversible_flag.py."""
    man = make(case, metric, scaled)
    xs = random_point(case, 11, 4)
    us = man.proju(xs, randn(xs.shape, xs.dtype, 12) / 3)
    z, q = man.retr_transp(xs, us, us)
    x1, u1 = man.retr_transp(z, -q, q)
    close(x1, xs, atol(case))
    close(u1, us, atol(case))


# ---------------------------------------------------------------- conventions (asserted)
@pytest.mark.parametrize("seed", [1, 2])
def test_convention_canonical_proju_is_a_projection(case, seed):
    """Our ``proju`` is the Euclidean-orthogonal projection whatever the metric: idempotent,
    equal to V − X sym(XᴴV). geoopt's ``CanonicalStiefel.proju(x, v)`` is V − XVᴴX (the
    canonical Riemannian gradient), which we expose as ``egrad2rgrad(metric="canonical")``;
    it is not idempotent on a non-tangent V, which this test shows for real points."""
    man = manifold(case, "canonical")
    x = random_point(case, seed)
    v = randn(x.shape, x.dtype, seed + 20)
    p = man.proju(x, v)
    tol = atol(case)
    close(p, tangent_ref(x, v), tol)
    close(man.proju(x, p), p, tol)  # idempotent
    g = man.egrad2rgrad(x, v)
    close(g, v - x @ v.mH @ x, tol)
    if not x.is_complex():  # geoopt's CanonicalStiefel is real-only
        theirs = geoopt.CanonicalStiefel()
        close(theirs.proju(x, v), g, tol)
        twice = theirs.proju(x, theirs.proju(x, v))
        assert float((twice - theirs.proju(x, v)).norm()) > 1e3 * tol  # not a projection


@pytest.mark.parametrize("metric", METRICS)
def test_convention_cayley_is_a_true_retraction(case, metric):
    """d/dt retr(x, t·u) at t = 0 is u (central difference, O(t²) error). geoopt's
    ``CanonicalStiefel.retr`` has initial velocity (I + XXᴴ)u instead, shown for real
    points (it differs from u by XXᴴu ≠ 0)."""
    man = manifold(case, metric)
    x = random_point(case, 30)
    u = man.proju(x, randn(x.shape, x.dtype, 31))
    t = 1e-5
    vel = (man.retr(x, t * u) - man.retr(x, -t * u)) / (2 * t)
    close(vel, u, 1e-8)
    if not x.is_complex():
        theirs = geoopt.CanonicalStiefel()
        theirs_vel = (theirs.retr(x, t * u) - theirs.retr(x, -t * u)) / (2 * t)
        close(theirs_vel, u + x @ (x.mH @ u), 1e-8)
        assert float((theirs_vel - u).norm()) > 0.1 * float(u.norm())
