"""A step never writes a non-finite value, and an off-manifold point is projected first."""

from __future__ import annotations

import math
import warnings

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel, kernels


def _param(man, dtype, seed=0):
    x = man.random(dtype=dtype, generator=torch.Generator().manual_seed(seed))
    return geoopt.ManifoldParameter(x.as_subclass(torch.Tensor).clone(), manifold=man)


def _step(opt, w, grad):
    w.grad = grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(c.message) for c in caught]


# (optimizer, hyper, dtype, gradient scale): issue 13 item 1's cases
HUGE = [
    ("rgd", dict(lr=0.01), torch.float32, 1e20),
    ("rgd", dict(lr=0.01), torch.float32, 1e38),
    ("rgd", dict(lr=1e20), torch.float32, 1.0),
    ("rgd", dict(lr=1e160), torch.float64, 1.0),
    ("rgd", dict(lr=0.01, retraction="qr"), torch.float32, 1e38),
    ("rgd", dict(lr=0.01, retraction="polar"), torch.float32, 1e38),
    ("rgd", dict(lr=0.01, momentum=0.9), torch.float32, 1e20),
    ("rgd", dict(lr=0.01, momentum=0.9, retraction="polar"), torch.float32, 1e38),
    ("radam", dict(lr=0.01), torch.float32, 1e15),
    ("radam", dict(lr=1e20), torch.float32, 1.0),
]


@pytest.mark.parametrize("name,hyper,dtype,scale", HUGE)
@pytest.mark.parametrize("shape", [(16, 4), (5, 4), (4, 4)])  # SMW, dense, square Cayley
def test_huge_gradient_or_lr_steps_stay_on_manifold(name, hyper, dtype, scale, shape):
    man = Stiefel(*shape)
    w = _param(man, dtype)
    opt = optimizers.create(name, [w], **hyper)
    # (a step of length → ∞ tends to Cayley's limit, the reflection X → −X on
    # span(X, Pd); it is a legitimate point, so each step is compared with the last)
    gen = torch.Generator().manual_seed(5)
    said = []  # skips warn once per optimizer: a later skip was announced by the first
    for k in range(3):
        noise = torch.randn(w.shape, dtype=dtype, generator=gen).clamp(-3, 3)
        grad = torch.full_like(w, scale) if k == 0 else scale * noise
        x0 = w.detach().clone()
        messages = _step(opt, w, grad)
        said += messages
        assert torch.isfinite(w).all()
        err = float(man.orthogonality_error(w.detach()))
        assert err <= 10 * shape[0] * torch.finfo(dtype).eps, (k, err)
        # a step that is computed must have moved; one that is skipped must have said so
        assert float((w.detach() - x0).abs().max()) > 1e-3 or said


def test_scaled_cayley_equals_dense_reference_for_long_steps():
    gen = torch.Generator().manual_seed(3)
    x = kernels.haar(30, 4, dtype=torch.float64, generator=gen)
    d = kernels.proj_tangent(x, torch.randn(30, 4, dtype=torch.float64, generator=gen))
    eye = torch.eye(30, dtype=torch.float64)
    for lr in (1e-3, 1.0, 1e3):
        pu = -lr * d + 0.5 * lr * x @ (x.mH @ d)
        a = pu @ x.mH - x @ pu.mH
        ref = torch.linalg.solve(eye - 0.5 * a, (eye + 0.5 * a) @ x)
        for fn in (kernels.cayley_descent, kernels.cayley_smw, kernels.cayley_dense):
            y = fn(x, d, lr) if fn is kernels.cayley_descent else fn(x, -lr * d)
            assert float((y - ref).abs().max()) < 1e-9, (fn.__name__, lr)


def test_landing_huge_gradient_keeps_the_old_value_and_warns():
    man = Stiefel(16, 4)
    w = _param(man, torch.float32)
    x0 = w.detach().clone()
    opt = optimizers.create("landing", [w], lr=0.01)
    messages = _step(opt, w, torch.full_like(w, 1e20))
    assert torch.equal(w.detach(), x0)
    assert any("not finite" in m and "keep their values" in m for m in messages)
    assert _step(opt, w, torch.full_like(w, 1e20)) == []  # once per optimizer
    assert torch.equal(w.detach(), x0)


