"""Buckets (Note [One rule call per bucket]): parameters of one kind stepped by one rule call.

The reference of every equality here is the per-parameter path (``foreach=False``),
each parameter stepped by its own rule call, the 0.3 behaviour; the counts of ATen ops
and host reads come from a dispatch mode, independent of the machine's load.
"""

from __future__ import annotations

import inspect
import operator
import warnings

import geoopt
import pytest
import torch
from _optim_problems import builtin_rule_names, rule_names_taking

from stiefel import optimizers
from stiefel.benchmarks.launch import StepCounter as Count  # a dispatch mode, written once
from stiefel.manifolds import Orthogonal, Stiefel


def _hyper_sets(name: str) -> list[dict]:
    """The defaults, and every option of the rule that takes another branch of it."""
    params = inspect.signature(optimizers.get(name)).parameters
    sets = [{}]
    if "momentum" in params:
        sgd = {"base": "sgd"} if name == "pogo" else {}  # pogo's momentum is its sgd base's
        sets.append(
            {**sgd, "momentum": 0.9, **({"nesterov": True} if "nesterov" in params else {})}
        )
        sets.append(
            {**sgd, "momentum": 0.5, **({"dampening": 0.1} if "dampening" in params else {})}
        )
    if "weight_decay" in params:
        sets.append({"weight_decay": 0.1})
    if "repair_every" in params:
        sets.append({"repair_every": 2})
    if name == "rgd":
        sets.append({"retraction": "qr", "metric": "canonical"})
    if name == "pogo":
        sets.append({"base": "sgd", "momentum": 0.9})
        sets.append({"betas": (0.8, 0.99), "eps": 1e-6})
    if name == "manifold_muon":
        sets = [{**h, "inner_steps": 2} for h in sets]
    return sets


#: every rule that takes ``foreach``, each option set passed only to a rule that takes it
CASES = [(name, hyper) for name in rule_names_taking("foreach") for hyper in _hyper_sets(name)]
#: (shape of one parameter, complex): tall, square, batched, complex
KINDS = [((9, 3), False), ((5, 5), False), ((2, 7, 3), False), ((6, 3), True)]


