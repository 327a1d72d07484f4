"""float32 master copy of a float16/bfloat16 manifold parameter (issue 14, optimizer side).

`stiefel.optimizers.master.working` / `store` are what the optimizer's step calls; here
they are driven exactly as the step does (point and gradient for `update`, then store),
with the real rules of every optimizer written on the rule interface.
"""

from __future__ import annotations

import copy

import geoopt
import pytest
import torch
from _optim_problems import builtin_rule_names, orth_err64, rule_names

import stiefel
from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.optimizers import master as master_copy


def _step_through_helpers(opt) -> None:
    """What the step does with the helpers (no repair, finite gradients)."""
    with torch.no_grad():
        for group, bindings in zip(opt.param_groups, opt._bindings, strict=True):
            for p, binding in zip(group["params"], bindings, strict=True):
                state = opt.state[p]
                state.setdefault("step", torch.tensor(0.0))
                state["step"] += 1
                x, g = master_copy.working(p, p.grad, state)
                master_copy.store(p, state, opt.update(binding.bind(group), x, g, state, group))


def test_working_and_store_keep_other_dtypes_untouched():
    st = Stiefel(8, 2)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float32), manifold=st)
    state: dict = {}
    x, g = master_copy.working(w, torch.ones_like(w), state)
    assert x.data_ptr() == w.data_ptr() and "master" not in state and g.dtype == torch.float32
    with torch.no_grad():
        master_copy.store(w, state, torch.zeros_like(w))
    assert torch.equal(w.detach(), torch.zeros(8, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", rule_names())
def test_low_precision_parameter_steps_a_float32_master(name, dtype):
    n, m = 64, 4
    gen = torch.Generator().manual_seed(0)
    st = Stiefel(n, m)
    x0 = st.random(dtype=torch.float32, generator=gen)
    w = geoopt.ManifoldParameter(x0.to(dtype), manifold=st, requires_grad=True)
    c = torch.randn(n, m, generator=gen)
    lr = optimizers.info(name).default_lr
    opt = optimizers.create(name, [w], lr=lr)
    # reference: a float32 parameter from the same start (the rounding of x0, set after the
    # construction, which refuses a float32 point that far off), stepped on the same gradients
    ref = geoopt.ManifoldParameter(x0.clone(), manifold=st, requires_grad=True)
    ref_opt = optimizers.create(name, [ref], lr=lr)
    with torch.no_grad():
        ref.copy_(x0.to(dtype))
    for _ in range(100):
        w.grad = (-c).to(dtype)  # Procrustes: min −tr(CᵀX)
        ref.grad = w.grad.float()
        _step_through_helpers(opt)
        _step_through_helpers(ref_opt)
    master = opt.state[w]["master"]
    assert master.dtype == torch.float32
    assert torch.equal(w.detach(), master.to(dtype))  # the parameter is its rounding
    # no step was lost to rounding, whatever the rule's default_lr: the master is the
    # float32 run, which moved
    assert torch.equal(master, ref.detach())
    moved = float((master - x0).abs().max())
    assert moved > 100 * float(torch.finfo(torch.float32).eps)
    if name in builtin_rule_names():  # ours move farther than the low precision's rounding
        assert moved > 10 * float(torch.finfo(dtype).eps)
    if optimizers.info(name).feasible:
        assert orth_err64(master) <= 5e-6  # the float32 drift target, not bf16's
    assert orth_err64(w) <= 4 * m**0.5 * float(torch.finfo(dtype).eps)
    # the master and the moments survive a state_dict round trip in float32
    saved = copy.deepcopy(opt.state_dict())
    w2 = geoopt.ManifoldParameter(w.detach().clone(), manifold=st, requires_grad=True)
    opt2 = optimizers.create(name, [w2], lr=1.0)
    opt2.load_state_dict(saved)
    for key, value in master_copy.strip(opt.state[w]).items():
        if key != "step":
            assert opt2.state[w2][key].dtype == value.dtype and torch.equal(
                opt2.state[w2][key], value
            )
    w.grad, w2.grad = (-c).to(dtype), (-c).to(dtype)
    _step_through_helpers(opt)
    _step_through_helpers(opt2)
    assert torch.equal(w.detach(), w2.detach())


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_low_precision_run_resumed_in_float32_goes_on_from_its_master(low):
    # the master was dropped: the float32 weight was the rounding, 4e-3 off St(32, 8),
    # projected at the next step; reference: the master the low-precision run saved
    def make(dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.Linear(32, 4))
        stiefel.orthogonalize(model[0], "weight", method="riemannian")
        return model.to(dtype)

    x, y = torch.randn(64, 8), torch.randn(64, 4)
    model = make(low)
    opt = optimizers.create("rgd", model.parameters(), lr=0.02)
    for _ in range(20):
        opt.zero_grad()
        (model(x.to(low)) - y.to(low)).float().square().mean().backward()
        opt.step()
    master = opt.state[model[0].weight]["master"].clone()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    untouched = make(torch.float32)  # its own weights: not the master's rounding, kept
    before = untouched[0].weight.detach().clone()
    optimizers.create("rgd", untouched.parameters(), lr=0.02).load_state_dict(saved_opt)
    assert torch.equal(untouched[0].weight.detach(), before)
    resumed = make(torch.float32)  # torch's recipe: build both, load the model, then the
    again = optimizers.create("rgd", resumed.parameters(), lr=0.02)  # optimizer
    resumed.load_state_dict(saved_model)
    again.load_state_dict(saved_opt)
    w = resumed[0].weight.detach()
    assert torch.equal(w, master) and "master" not in again.state[resumed[0].weight]
    err = torch.linalg.matrix_norm(w.double().T @ w.double() - torch.eye(8, dtype=torch.float64))
    assert err < 100 * torch.finfo(torch.float32).eps
    late = make(torch.float32)  # the rounding loaded first: refused, saying what to do
    late.load_state_dict(saved_model)  # the rounding is off St(32, 8) at float32's tolerance
    with pytest.raises(ValueError, match="build the optimizer before loading"):
        optimizers.create("rgd", late.parameters(), lr=0.02)
