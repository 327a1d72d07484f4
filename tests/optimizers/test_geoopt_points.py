"""Points that geoopt's types describe, in one process: geoopt's complex Stiefel points are
tested by ‖XᴴX − I‖ (not XᵀX); geoopt's optimizers refuse the points they would step as
Euclidean tensors; a ManifoldParameter made by hand keeps its manifold when its Parameter
is rebuilt (the recipes of fully_shard, in one process: ``load_state_dict(assign=True)``)."""

from __future__ import annotations

import geoopt
import pytest
import torch
from torch import nn

from stiefel import optimizers
from stiefel.manifolds import Stiefel, binding, kernels

F64 = torch.float64
GEOOPT_STIEFEL = {"canonical": geoopt.CanonicalStiefel, "euclidean": geoopt.EuclideanStiefel}


def _unitary(n: int, m: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return kernels.haar(n, m, dtype=torch.complex128, generator=g)


def _complex_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """exp(S) of a complex skew-symmetric S (Sᵀ = −S): QᵀQ = I but QᴴQ ≠ I."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, dtype=torch.complex128, generator=g)
    return torch.linalg.matrix_exp(0.8 * (a - a.T))


@pytest.mark.parametrize("metric", ["canonical", "euclidean"])
@pytest.mark.parametrize("name", ["rgd", "radam", "manifold_muon"])
def test_a_complex_unitary_point_of_geoopts_stiefel_steps_as_on_this_packages(name, metric):
    """The reference: the same point on ``Stiefel(n, m, complex=True)`` with the metric
    geoopt's class implies, which the docs say is how geoopt's Stiefel points are moved."""
    x0 = _unitary(6, 3)
    grads = [torch.randn(6, 3, dtype=torch.complex128) for _ in range(3)]
    ours = geoopt.ManifoldParameter(x0.clone(), manifold=Stiefel(6, 3, complex=True, metric=metric))
    theirs = geoopt.ManifoldParameter(x0.clone(), manifold=GEOOPT_STIEFEL[metric]())
    opts = [optimizers.create(name, [w], lr=0.1) for w in (ours, theirs)]
    for g in grads:
        for w, opt in zip((ours, theirs), opts, strict=True):
            w.grad = g.clone()
            opt.step()
    torch.testing.assert_close(theirs.detach(), ours.detach(), rtol=0, atol=1e-12)
    w = theirs.detach()
    assert float(torch.linalg.matrix_norm(w.mH @ w - torch.eye(3, dtype=w.dtype))) < 1e-12
    assert float((w - x0).abs().max()) > 1e-3  # it moved


@pytest.mark.parametrize("manifold", [geoopt.CanonicalStiefel, geoopt.EuclideanStiefel])
@pytest.mark.parametrize("name", ["rgd", "radam", "manifold_muon"])
def test_a_complex_orthogonal_matrix_that_is_not_unitary_is_refused(name, manifold):
    q = _complex_orthogonal(4)
    eye = torch.eye(4, dtype=q.dtype)
    assert float((q.T @ q - eye).abs().max()) < 1e-12  # geoopt's test passes it
    dist = float(torch.linalg.matrix_norm(q.mH @ q - eye))
    assert dist > 1
    w = geoopt.ManifoldParameter(q, manifold=manifold())
    with pytest.raises(ValueError, match=r"not on its manifold.*‖XᴴX − I‖_F = ([0-9.e+]+)") as e:
        optimizers.create(name, [w], lr=0.1)
    assert f"{dist:.3e}" in str(e.value)
    optimizers.create("landing", [w], lr=0.1)  # the rule for points off it: landing takes them


@pytest.mark.parametrize("name", ["geoopt_rsgd", "geoopt_radam"])
def test_geoopts_optimizers_refuse_a_param_group_manifold(name):
    st = Stiefel(8, 3)
    p = nn.Parameter(kernels.haar(8, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape \(8, 3\)\).*"
                       r"manifold=Stiefel.*Allowed: this package's optimizers"):  # fmt: skip
        optimizers.create(name, [{"params": [p], "manifold": st}], lr=0.1)
    # a group that names geoopt's Euclidean says "plain": accepted
    optimizers.create(name, [{"params": [p], "manifold": geoopt.Euclidean()}], lr=0.1)


@pytest.mark.parametrize("cls", [geoopt.optim.RiemannianSGD, geoopt.optim.RiemannianAdam])
def test_geoopt_built_directly_refuses_a_marked_tensor_at_its_step_and_writes_nothing(cls):
    """A tensor that carries its manifold as an attribute (a DTensor's mark, Note [Marking
    a tensor]) is no ManifoldTensor: geoopt would step it as a Euclidean one."""
    st = Stiefel(8, 3)
    x0 = kernels.haar(8, 3, dtype=F64)
    t = x0.clone().requires_grad_()
    binding.mark(t, st)
    assert type(t) is torch.Tensor and t.manifold is st
    opt = cls([t], lr=0.1)
    t.grad = torch.ones_like(t)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0.*marked by hand.*'rgd'"):
        opt.step()
    assert torch.equal(t.detach(), x0)


class _HandMade(nn.Module):
    """The recipe of docs/optimizers.md: a ManifoldParameter set on a module by hand."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.st = Stiefel(8, 3)
        self.w = geoopt.ManifoldParameter(self.st.random(dtype=F64), manifold=self.st)

    def forward(self, x):
        return x @ self.w


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(5, 8, dtype=F64, generator=g)
        opt.zero_grad()
        model(x).sub(1.0).square().sum().backward()
        opt.step()
    return model.w.detach().clone()


