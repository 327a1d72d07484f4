"""Values set in a param group after construction are checked at the next step.

Note [Values set after construction]: a value the constructor refuses, set in
``param_groups`` by hand or by ``load_state_dict``, is refused at the next step with
the constructor's own error (the reference), before anything is written; a value
that did not change is not checked again (no host read, and no code of the group
checks entered: ``test_step_files``).
"""

from __future__ import annotations

import copy

import geoopt
import pytest
import torch
from _optim_problems import rule_names

from stiefel import optimizers, orthogonalize
from stiefel.benchmarks.launch import StepCounter
from stiefel.manifolds import Stiefel

#: per optimizer, values its constructor refuses (beside lr, which every one checks)
REFUSED = {
    "rgd": [("momentum", 1.5), ("dampening", 2.0), ("retraction", "nope")],
    "radam": [("betas", (1.0, 0.999)), ("eps", 0.0), ("amsgrad", "yes")],
    "landing": [("attraction", -1.0), ("eps", -0.5)],
    "manifold_muon": [("momentum", 1.5), ("inner_steps", 0)],
    "pogo": [("lam", 2.0), ("betas", (1.0, 0.999))],
}


def _cases() -> list[tuple[str, str, object]]:
    names = rule_names()
    assert set(REFUSED) <= set(names)
    return [(n, "lr", bad) for n in names for bad in (-1.0, float("nan"))] + [
        (n, key, bad) for n, bads in REFUSED.items() for key, bad in bads
    ]


def _extra(name: str, key: str) -> dict:
    """pogo's betas belong to its adam base (on its sgd base they are refused as unused)."""
    return {"base": "adam"} if name == "pogo" and key == "betas" else {}


def _model(name: str, **hyper):
    torch.manual_seed(0)
    man = Stiefel(6, 3)
    w = geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man)
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = optimizers.create(name, [w, b], lr=0.05, **hyper)
    for _ in range(2):  # a state to keep
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        opt.step()
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    return opt, (w, b)


def _refusal(name: str, key: str, bad: object) -> tuple[type, str]:
    """The constructor's own error for the value: the reference."""
    hyper = {"lr": 0.05, **_extra(name, key), key: bad}
    with pytest.raises((ValueError, TypeError)) as err:
        optimizers.create(name, [torch.nn.Parameter(torch.zeros(3))], **hyper)
    return err.type, str(err.value)


@pytest.mark.parametrize(("name", "key", "bad"), _cases())
def test_a_value_set_after_construction_is_refused_at_the_step_as_the_constructor_does(
    name, key, bad
):
    # before, the step used it: radam's β₁ = 1 moved the manifold weight by 1.7 per entry
    # to an arbitrary point (an infinite direction through a bounded retraction), and a
    # momentum of 1.5 or an lr of −1 stepped without a word
    kind, message = _refusal(name, key, bad)
    opt, params = _model(name, **_extra(name, key))
    points = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    opt.param_groups[0][key] = bad
    with pytest.raises(kind) as err:
        opt.step()
    assert str(err.value) == message
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, points, strict=True))
    torch.testing.assert_close(opt.state_dict()["state"], state["state"], rtol=0, atol=0)


@pytest.mark.parametrize("name", rule_names())
def test_a_state_dict_with_a_refused_value_is_not_loaded(name):
    kind, message = _refusal(name, "lr", -1.0)
    opt, params = _model(name)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = -1.0
    with pytest.raises(kind, match="lr=-1.0"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.05  # nothing loaded


@pytest.mark.parametrize("name", rule_names())
def test_a_valid_value_set_after_construction_is_used_as_a_new_optimizer_would(name):
    opt, (w, b) = _model(name)
    fresh, (w2, b2) = _model(name)
    opt.param_groups[0]["lr"] = 0.01
    fresh.load_state_dict({**fresh.state_dict(), "param_groups": opt.state_dict()["param_groups"]})
    w2.grad, b2.grad = w.grad.clone(), b.grad.clone()
    opt.step()
    fresh.step()
    assert torch.equal(w.detach(), w2.detach()) and torch.equal(b.detach(), b2.detach())


def test_a_tensor_lr_written_in_place_is_not_read_again():
    # a scheduler writes a tensor lr in place: the same object, not a change
    torch.manual_seed(0)
    man = Stiefel(6, 3)
    ws = [geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man) for _ in range(3)]
    opt = optimizers.create("rgd", ws, lr=torch.tensor(0.05, dtype=torch.float64))
    reads = []
    for step in range(3):
        for w in ws:
            w.grad = torch.randn_like(w)
        opt.param_groups[0]["lr"].fill_(0.05 / (step + 1))
        with StepCounter(opt) as c:
            opt.step()
        reads.append(c.reads)
    assert reads[1:] == reads[:1] * 2 and reads[0] <= 1, reads


