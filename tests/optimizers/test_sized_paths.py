"""A step's short paths sized by what the last step measured, read with its flags.

A default step reads nothing but its flags, once (Note [One host read per step]);
the bounds its near-identity solves measured are read with them and size the next
step's Euler product. The reference is the same optimizer under
``stiefel.dispatch.policy(reference=True)``, where every such solve is an LU solve.
"""

from __future__ import annotations

import contextlib

import geoopt
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stiefel import optimizers
from stiefel.dispatch import policy
from stiefel.manifolds import Orthogonal, Stiefel
from stiefel.manifolds.kernels import reads, scaling
from stiefel.manifolds.kernels.reads import StepChecks, taken_as_one


class _Solves(TorchDispatchMode):
    """Counts the LU solves and factorizations and the host reads dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.lu = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.lu += "lu_factor" in name or "linalg_solve" in name
        self.reads += name in ("aten._local_scalar_dense.default", "aten.is_nonzero.default")
        return func(*args, **(kwargs or {}))


def _run(manifold, lrs, reference: bool, counted: bool = False):
    gen = torch.Generator().manual_seed(4)
    n, m = manifold.n, manifold.m if isinstance(manifold, Stiefel) else manifold.n
    points = [
        torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))[0] for _ in range(8)
    ]
    params = [geoopt.ManifoldParameter(x.clone(), manifold=manifold) for x in points]
    opt = optimizers.create("rgd", params, lr=lrs[0], momentum=0.5)
    counts = []
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        with policy(reference=True) if reference else _Solves() as mode:
            opt.step()
        if counted:
            counts.append((mode.lu, mode.reads))
    return torch.stack([p.detach() for p in params]), counts


MANIFOLDS = [
    pytest.param(Stiefel(16, 4), id="St(16,4)-woodbury"),
    pytest.param(Orthogonal(6), id="O(6)-square"),
]


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_after_the_first_step_the_near_identity_solves_take_euler_s_product(manifold):
    lrs = [1e-3] * 4
    ours, counts = _run(manifold, lrs, reference=False, counted=True)
    ref, _ = _run(manifold, lrs, reference=True)
    assert counts[0][0] > 0  # the first step knows no bound: LU solves
    assert [lu for lu, _ in counts[1:]] == [0, 0, 0]  # then the product, sized by the last
    assert all(reads <= 1 for _, reads in counts)  # still the step's one read
    tol = 100 * manifold.n * torch.finfo(torch.float64).eps
    assert float((ours - ref).abs().max()) <= tol


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_a_step_far_longer_than_the_last_is_taken_again_exactly(manifold):
    lrs = [1e-4, 1e-4, 5e-2, 5e-2]  # the third step's bound is hundreds of times the last
    ours, counts = _run(manifold, lrs, reference=False, counted=True)
    ref, _ = _run(manifold, lrs, reference=True)
    assert counts[1][0] == 0  # sized by the first step
    assert counts[2][0] > 0  # refused: taken again on the exact paths
    tol = 100 * manifold.n * torch.finfo(torch.float64).eps
    assert float((ours - ref).abs().max()) <= tol


def test_a_scale_is_taken_as_one_only_where_the_last_step_found_it_one():
    ones, fours = torch.ones(3, 1, 1), torch.tensor([1.0, 4.0, 1.0]).reshape(3, 1, 1)
    checks = StepChecks({"s": 1.0})
    assert taken_as_one(checks, "s", ones) and bool(checks[-1])  # the pass skipped
    assert taken_as_one(checks, "s", fours) and not bool(checks[-1])  # refused: again
    assert [float(v) for _, v in checks.measured] == [1.0, 4.0]
    assert not taken_as_one(StepChecks({"s": 4.0}), "s", ones)  # the last one was not 1
    assert not taken_as_one(StepChecks(), "s", ones)  # no last step
    assert not taken_as_one([], "s", ones) and not taken_as_one(None, "s", ones)


RULES = [
    pytest.param("rgd", {}, id="rgd"),
    pytest.param("rgd", {"momentum": 0.9}, id="rgd-momentum"),  # its rgrad's gradient scale
    pytest.param("radam", {}, id="radam"),
]


def _scaled_run(name, hyper, manifold, divide_always: bool, monkeypatch, big: float = 1e30):
    """Four float32 steps whose third gradient is ``big``; the points, and the passes over
    a whole gradient-sized tensor by a (…, 1, 1) scale of the last step."""
    if divide_always:  # the kernels' and the rules' scales
        for module in (reads, scaling):
            monkeypatch.setattr(module, "taken_as_one", lambda checks, site, scale: False)
    gen = torch.Generator().manual_seed(9)
    params = [
        geoopt.ManifoldParameter(manifold.random(generator=gen), manifold=manifold)
        for _ in range(3)
    ]
    opt = optimizers.create(name, params, lr=1e-2, **hyper)
    passes = _Passes(params[0].shape)
    for k in range(4):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            p.grad = g * big if k == 2 else g
        with passes if k == 3 else contextlib.nullcontext():
            opt.step()
    monkeypatch.undo()
    return torch.stack([p.detach() for p in params]), passes.count


class _Passes(TorchDispatchMode):
    """Counts divisions and products of a tensor of the points' size by a per-matrix scale."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape, self.count = tuple(shape[-2:]), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor) and all(
            isinstance(a, torch.Tensor) for a in args[:2]
        ):
            a, b = args[:2]
            self.count += tuple(a.shape[-2:]) == self.shape and tuple(b.shape[-2:]) == (1, 1)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("name", "hyper"), RULES)
@pytest.mark.parametrize(
    "manifold",
    [pytest.param(Stiefel(16, 4), id="St(16,4)"), pytest.param(Orthogonal(6), id="O(6)")],
)
def test_a_gradient_grown_past_the_free_scale_is_stepped_as_with_every_division(
    name, hyper, manifold, monkeypatch
):
    # float32: free_scale ≈ 2.9e17 at St(16, 4); the third gradient is 1e30
    sized, _ = _scaled_run(name, hyper, manifold, False, monkeypatch)
    divided, _ = _scaled_run(name, hyper, manifold, True, monkeypatch)
    assert torch.isfinite(sized).all()
    assert float((sized - divided).abs().max()) <= 100 * 16 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize(("name", "hyper"), RULES)
def test_ordinary_gradients_skip_the_passes_of_their_scales(name, hyper, monkeypatch):
    # the gradient's, the direction's and radam's second-moment scales: each division by a
    # scale found 1 at the last step, and its product back, is a pass the step does not make
    st = Stiefel(64, 4)
    _, skipped = _scaled_run(name, hyper, st, False, monkeypatch, big=1.0)
    _, divided = _scaled_run(name, hyper, st, True, monkeypatch, big=1.0)
    assert divided > 0 and skipped == 0