def _rebuilt(seed: int = 0) -> _HandMade:
    """A hand-made model whose Parameter was rebuilt as a plain one (as fully_shard does)."""
    model = _HandMade(seed)
    model.load_state_dict({"w": model.w.detach().clone()}, assign=True)
    assert type(model.w) is nn.Parameter  # the class and the manifold are gone
    return model


@pytest.mark.parametrize("given", ["model", "parameters"])
@pytest.mark.parametrize("name", ["rgd", "radam", "geoopt_rsgd", "geoopt_radam"])
def test_a_hand_made_manifold_parameter_keeps_its_manifold_when_rebuilt(name, given):
    want = _train(ref := _HandMade(), optimizers.create(name, ref, lr=0.1))
    model = _rebuilt()
    params = model if given == "model" else model.parameters()
    got = _train(model, optimizers.create(name, params, lr=0.1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert float(model.st.orthogonality_error(got)) < 1e-12
    assert model.w.manifold is model.st


def test_a_manifold_parameter_of_another_manifold_at_the_name_drops_the_record():
    model = _HandMade()
    assert binding.records(model)["w"][0] is model.st
    model.w = geoopt.ManifoldParameter(torch.randn(8, 3, dtype=F64), manifold=geoopt.Euclidean())
    assert "w" not in binding.records(model)
    model.load_state_dict({"w": torch.randn(8, 3, dtype=F64)}, assign=True)
    opt = optimizers.create("rgd", model, lr=0.1)  # a plain weight now: nothing refused
    assert binding.manifold_of(opt.param_groups[0]["params"][0]) is None


class _OnSphere(nn.Module):
    """A hand-made point of geoopt's sphere: its values are used as they are, and the
    rebuilt Parameter is stepped by the sphere's own operations."""

    def __init__(self):
        super().__init__()
        x = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
        x = x / x.norm(dim=-1, keepdim=True)  # a point per row
        self.w = geoopt.ManifoldParameter(x, manifold=geoopt.Sphere())

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_a_hand_made_point_of_another_geoopt_manifold_keeps_it_when_rebuilt(name):
    want = _train(ref := _OnSphere(), optimizers.create(name, ref, lr=0.1))
    model = _OnSphere()
    model.load_state_dict({"w": model.w.detach().clone()}, assign=True)
    assert type(model.w) is nn.Parameter
    got = _train(model, optimizers.create(name, model.parameters(), lr=0.1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert float((got.norm(dim=-1) - 1).abs().max()) < 1e-12


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_a_point_in_another_dtype_than_its_geoopt_manifold_is_refused_naming_the_cast(name):
    # geoopt's Lorentz keeps k in float32: its own point test failed on a float64 point
    # with "Double did not match Float" from inside the constructor
    man = geoopt.Lorentz()
    p = geoopt.ManifoldParameter(man.random_normal(5, 3).double(), manifold=man)
    with pytest.raises(TypeError, match=r"torch.float64 and Lorentz.*manifold.to\(torch.float64\)"):
        optimizers.create(name, [p], lr=0.01)
    man.to(torch.float64)  # the cast it names: then the point steps
    opt = optimizers.create(name, [p], lr=0.01)
    p.grad = torch.randn_like(p)
    opt.step()
    assert bool(torch.isfinite(p).all())


def test_a_bfloat16_point_of_geoopts_stiefel_is_accepted_as_on_this_packages():
    # geoopt's Stiefel manifolds were tested with a fixed bound of 1e-4, which a bf16
    # St(64, 8) point (‖XᴴX − I‖_F ≈ 3e-3, within Stiefel.default_atol) does not meet
    x = Stiefel(64, 8).random(dtype=torch.float32).to(torch.bfloat16).as_subclass(torch.Tensor)
    err = float(Stiefel(64, 8).orthogonality_error(x.float()))
    assert 1e-4 < err <= Stiefel(64, 8).default_atol(torch.bfloat16)
    for man in (geoopt.CanonicalStiefel(), geoopt.EuclideanStiefel(), Stiefel(64, 8)):
        p = geoopt.ManifoldParameter(x.clone(), manifold=man)
        optimizers.create("rgd", [p], lr=0.01)  # accepted alike
