"""torch's ``model.named_parameters()`` recipe: a group's parameters given with their names.

torch's optimizers (since 2.5) take ``(name, tensor)`` pairs and keep the names in the
group's ``param_names``, saved by ``state_dict``. The reference for every registered
optimizer is the same optimizer made from ``model.parameters()``: the steps agree
bit for bit, and torch's own SGD gives the names the package's groups must hold.
"""

from __future__ import annotations

import pytest
import torch
from _optim_problems import rule_names

from stiefel import optimizers, orthogonalize


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = model.double()
    orthogonalize(model[0], method="riemannian")
    return model


def named_list(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
        opt.step()


@pytest.mark.filterwarnings("ignore:POGO steps")  # its implied plain-matrix points
@pytest.mark.parametrize("name", rule_names())
def test_named_parameters_step_as_the_parameters_do(name):
    plain, named = _model(), _model()
    opt = optimizers.create(name, plain.parameters(), lr=0.01)
    opt_named = optimizers.create(name, named.named_parameters(), lr=0.01)
    reference = torch.optim.SGD(named.named_parameters(), lr=0.01)  # torch's names
    assert opt_named.param_groups[0]["param_names"] == reference.param_groups[0]["param_names"]
    assert "param_names" not in opt.param_groups[0]
    _train(plain, opt)
    _train(named, opt_named)
    for a, b in zip(plain.parameters(), named.parameters(), strict=True):
        assert torch.equal(a, b)
    saved = opt_named.state_dict()
    assert saved["param_groups"][0]["param_names"] == named_list(named)
    again = optimizers.create(name, named.named_parameters(), lr=0.01)
    again.load_state_dict(saved)
    assert again.state_dict()["param_groups"][0]["param_names"] == named_list(named)
    torch.testing.assert_close(again.state_dict()["state"], saved["state"], rtol=0, atol=0)
    assert saved["state"]  # a state to load


def test_add_param_group_takes_named_parameters_and_keeps_groups_alike():
    model = _model()
    opt = optimizers.create("rgd", model[0].named_parameters(), lr=0.01)
    opt.add_param_group({"params": model[2].named_parameters(), "lr": 0.1})
    assert opt.param_groups[1]["param_names"] == ["weight", "bias"]
    _train(model, opt, 1)
    # torch's rule: every group has names or none has
    unnamed = optimizers.create("rgd", model[0].parameters(), lr=0.01)
    with pytest.raises(ValueError, match="with/without names"):
        unnamed.add_param_group({"params": model[2].named_parameters()})
    assert len(unnamed.param_groups) == 1


def test_bad_items_are_refused_naming_the_item():
    model = _model()
    w, b = model[0].weight, model[0].bias
    with pytest.raises(ValueError, match=r"params: 1 of 2 parameters come with names"):
        optimizers.create("rgd", [("weight", w), b], lr=0.1)
    with pytest.raises(TypeError, match=r"params: item 1 is a str"):
        optimizers.create("rgd", [w, "bias"], lr=0.1)
    with pytest.raises(TypeError, match=r"params: item 0 is a tuple"):
        optimizers.create("rgd", [(0, w)], lr=0.1)  # a name that is not a str
    opt = optimizers.create("rgd", [w], lr=0.1)
    with pytest.raises(TypeError, match="params: a set"):
        opt.add_param_group({"params": {b}})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", rule_names())
def test_a_skipped_step_names_the_parameter_and_its_group(name):
    # the warning said "index 0 of its group" for a parameter of group 1, with the names
    # of the group beside it
    model = _model()
    named = list(model.named_parameters())
    groups = [{"params": named[:2]}, {"params": named[2:], "lr": 0.01}]
    opt = optimizers.create(name, groups, lr=0.05)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    named[2][1].grad[0, 0] = float("nan")
    with pytest.warns(
        RuntimeWarning, match=r"'2\.weight', index 0 of param group 1, shape \(2, 6\)"
    ):
        opt.step()