@pytest.mark.parametrize("name", rule_names())
def test_a_gradient_of_another_shape_is_refused_naming_it_before_anything_is_written(name):
    # `.grad.data = ...` bypasses torch's setter: the step failed in a stack or a product
    # with a RuntimeError that blamed a state edited by hand, for parameters without state
    man = Stiefel(5, 2)
    w = geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man)
    a, b = (torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)) for _ in range(2))
    opt = optimizers.create(name, [w, a, b], lr=0.1)
    for p in (w, a, b):
        p.grad = torch.ones_like(p)
    b.grad.data = torch.ones(5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"parameter 2 of param group 0 has shape \(4,\) and a "
                       r"gradient of shape \(5,\)"):  # fmt: skip
        opt.step()
    assert torch.equal(a.detach(), torch.zeros(4, dtype=torch.float64)) and not opt.state[w]


def test_a_rule_that_fails_on_parameters_without_state_blames_no_state():
    class Failing(optimizers.RiemannianOptimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, dict(lr=lr, retraction="cayley", repair_every=None))

        def update(self, geo, x, grad, state, group):
            raise RuntimeError("the rule's own failure")

    w = torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="the rule's own failure") as err:
        Failing([w]).step()
    assert str(err.value).endswith("failed: the rule's own failure")  # no hint appended


def _counted_steps(opt, ws, change, steps: int = 4) -> list[int]:
    """Host reads of each step, ``change(step)`` applied to the group before it."""
    reads = []
    for step in range(steps):
        for w in ws:
            w.grad = torch.randn_like(w)
        change(step)
        with StepCounter(opt) as c:
            opt.step()
        reads.append(c.reads)
    return reads


def _points(count: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    man = Stiefel(6, 3)
    return [
        geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man)
        for _ in range(count)
    ]


@pytest.mark.parametrize("name", rule_names())
def test_values_set_between_steps_beside_a_tensor_lr_read_nothing_more(name):
    # a new value beside a tensor lr rechecked the group, and the check read the lr: one
    # to three more reads per step (and one in a capturable step, which must read none)
    def changes(opt):
        group = opt.param_groups[0]
        yield lambda s: None
        yield lambda s: group.__setitem__("lr", torch.tensor(0.01 / (s + 1), dtype=torch.float64))
        yield lambda s: group.__setitem__("repair_every", [None, 5][s % 2])

    baseline = None
    for k in range(3):
        ws = _points()
        opt = optimizers.create(name, ws, lr=torch.tensor(0.01, dtype=torch.float64))
        reads = _counted_steps(opt, ws, list(changes(opt))[k])
        baseline = reads if baseline is None else baseline
        assert reads == baseline and max(reads) <= 1, (k, reads)


def test_a_params_list_replaced_between_steps_is_stepped():
    # the comparison with the last checked values used ==, which a list of tensors fails
    ws, new = _points(), _points()
    opt = optimizers.create("rgd", ws, lr=0.05)
    _counted_steps(opt, ws, lambda s: None, steps=1)
    opt.param_groups[0]["params"] = new
    before = [w.detach().clone() for w in new]
    _counted_steps(opt, new, lambda s: None, steps=1)
    assert all(not torch.equal(w.detach(), b) for w, b in zip(new, before, strict=True))


