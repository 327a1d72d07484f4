"""A copy of an optimizer (``copy.deepcopy``, pickling) steps as the original does.

torch's optimizers deep-copy and pickle with their model (their defaults, state and
param groups); the copy of a Riemannian optimizer lost its parameters' bindings and
its first step raised AttributeError (Note [Copies of an optimizer]). Reference: the
original optimizer, stepped on the same gradients, and torch's Adam on a plain tensor.
"""

from __future__ import annotations

import copy
import io

import geoopt
import pytest
import torch
from _optim_problems import rule_names, rule_names_taking, takes

from stiefel import optimizers
from stiefel.manifolds import Stiefel


def _model(name: str):
    st = Stiefel(8, 3)
    gen = torch.Generator().manual_seed(0)
    points = [
        torch.linalg.qr(torch.randn(8, 3, generator=gen, dtype=torch.float64)).Q for _ in range(3)
    ]
    ws = [geoopt.ManifoldParameter(x, manifold=st) for x in points]
    plain = torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
    groups = [{"params": ws}, {"params": [plain], "manifold": geoopt.Euclidean()}]
    options = {"telemetry": True} if takes(name, "telemetry") else {}
    return [*ws, plain], optimizers.create(name, groups, lr=0.05, **options)


def _step(params, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.step()


def _pickled(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# the rules on the package's interface (the registry also lists torch's and geoopt's, which
# copy alike); this one records telemetry, which every built-in rule takes (test_buckets.py)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", rule_names_taking("telemetry"))
def test_a_copy_of_an_optimizer_steps_as_the_original(name, how):
    params, opt = _model(name)
    _step(params, opt, 1)
    copied_params, copied = (copy.deepcopy if how == "deepcopy" else _pickled)((params, opt))
    assert copied.telemetry and len(copied.orthogonality_history) == 1
    for seed in (2, 3):
        _step(params, opt, seed)
        _step(copied_params, copied, seed)
    for p, q in zip(params, copied_params, strict=True):
        assert q is not p
        assert torch.equal(p.detach(), q.detach())
    assert len(copied.orthogonality_history) == 3
    # the copy's state is its own: stepping it leaves the original's untouched
    before = [p.detach().clone() for p in params]
    _step(copied_params, copied, 4)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def test_a_state_saved_without_todays_group_keys_loads_them_at_their_defaults():
    # torch's SGD saves no "capturable"; a checkpoint of an older version lacked
    # "foreach" too: the next step raised KeyError, where torch fills its defaults
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    twin = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    grads = [torch.randn(5, 3, generator=gen) for _ in range(3)]
    for w, o in ((p, sgd), (q, twin)):
        w.grad = grads[0].clone()
        o.step()
    saved = copy.deepcopy(sgd.state_dict())
    assert "capturable" not in saved["param_groups"][0]
    rgd = optimizers.create("rgd", [p], lr=0.1, momentum=0.9)  # on a plain tensor: SGD
    rgd.load_state_dict(saved)
    assert rgd.param_groups[0]["capturable"] is False
    for g in grads[1:]:
        for w, o in ((p, rgd), (q, twin)):
            w.grad = g.clone()
            o.step()
    assert torch.allclose(p, q, rtol=0, atol=1e-6)
    older = copy.deepcopy(rgd.state_dict())
    for group in older["param_groups"]:
        del group["foreach"], group["capturable"]
    again = optimizers.create("rgd", [p], lr=0.1, momentum=0.9)
    again.load_state_dict(older)
    p.grad = grads[0].clone()
    again.step()
    assert again.param_groups[0]["foreach"] is None


@pytest.mark.parametrize("name", rule_names())
def test_a_state_with_a_group_manifold_resumes_through_a_weights_only_load(name):
    # a group's manifold object made torch.load(weights_only=True) refuse the file
    # (Note [A group's manifold is saved by name])
    params, opt = _model(name)
    _step(params, opt, 1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    copied_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    st = params[0].manifold
    copied_params[:3] = [
        geoopt.ManifoldParameter(p.detach(), manifold=st) for p in copied_params[:3]
    ]
    groups = [
        {"params": copied_params[:3]},
        {"params": copied_params[3:], "manifold": geoopt.Euclidean()},
    ]
    resumed = optimizers.create(name, groups, lr=0.05)
    resumed.load_state_dict(saved)
    assert isinstance(resumed.param_groups[1]["manifold"], geoopt.Euclidean)  # torch copies it
    for seed in (2, 3):
        _step(params, opt, seed)
        _step(copied_params, resumed, seed)
    for p, q in zip(params, copied_params, strict=True):
        assert torch.equal(p.detach(), q.detach())
    other = optimizers.create(
        name,
        [groups[0], {"params": copied_params[3:], "manifold": geoopt.Euclidean(ndim=1)}],
        lr=0.05,
    )
    with pytest.raises(ValueError, match="param group 1 was saved with manifold=Euclidean"):
        other.load_state_dict(saved)


def test_a_state_loads_while_a_point_is_off_its_manifold_and_the_step_corrects_it():
    # loading rebuilt the bindings, whose test refused the point (and left the load half
    # done); a load keeps them, and the next step tests the point
    st = Stiefel(8, 3)
    gen = torch.Generator().manual_seed(0)
    w = geoopt.ManifoldParameter(torch.linalg.qr(torch.randn(8, 3, generator=gen)).Q, manifold=st)
    opt = optimizers.create("radam", [w], lr=0.1)
    w.grad = torch.randn(8, 3, generator=gen)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.05
    with torch.no_grad():
        w.add_(0.05 * torch.randn(8, 3, generator=gen))
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.05
    off = float(st.orthogonality_error(w.detach()))
    w.grad = torch.randn(8, 3, generator=gen)
    opt.step()
    assert float(st.orthogonality_error(w.detach())) < off / 2  # corrected toward it
