"""A skipped step leaves the optimizer state as it was (issue 13).

Every registered `RiemannianOptimizer` (read from the registry) is stepped a few
times, then given a step whose result is declared non-finite: its state must
equal, tensor for tensor, the state before that step, and the run must go on
exactly as a twin run that never saw the rejected gradient.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.optimizers import RiemannianOptimizer, engine, master


def _ours() -> list[str]:
    return [
        name
        for name in optimizers.available()
        if inspect.isclass(optimizers.get(name))
        and issubclass(optimizers.get(name), RiemannianOptimizer)
    ]


def _hyper(name: str) -> dict:
    """The default lr, and momentum where the rule has one (so there is a buffer).

    pogo's momentum is its sgd base's; its default base (VectorAdam) keeps moments.
    """
    hyper = {"lr": optimizers.info(name).default_lr}
    if "momentum" in inspect.signature(optimizers.get(name)).parameters and name != "pogo":
        hyper["momentum"] = 0.9
    return hyper


def _setup(name: str):
    man = Stiefel(16, 4)
    gen = torch.Generator().manual_seed(0)
    w = geoopt.ManifoldParameter(man.random(dtype=torch.float32, generator=gen), manifold=man)
    b = torch.nn.Parameter(torch.randn(5, generator=gen))  # a plain tensor: the Euclidean rule
    return man, [w, b], optimizers.create(name, [w, b], **_hyper(name))


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _step(opt, params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(c.message) for c in caught]


def _snapshot(opt, params):
    return [
        {
            k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in master.strip(opt.state[p]).items()
        }
        for p in params
    ]


def _assert_same_state(before, after):
    for s0, s1 in zip(before, after, strict=True):
        assert sorted(s0) == sorted(s1)
        for key in s0:
            if isinstance(s0[key], torch.Tensor):
                assert torch.equal(s0[key], s1[key]), key
            else:
                assert s0[key] == s1[key], key


@pytest.mark.parametrize("name", _ours())
@pytest.mark.parametrize("before", [0, 3])  # the very first step, and one with state
def test_skipped_step_leaves_state_and_point_unchanged(name, before, monkeypatch):
    _, params, opt = _setup(name)
    _, twin_params, twin = _setup(name)
    for k in range(before):
        _step(opt, params, _grads(params, k))
        _step(twin, twin_params, _grads(params, k))
    state0 = _snapshot(opt, params)
    points0 = [p.detach().clone() for p in params]
    with monkeypatch.context() as patch:  # the result of this step "is not finite"
        patch.setattr(engine, "finite", lambda new: torch.tensor(False))
        messages = _step(opt, params, _grads(params, 99))
    assert any("keep their values" in m for m in messages)
    _assert_same_state(state0, _snapshot(opt, params))
    for p, p0 in zip(params, points0, strict=True):
        assert torch.equal(p.detach(), p0)
    # the run goes on as if the rejected gradient had never come
    for k in range(before, before + 2):
        _step(opt, params, _grads(params, k))
        _step(twin, twin_params, _grads(params, k))
    _assert_same_state(_snapshot(twin, twin_params), _snapshot(opt, params))
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("name", _ours())
def test_state_rollback_after_an_error_in_the_rule(name, monkeypatch):
    _, params, opt = _setup(name)
    _step(opt, params, _grads(params, 0))
    state0 = _snapshot(opt, params)
    geo_error = RuntimeError("kernel failed")
    # the rule fails after it has touched its state: nothing stays half-modified
    original = type(opt).update

    def update_then_fail(self, geo, x, grad, state, group):
        original(self, geo, x, grad, state, group)
        raise geo_error

    monkeypatch.setattr(type(opt), "update", update_then_fail)
    with pytest.raises(RuntimeError, match="kernel failed"):
        _step(opt, params, _grads(params, 1))
    _assert_same_state(state0, _snapshot(opt, params))


def test_real_overflow_skip_rolls_back_landing_and_rgd_momentum():
    """Steps that really come out non-finite (no patching)."""
    man = Stiefel(16, 4)
    for name, hyper, scale in [
        ("landing", dict(lr=0.01), 1e20),
        ("rgd", dict(lr=0.01, momentum=0.9, retraction="qr"), 3e38),
    ]:
        w = geoopt.ManifoldParameter(man.random(dtype=torch.float32), manifold=man)
        opt = optimizers.create(name, [w], **hyper)
        _step(opt, [w], [torch.randn(w.shape)])
        state0 = _snapshot(opt, [w])
        x0 = w.detach().clone()
        messages = _step(opt, [w], [torch.full(w.shape, scale)])
        assert any("keep their values" in m for m in messages), (name, messages)
        assert torch.equal(w.detach(), x0)
        _assert_same_state(state0, _snapshot(opt, [w]))


class _InPlace(RiemannianOptimizer):
    """A plugin rule that writes into its state but declares it does not."""

    writes_state_in_place = False

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr, retraction="qr", repair_every=None))

    def update(self, geo, x, grad, state, group):
        buf = state.setdefault("buf", torch.zeros_like(x))
        buf.add_(grad)
        return geo.descend(x, geo.rgrad(x, buf), group["lr"])


def test_broken_promise_of_a_rule_raises():
    w = torch.nn.Parameter(torch.randn(3))
    opt = _InPlace([w])
    _step(opt, [w], [torch.ones(3)])  # creates the buffer: nothing written in place yet
    with pytest.raises(RuntimeError, match="writes_state_in_place"):
        _step(opt, [w], [torch.ones(3)])


def test_plugin_writing_in_place_is_rolled_back_by_copy(monkeypatch):
    monkeypatch.setattr(_InPlace, "writes_state_in_place", True)
    w = torch.nn.Parameter(torch.randn(3))
    opt = _InPlace([w])
    _step(opt, [w], [torch.ones(3)])
    state0 = _snapshot(opt, [w])
    monkeypatch.setattr(engine, "finite", lambda new: torch.tensor(False))
    _step(opt, [w], [torch.ones(3)])
    _assert_same_state(state0, _snapshot(opt, [w]))


def test_a_run_whose_every_step_is_skipped_is_warned_again_as_it_goes_on():
    # a skipped step keeps its point and state, so a full-batch gradient repeats it: a run
    # that stands still had one warning only, at its first step. It is warned again at
    # the 10th and 100th skip, with the count; the reference is the count of steps.
    st = Stiefel(6, 3)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = optimizers.create("rgd", [w], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(120):
            w.grad = torch.full_like(w, float("nan"))
            opt.step()
    messages = [str(c.message) for c in caught if "non-finite gradient" in str(c.message)]
    assert len(messages) == 3
    assert "10 steps of a parameter (index 0 of param group 0" in messages[1]
    assert "100 steps of a parameter" in messages[2] and "may have stalled" in messages[2]
    # many parameters skipped once (one bad batch) are not a stall: one warning
    ws = [geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st) for _ in range(20)]
    opt = optimizers.create("rgd", ws, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for w in ws:
            w.grad = torch.full_like(w, float("nan"))
        opt.step()
    assert len([c for c in caught if "non-finite gradient" in str(c.message)]) == 1
