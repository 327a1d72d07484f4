"""geoopt's ``stabilize``: the param-group key stays, and it re-projects every manifold parameter.

geoopt's optimizers keep ``group["stabilize"]`` (its own code reads it, and
``RiemannianSGD.stabilize_group`` projects every manifold parameter of the group,
those without a gradient included); ``stabilize()`` does it on demand. Compared
with geoopt's own ``RiemannianSGD``/``RiemannianAdam`` on geoopt's
``EuclideanStiefel`` (the same QR step) and with numpy's polar factor.
"""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import torch

from stiefel import optimizers


def _polar_np(x: np.ndarray) -> np.ndarray:
    u, _, vh = np.linalg.svd(x, full_matrices=False)
    return u @ vh


def _pair(seed):
    gen = np.random.default_rng(seed)
    moved = _polar_np(gen.standard_normal((9, 3)))
    on = _polar_np(gen.standard_normal((9, 3)))
    man = geoopt.EuclideanStiefel()
    params = [geoopt.ManifoldParameter(torch.tensor(a), manifold=man) for a in (moved, on)]
    return params, on + 1e-3 * gen.standard_normal((9, 3))  # where the second is moved to


@pytest.mark.parametrize(
    "name,ref_cls,hyper",
    [
        ("rgd", geoopt.optim.RiemannianSGD, {}),
        ("radam", geoopt.optim.RiemannianAdam, {}),
    ],
)
@pytest.mark.parametrize("spelling", ["stabilize", "repair_every"])
def test_group_keeps_stabilize_and_projects_parameters_without_gradient(
    name, ref_cls, hyper, spelling
):
    ours, still = _pair(0)
    theirs, _ = _pair(0)
    opt = optimizers.create(name, ours, lr=0.1, retraction="qr", **{spelling: 2}, **hyper)
    ref = ref_cls(theirs, lr=0.1, stabilize=2, **hyper)
    with torch.no_grad():  # off the manifold after construction (construction refuses it)
        for w in (ours[1], theirs[1]):
            w.copy_(torch.tensor(still))
    assert opt.param_groups[0]["stabilize"] == ref.param_groups[0]["stabilize"] == 2
    assert opt.param_groups[0]["repair_every"] == 2
    gen = np.random.default_rng(1)
    for k in range(4):
        g = torch.tensor(gen.standard_normal((9, 3)))
        ours[0].grad, theirs[0].grad = g.clone(), g.clone()  # the second never has one
        opt.step()
        ref.step()
        if k == 0:  # not due yet: the second parameter is left alone
            assert torch.equal(ours[1].detach(), torch.tensor(still))
    assert float((ours[1].detach() - torch.tensor(_polar_np(still))).abs().max()) < 1e-13
    if name == "rgd":  # geoopt's RiemannianAdam skips a parameter it never stepped
        assert float((ours[1].detach() - theirs[1].detach()).abs().max()) < 1e-13
    assert float((ours[0].detach() - theirs[0].detach()).abs().max()) < 1e-12


def test_stabilize_method_projects_every_manifold_parameter():
    ours, still = _pair(2)
    plain = torch.nn.Parameter(torch.full((3,), 5.0, dtype=torch.float64))
    opt = optimizers.create("rgd", [*ours, plain], lr=0.1)
    with torch.no_grad():
        ours[1].copy_(torch.tensor(still))
    opt.stabilize()
    assert float((ours[1].detach() - torch.tensor(_polar_np(still))).abs().max()) < 1e-13
    assert torch.equal(plain.detach(), torch.full((3,), 5.0, dtype=torch.float64))


def test_state_dict_of_an_older_version_gets_the_stabilize_key_back():
    ours, _ = _pair(3)
    opt = optimizers.create("radam", ours, lr=0.1, stabilize=3)
    sd = opt.state_dict()
    del sd["param_groups"][0]["stabilize"]  # saved before the key was kept
    opt2 = optimizers.create("radam", _pair(3)[0], lr=0.1)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["stabilize"] == opt2.param_groups[0]["repair_every"] == 3


def test_a_group_without_the_option_has_both_keys_none():
    ours, _ = _pair(4)
    opt = optimizers.create("rgd", [ours[0]], lr=0.1)
    opt.add_param_group({"params": [ours[1]], "stabilize": 5})
    assert [g["stabilize"] for g in opt.param_groups] == [None, 5]
    assert [g["repair_every"] for g in opt.param_groups] == [None, 5]