def _model(kinds, seed: int):
    """Three manifold parameters of each kind and two plain vectors (one group)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape, cplx in kinds:
        man = Stiefel(*shape[-2:], complex=cplx)
        dtype = torch.complex128 if cplx else torch.float64
        for _ in range(3):
            x = man.random(*shape, dtype=dtype, generator=gen)
            params.append(geoopt.ManifoldParameter(x, manifold=man))
    params += [
        torch.nn.Parameter(torch.randn(4, dtype=torch.float64, generator=gen)) for _ in range(2)
    ]
    return params


def _twin(p: torch.Tensor) -> torch.Tensor:
    """A copy of parameter ``p``, on its manifold if it has one."""
    if isinstance(p, geoopt.ManifoldParameter):
        return geoopt.ManifoldParameter(p.detach().clone(), manifold=p.manifold)
    return torch.nn.Parameter(p.detach().clone())


def _run(name, hyper, foreach, steps=6, seed=0, kinds=KINDS):
    params = _model(kinds, seed)
    opt = optimizers.create(name, params, lr=0.05, foreach=foreach, **hyper)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize(("name", "hyper"), CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_bucketed_step_equals_the_per_parameter_step(name, hyper):
    ours, opt = _run(name, hyper, foreach=True)
    ref, ref_opt = _run(name, hyper, foreach=False)
    for p, q in zip(ours, ref, strict=True):
        tol = 100 * p.numel() * torch.finfo(p.real.dtype).eps
        assert (p.detach() - q.detach()).abs().max() <= tol
        # the state is per parameter, in torch's format, and equal to the reference's
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert {k for k in mine if not k.startswith("_")} == {
            k for k in theirs if not k.startswith("_")
        }
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert mine[key].shape == value.shape, key
                assert (mine[key] - value.to(mine[key].device)).abs().max() <= tol, key


def test_a_bucket_is_one_rule_call():
    calls = []
    params = _model([((9, 3), False)] * 4, seed=2)  # 12 parameters of one kind, 2 plain
    opt = optimizers.create("radam", params, lr=0.05)
    update = opt.update
    opt.update = lambda geo, x, *a: calls.append(tuple(x.shape)) or update(geo, x, *a)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert sorted(calls) == [(2, 4), (12, 9, 3)]  # the plain vectors stacked too (Adam)
    calls.clear()
    opt.param_groups[0]["foreach"] = False
    opt.step()
    assert len(calls) == 14


def _counts(opt, params) -> tuple[int, int]:
    for p in params:
        p.grad = torch.ones_like(p) * 0.1
    opt.step()
    opt.step()
    with Count(opt) as c:
        opt.step()
    return c.ops, c.reads


def test_every_builtin_rule_declares_buckets_and_takes_torchs_options():
    # a plugin may step one parameter at a time (buckets_points False, as documented) and
    # is left out of the count below; every rule of this package must stack its points
    names = builtin_rule_names()
    assert {"rgd", "radam", "landing", "manifold_muon", "pogo"} <= set(names)
    assert [n for n in names if not optimizers.get(n).buckets_points] == []
    assert set(rule_names_taking("foreach", "capturable", "telemetry")) >= set(names)


@pytest.mark.parametrize(
    "name", [n for n in rule_names_taking("foreach") if optimizers.get(n).buckets_points]
)
def test_ops_per_step_do_not_grow_with_the_number_of_parameters(name):
    man = Stiefel(16, 4)
    points = man.random(40, 16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    separate = [geoopt.ManifoldParameter(x.clone(), manifold=man) for x in points]
    stacked = [geoopt.ManifoldParameter(points.clone(), manifold=man)]
    ops, reads = _counts(optimizers.create(name, separate, lr=1e-3), separate)
    ops1, reads1 = _counts(optimizers.create(name, stacked, lr=1e-3), stacked)
    assert ops <= 1.5 * ops1, (ops, ops1)
    assert reads <= reads1  # no read per parameter
    old, _ = _counts(optimizers.create(name, separate, lr=1e-3, foreach=False), separate)
    assert old > 20 * ops  # the per-parameter path: a rule call each


@pytest.mark.parametrize("name", ["landing", "pogo"])
def test_one_host_read_per_step(name):
    # the flags of every bucket in one read (Note [One host read per step]); the rules
    # of landing and pogo read nothing
    man = Orthogonal(6)
    params = [
        geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man) for _ in range(9)
    ]
    params += [
        geoopt.ManifoldParameter(Stiefel(8, 2).random(dtype=torch.float64), manifold=Stiefel(8, 2))
    ]
    assert _counts(optimizers.create(name, params, lr=1e-3), params)[1] == 1


@pytest.mark.parametrize(
    ("name", "hyper"),
    # polar: LAPACK's SVD refuses the whole stacked bucket for one NaN matrix
    [("radam", {}), ("rgd", {"retraction": "polar"})],
)
def test_a_skipped_parameter_keeps_its_point_and_state_and_the_others_step(name, hyper):
    ours, opt = _run(name, hyper, foreach=True, steps=2, kinds=[((9, 3), False)])
    ref, ref_opt = _run(name, hyper, foreach=False, steps=2, kinds=[((9, 3), False)])
    before = ours[1].detach().clone()
    state_before = {
        k: v.clone() for k, v in opt.state[ours[1]].items() if isinstance(v, torch.Tensor)
    }
    gen = torch.Generator().manual_seed(9)
    for step in range(3):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in ours]
        if step == 0:
            grads[1] = torch.full_like(grads[1], float("nan"))
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
            ref_opt.step()
        if step == 0:
            assert torch.equal(ours[1].detach(), before)
            for k, v in state_before.items():
                assert torch.equal(opt.state[ours[1]][k], v), k
            assert any("non-finite gradient" in str(w.message) for w in caught)
    for p, q in zip(ours, ref, strict=True):
        assert (p.detach() - q.detach()).abs().max() < 1e-12
    assert int(opt.state[ours[1]]["step"]) == int(opt.state[ours[0]]["step"]) - 1


def test_a_rule_that_raises_leaves_every_parameter_and_state_unchanged():
    params, opt = _run("rgd", {"momentum": 0.9}, foreach=True, steps=2)
    points = [p.detach().clone() for p in params]
    states = {
        id(p): {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for p in params
    }
    calls = []

    def fail_on_the_second(geo, x, grad, state, group):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a corrupted state")
        return type(opt).update(opt, geo, x, grad, state, group)

    opt.update = fail_on_the_second
    with pytest.raises(RuntimeError, match="corrupted"):
        opt.step()
    for p, x in zip(params, points, strict=True):
        assert torch.equal(p.detach(), x)
        for k, v in states[id(p)].items():
            assert torch.equal(opt.state[p][k], v)


def test_state_dict_is_per_parameter_and_loads_into_the_per_parameter_path():
    ours, opt = _run("radam", {}, foreach=True, steps=3, kinds=[((9, 3), False)])
    sd = opt.state_dict()
    assert all(sd["state"][i]["step"].dim() == 0 for i in sd["state"])
    assert all(sd["state"][i]["exp_avg"].shape == (9, 3) for i in range(3))
    assert not any(k.startswith("_") for s in sd["state"].values() for k in s)
    twin = [_twin(p) for p in ours]
    loaded = optimizers.create("radam", twin, lr=0.05, foreach=False)
    loaded.load_state_dict(sd)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for p, q in zip(ours, twin, strict=True):
            p.grad = q.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        opt.step()
        loaded.step()
    for p, q in zip(ours, twin, strict=True):
        assert (p.detach() - q.detach()).abs().max() < 1e-12


def test_a_group_added_later_is_stepped_in_its_own_buckets():
    man = Stiefel(9, 3)
    first = [
        geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man) for _ in range(2)
    ]
    later = [
        geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man) for _ in range(2)
    ]
    twin = [geoopt.ManifoldParameter(p.detach().clone(), manifold=man) for p in first + later]
    opt = optimizers.create("rgd", first, lr=0.05)
    ref = optimizers.create("rgd", twin[:2], lr=0.05, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": later})
            ref.add_param_group({"params": twin[2:]})
        for p, q in zip(opt.param_groups[0]["params"] + later, twin, strict=False):
            p.grad = q.grad = torch.randn(9, 3, dtype=torch.float64, generator=gen)
        opt.step()
        ref.step()
    for p, q in zip(first + later, twin, strict=True):
        assert (p.detach() - q.detach()).abs().max() < 1e-12
        assert man.check_point_on_manifold(p.detach())


def test_bad_foreach_and_capturable_are_refused_naming_them():
    w = geoopt.ManifoldParameter(Stiefel(5, 2).random(), manifold=Stiefel(5, 2))
    with pytest.raises(TypeError, match="foreach='yes'"):
        optimizers.create("rgd", [w], lr=0.1, foreach="yes")
    with pytest.raises(
        ValueError, match="capturable=True needs every parameter on one CUDA device.*cpu"
    ):
        optimizers.create("rgd", [w], lr=0.1, capturable=True)
    opt = optimizers.create("rgd", [w], lr=0.1)
    with pytest.raises(ValueError, match="capturable"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "capturable": True})
    assert len(opt.param_groups) == 1


@pytest.mark.slow
def test_compiled_step_of_a_24_parameter_model_has_no_graph_break():
    man = Stiefel(8, 4)
    params = [geoopt.ManifoldParameter(man.random(), manifold=man) for _ in range(12)]
    params += [
        geoopt.ManifoldParameter(Orthogonal(4).random(), manifold=Orthogonal(4)) for _ in range(8)
    ]
    params += [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    twin = [p.detach().clone() for p in params]
    opt = optimizers.create("rgd", params, lr=0.05, momentum=0.9)
    ref = optimizers.create(
        "rgd",
        [
            geoopt.ManifoldParameter(t, manifold=p.manifold)
            if hasattr(p, "manifold")
            else torch.nn.Parameter(t)
            for p, t in zip(params, twin, strict=True)
        ],
        lr=0.05,
        momentum=0.9,
    )
    step = torch.compile(opt.step, backend="eager", fullgraph=True)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, q, g in zip(params, ref.param_groups[0]["params"], grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        step()  # fullgraph=True: a graph break raises
        ref.step()
    for p, q in zip(params, ref.param_groups[0]["params"], strict=True):
        assert (p.detach() - q.detach()).abs().max() < 1e-5


def test_a_steady_bucket_stacks_its_points_and_gradients_but_not_its_state(monkeypatch):
    # Note [One rule call per bucket]: the views a step hands out are the next step's state
    params = _model([((9, 3), False)] * 2, seed=7)[:6]
    opt = optimizers.create("radam", params, lr=0.05)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    held = {id(t) for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)}
    stacks = []
    stack = torch.stack
    monkeypatch.setattr(
        torch, "stack", lambda ts, *a, **k: stacks.append(list(ts)) or stack(ts, *a, **k)
    )
    grads = [p.grad for p in params]
    opt.step()
    # stacks over the 6 parameters: the points and the gradients; the four state keys are views
    assert sum(len(ts) == 6 and all(map(operator.is_, ts, params)) for ts in stacks) == 1
    assert sum(len(ts) == 6 and all(map(operator.is_, ts, grads)) for ts in stacks) == 1
    assert not any(id(t) in held for ts in stacks for t in ts)
    base = opt.state[params[0]]["exp_avg"]._base
    assert base is not None and all(opt.state[p]["exp_avg"]._base is base for p in params)


class _NormClip(optimizers.RiemannianOptimizer):
    """A plugin as docs/plugins.md writes one: a rule for one parameter, with a reduction
    over the whole tensor (the norm of its Riemannian gradient)."""

    def __init__(self, params, lr=1.0, max_norm=0.1):
        super().__init__(params, dict(lr=lr, max_norm=max_norm, retraction="qr", repair_every=None))

    def update(self, geo, x, grad, state, group):
        xi = geo.rgrad(x, grad)
        return geo.descend(x, xi * min(1.0, group["max_norm"] / float(xi.norm())), group["lr"])


@pytest.mark.parametrize("foreach", [None, True])
def test_a_plugin_steps_one_parameter_at_a_time_unless_it_declares_batches(foreach):
    # buckets_points is False for a plugin: its update sees one parameter, as documented,
    # and a whole-tensor reduction means what it says whatever foreach asks
    st = Stiefel(16, 4)
    gen = torch.Generator().manual_seed(3)
    starts = [st.random(generator=gen, dtype=torch.float64) for _ in range(4)]
    grads = [torch.randn(16, 4, generator=gen, dtype=torch.float64) for _ in starts]
    runs = []
    for fe in (foreach, False):
        ws = [geoopt.ManifoldParameter(x.clone(), manifold=st) for x in starts]
        opt = _NormClip(ws)
        opt.param_groups[0]["foreach"] = fe
        for w, g in zip(ws, grads, strict=True):
            w.grad = g.clone()
        opt.step()
        runs.append(torch.stack([w.detach() for w in ws]))
    assert torch.equal(runs[0], runs[1])


def test_a_batched_rule_with_a_state_not_one_row_per_parameter_writes_nothing():
    # a rule that declares buckets_points but keeps a 0-dim count: refused before any
    # parameter or state is written (Note [Safe step])
    class Counting(_NormClip):
        buckets_points = True

        def update(self, geo, x, grad, state, group):
            state["n"] = state.get("n", torch.tensor(0.0)) + 1
            return super().update(geo, x, grad, state, group)

    st = Stiefel(16, 4)
    ws = [geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st) for _ in range(3)]
    before = [w.detach().clone() for w in ws]
    opt = Counting(ws)
    opt.param_groups[0]["foreach"] = True
    for w in ws:
        w.grad = torch.randn_like(w)
    with pytest.raises(
        ValueError, match=r"state\['n'\] of shape \(\).*one row per parameter"
    ) as err:
        opt.step()
    assert "edited by hand" not in str(err.value)  # the rule is at fault, not a loaded state
    assert all(torch.equal(w, b) for w, b in zip(ws, before, strict=True))
    assert all(not opt.state[w] for w in ws)