@pytest.mark.parametrize("name", ["rgd", "radam"])
@pytest.mark.parametrize("how", ["scaled", "load_state_dict"])
def test_off_manifold_point_is_projected_with_one_warning(name, how):
    man = Stiefel(20, 3)
    w = _param(man, torch.float64)
    opt = optimizers.create(name, [w], lr=0.05)
    if how == "scaled":
        with torch.no_grad():
            w.mul_(3)
    else:
        module = torch.nn.Module()
        module.w = w
        bad = torch.randn(20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        module.load_state_dict({"w": bad})
    off = w.detach().clone()
    messages = _step(opt, w, torch.randn_like(w))
    assert any("off its manifold" in m for m in messages)
    for _ in range(5):
        assert "off its manifold" not in " ".join(_step(opt, w, torch.randn_like(w)))
        assert float(man.orthogonality_error(w.detach())) < 1e-12
    # it was projected to the polar factor of the off point, then stepped from there
    assert float((w.detach() - kernels.polar(off)).abs().max()) < 1.0


def test_landing_accepts_off_manifold_points_without_projection():
    man = Stiefel(20, 3)
    w = _param(man, torch.float64)
    with torch.no_grad():
        w.mul_(1.5)
    opt = optimizers.create("landing", [w], lr=0.05)
    messages = _step(opt, w, torch.zeros_like(w))
    assert not messages
    err = float(man.orthogonality_error(w.detach()))
    assert 0 < err < 1.25 * 3**0.5  # moved towards the manifold, not projected onto it


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("name", ["rgd", "radam"])
@pytest.mark.parametrize("retraction", ["qr", "cayley"])
def test_points_are_tested_on_schedule_and_after_every_outside_edit(
    name, retraction, rows, monkeypatch
):
    # Notes [The drift correction every k-th step], [Tall steps correct every k-th
    # step] and [Points as the optimizer left them]: the wide Gram is formed at steps
    # 0, k, 2k, … (k = 4 for M = 64: Note [The correction period grows with n]), on
    # O(64) and St(128, 64) alike, and at the first step after an in-place edit,
    # which is then projected at once
    from stiefel.manifolds import Stiefel
    from stiefel.manifolds.kernels import frame

    calls = []
    wide = frame.wide_gram
    monkeypatch.setattr(frame, "wide_gram", lambda x, *a, **k: calls.append(1) or wide(x, *a, **k))
    m, k = 64, 4
    man = Stiefel(rows, m)
    w = _param(man, torch.float32)
    opt = optimizers.create(name, [w], lr=0.01, retraction=retraction)
    gen = torch.Generator().manual_seed(3)
    # without a step count (the first step, a point just projected) a tall point's
    # Gram is formed in its own dtype, a square point's in float64
    uncounted = 1 if rows == m else 0
    for _ in range(2 * frame.MAX_PERIOD):
        assert _step(opt, w, torch.randn(rows, m, generator=gen)) == []
    assert len(calls) == 2 * frame.MAX_PERIOD // k - 1 + uncounted
    with torch.no_grad():
        w.mul_(3)  # an in-place edit: the version counter moves
    messages = _step(opt, w, torch.randn(rows, m, generator=gen))
    assert any("off its manifold" in m for m in messages)
    # the test, then the projected point's
    assert len(calls) == 2 * frame.MAX_PERIOD // k + 2 * uncounted
    assert float(man.orthogonality_error(w.detach())) < 1e-5


def test_square_point_edited_through_data_is_projected_at_the_next_correcting_step():
    # `.data` has its own version counter: the edit is seen by the test of the next step
    # that forms the Gram (every correction_period(n)-th step); the steps before it are
    # X·Q with Q unitary, which keeps ‖XᴴX − I‖ (no divergence)
    from stiefel.manifolds import Orthogonal
    from stiefel.manifolds.kernels import frame

    n = 64
    period = frame.correction_period(n)
    assert period > 2  # steps between the edit and the test
    man = Orthogonal(n)
    w = _param(man, torch.float64)
    opt = optimizers.create("rgd", [w], lr=0.01, retraction="qr")
    gen = torch.Generator().manual_seed(4)
    assert _step(opt, w, torch.randn(n, n, dtype=torch.float64, generator=gen)) == []
    w.data.mul_(2)  # ‖XᴴX − I‖_F = 3√n
    far = float(man.orthogonality_error(w.detach()))
    warned = []
    for step in range(1, frame.MAX_PERIOD + 1):  # the steps done before this one
        messages = _step(opt, w, torch.randn(n, n, dtype=torch.float64, generator=gen))
        if any("off its manifold" in m for m in messages):
            warned.append(step)
        elif not warned:
            err = float(man.orthogonality_error(w.detach()))
            assert abs(err - far) < 1e-9 * far  # kept, not amplified
    assert warned == [period]  # the first correcting step after the edit, warned once
    assert float(man.orthogonality_error(w.detach())) < 1e-12


def _riemannian_names():
    return [
        n
        for n in optimizers.available()
        if isinstance(cls := optimizers.get(n), type)
        and issubclass(cls, optimizers.RiemannianOptimizer)
    ]


@pytest.mark.parametrize("name", _riemannian_names())
@pytest.mark.parametrize("shape", [(20, 4), (256, 64)])
def test_a_point_assigned_to_data_is_tested_at_the_next_step(name, shape):
    # `p.data = t` leaves p's version counter as it was and changes its storage: the
    # next step tests the point (Note [Points as the optimizer left them]); before,
    # a tall rgd point 3× off grew to inf within 3 steps and was then frozen
    man = Stiefel(*shape)
    w = _param(man, torch.float32)
    opt = optimizers.create(name, [w], lr=1e-3)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        _step(opt, w, 0.01 * torch.randn(shape, generator=gen))
    w.data = 3 * w.detach().clone()
    messages = _step(opt, w, 0.01 * torch.randn(shape, generator=gen))
    err = float(man.orthogonality_error(w.detach().double()))
    if math.isinf(opt.off_manifold_bound):  # landing: its attraction brings it back
        assert not messages and torch.isfinite(w).all()
        return
    assert any("off its manifold" in m for m in messages), messages
    assert err < 100 * shape[1] * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("shape", [(20, 4), (256, 64)])
def test_pogo_is_not_frozen_by_a_point_edited_in_place_outside_its_basin(shape):
    # an in-place edit through `.data` (its own version counter) outside POGO's basin
    # makes the step fail; the skipped step forgets the optimizer's record, so the next
    # step tests and projects the point (before: every later step was skipped)
    man = Stiefel(*shape)
    w = _param(man, torch.float32)
    opt = optimizers.create("pogo", [w], lr=1e-3)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        _step(opt, w, 0.01 * torch.randn(shape, generator=gen))
    w.data.mul_(3)
    said = [m for _ in range(2) for m in _step(opt, w, 0.01 * torch.randn(shape, generator=gen))]
    assert any("not finite" in m for m in said) and any("off its manifold" in m for m in said)
    before = w.detach().clone()
    _step(opt, w, 0.01 * torch.randn(shape, generator=gen))
    assert not torch.equal(w.detach(), before)  # it steps again
    assert float(man.orthogonality_error(w.detach().double())) < 1e-5