@pytest.mark.parametrize(
    ("name", "key", "value", "error"),
    [
        ("radam", "amsgrad", 0, TypeError),  # equal to False, not a bool
        ("rgd", "nesterov", 0, TypeError),
        ("rgd", "capturable", True, ValueError),  # on CPU parameters
    ],
)
def test_a_value_equal_to_the_old_one_but_refused_is_refused(name, key, value, error):
    ws = _points()
    opt = optimizers.create(name, ws, lr=0.05)
    _counted_steps(opt, ws, lambda s: None, steps=1)
    opt.param_groups[0][key] = value
    with pytest.raises(error, match=f"{key}|capturable=True needs every parameter"):
        _counted_steps(opt, ws, lambda s: None, steps=1)


def test_an_item_of_a_list_value_set_in_place_is_checked():
    # betas given as a list and set in place: the list object is the same
    ws = _points()
    opt = optimizers.create("radam", ws, lr=0.05, betas=[0.9, 0.999])
    _counted_steps(opt, ws, lambda s: None, steps=1)
    before = [w.detach().clone() for w in ws]
    opt.param_groups[0]["betas"][0] = 1.0
    with pytest.raises(ValueError, match="betas"):
        _counted_steps(opt, ws, lambda s: None, steps=1)
    assert all(torch.equal(w.detach(), b) for w, b in zip(ws, before, strict=True))


DCP_CASES = [(n, {}) for n in rule_names()] + [
    (n, {"lr": torch.tensor(0.05)}) for n in rule_names()  # DCP steps with torch.tensor(0.0)
] + [(n, {"repair_every": 1}) for n in rule_names()] + [
    ("pogo", {"base": "sgd", "momentum": 0.9}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "hyper"), DCP_CASES, ids=str)
def test_a_checkpoint_loaded_by_torch_distributed_keeps_the_loaded_weights(name, hyper):
    # Note [A step of lr 0 leaves the point where it is]: torch.distributed.checkpoint makes
    # an empty optimizer's state by a step of lr 0 after the weights were loaded; every
    # retraction's drift correction (and pogo's correction, and repair_every) moved them
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        orthogonalize(model[0], method="riemannian")
        lr = hyper.get("lr", 0.05)
        opt = optimizers.create(
            name, model, **{**hyper, "lr": lr.clone() if torch.is_tensor(lr) else lr}
        )
        return model, opt

    x, y = torch.randn(16, 3), torch.randn(16, 2)
    model, opt = build()
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = get_optimizer_state_dict(model, opt)
    again, opt2 = build()
    again.load_state_dict(weights)
    set_optimizer_state_dict(again, opt2, saved)
    for k, v in again.state_dict().items():
        assert torch.equal(v, weights[k]), k
    torch.testing.assert_close(
        opt2.state_dict()["state"], opt.state_dict()["state"], rtol=0, atol=0
    )


def test_a_value_set_beside_a_tensor_lr_is_checked_without_reading_it():
    # a group holding a tensor lr was not checked at all: β₁ = 1 moved a point by 1.5
    ws = _points()
    opt = optimizers.create("radam", ws, lr=torch.tensor(0.01, dtype=torch.float64))
    _counted_steps(opt, ws, lambda s: None, steps=1)
    opt.param_groups[0]["betas"] = (1.0, 0.999)
    with pytest.raises(ValueError, match=r"betas\[0\]=1.0 is out of range"):
        _counted_steps(opt, ws, lambda s: None, steps=1)


def test_a_params_list_replaced_by_plain_tensors_is_bound_again():
    # the old bindings were reused by position: plain tensors were made orthonormal, and a
    # longer list failed with an IndexError
    ws = _points(2)
    opt = optimizers.create("rgd", ws, lr=0.05)
    _counted_steps(opt, ws, lambda s: None, steps=1)
    plain = [torch.nn.Parameter(torch.randn(6, 3, dtype=torch.float64)) for _ in range(3)]
    start = [p.detach().clone() for p in plain]
    opt.param_groups[0]["params"] = plain
    grads = [torch.randn_like(p) for p in plain]
    for p, g in zip(plain, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    for p, x, g in zip(plain, start, grads, strict=True):  # torch's SGD step: X − lr·G
        torch.testing.assert_close(p.detach(), x - 0.05 * g, rtol=0, atol=1e-15)


@pytest.mark.parametrize("key", ["stabilize", "repair_every"])
def test_one_name_of_the_repair_period_set_after_construction_carries_the_other(key):
    # geoopt's users set group["stabilize"]; it was refused as disagreeing with repair_every
    ws = _points()
    opt = optimizers.create("radam", ws, lr=0.05, stabilize=5)
    _counted_steps(opt, ws, lambda s: None, steps=1)
    opt.param_groups[0][key] = 10
    _counted_steps(opt, ws, lambda s: None, steps=1)
    assert opt.param_groups[0]["stabilize"] == opt.param_groups[0]["repair_every"] == 10


@pytest.mark.parametrize("name", rule_names())
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("momentun", 0.9),
        ("maximize", True),
        ("decoupled_weight_decay", True),
        ("differentiable", True),
    ],  # fmt: skip
)
def test_a_key_no_step_reads_set_after_construction_is_refused(name, key, value):
    # a misspelt key, or torch's Adam's maximize=True / AdamW's decoupled decay brought by
    # load_state_dict, was kept and ignored: radam descended where torch's Adam ascended
    opt, params = _model(name)
    opt = copy.deepcopy(opt)  # torch's __setstate__ puts differentiable in the defaults
    params = [p for g in opt.param_groups for p in g["params"]]
    points = [p.detach().clone() for p in params]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param group 0: {key}={value!r} set after"):
        opt.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, points, strict=True))


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_torchs_own_keys_at_values_that_ask_for_nothing_load_and_step(name):
    # a state_dict of torch's Adam or SGD (maximize=False, differentiable=False,
    # fused=None) steps plain tensors as torch does
    torch.manual_seed(0)
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    ref = b.detach().clone().requires_grad_()
    cls = torch.optim.Adam if name == "radam" else torch.optim.SGD
    theirs = cls([ref], lr=0.05)
    ours = optimizers.create(name, [b], lr=0.05)
    ours.load_state_dict(theirs.state_dict())
    for _ in range(3):
        g = torch.randn(4, dtype=torch.float64)
        b.grad, ref.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(b.detach(), ref.detach(), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", rule_names())
def test_a_group_manifold_set_after_construction_binds_its_plain_parameters(name):
    # the binding was made once: a manifold set in the group later was ignored, and the
    # plain 8×2 matrix was stepped as torch's SGD steps it (0.62 off St(8, 2) after 3 rgd
    # steps); the reference is an optimizer built with that manifold in the group
    torch.manual_seed(0)
    man = Stiefel(8, 2)
    w = torch.nn.Parameter(man.random(dtype=torch.float64).detach().clone())
    ref = torch.nn.Parameter(w.detach().clone())
    opt = optimizers.create(name, [{"params": [w], "manifold": geoopt.Euclidean()}], lr=0.05)
    opt.step()  # no gradient yet: the group is checked as built, nothing is stepped
    opt.param_groups[0]["manifold"] = man
    theirs = optimizers.create(name, [{"params": [ref], "manifold": man}], lr=0.05)
    for _ in range(3):
        g = torch.randn_like(w)
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        theirs.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=1e-14)


def test_a_state_with_a_step_count_saved_as_a_number_loads_as_torchs_does():
    # torch before 1.12 saved state["step"] as an int (torch's Adam converts it); the
    # first radam step failed with "'int' object has no attribute 'to'"
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    theirs = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(3, dtype=torch.float64)
    theirs.step()
    saved = theirs.state_dict()
    saved["state"][0]["step"] = 1
    ref = torch.nn.Parameter(p.detach().clone())
    torch_opt = torch.optim.Adam([ref], lr=0.1)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    ours = optimizers.create("radam", [p], lr=0.1)
    ours.load_state_dict(saved)
    g = torch.randn(3, dtype=torch.float64)
    p.grad, ref.grad = g.clone(), g.clone()
    ours.step()
    torch_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-15)
