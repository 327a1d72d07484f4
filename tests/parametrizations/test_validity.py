"""A Riemannian weight is valid without a forward pass: after ``reset_parameters()``, under
``torch.func`` substitution and ``vmap``, under a torch optimizer given it later, and under a
parametrization registered on top of it. Every check is the dense float64 orthogonality error
‖WᵀW − I‖_F or the caller's own tensors, compared exactly."""

from __future__ import annotations

import copy
import io
import warnings

import geoopt
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from stiefel import optimizers, orthogonalize
from stiefel.manifolds import binding

F64 = torch.float64


def err64(w: torch.Tensor) -> float:
    """‖WᵀW − I‖_F in float64 (W tall)."""
    w = w.detach().to(F64)
    return float(torch.linalg.matrix_norm(w.mT @ w - torch.eye(w.shape[-1], dtype=F64)))


def tol(w: torch.Tensor) -> float:
    return 10 * w.shape[-2] * torch.finfo(w.dtype).eps


def _meta_riemannian(**options) -> nn.Linear:
    with torch.device("meta"):
        layer = orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian", **options)
    layer.to_empty(device="cpu")
    return layer


# ---------------------------------------------------------------- reset_parameters


def test_reset_parameters_leaves_a_riemannian_weight_a_point_before_any_forward():
    layer = _meta_riemannian()
    torch.manual_seed(3)
    layer.reset_parameters()
    w = layer.weight
    assert err64(w) < tol(w)
    assert isinstance(w, geoopt.ManifoldParameter)
    assert w.manifold is binding.records(layer)["weight"][0]  # marked again
    saved = io.BytesIO()  # a checkpoint saved before the first forward holds the point
    torch.save(layer.state_dict(), saved)
    saved.seek(0)
    assert err64(torch.load(saved, weights_only=True)["weight"]) < tol(w)
    # the point is the nearest one (polar factor, float64 SVD) to nn.Linear's own reset
    twin = nn.Linear(4, 12, dtype=F64)
    torch.manual_seed(3)
    twin.reset_parameters()
    u, _, vh = torch.linalg.svd(twin.weight.detach(), full_matrices=False)
    torch.testing.assert_close(w.detach(), u @ vh, rtol=0, atol=1e3 * tol(w))
    torch.testing.assert_close(layer.bias.detach(), twin.bias.detach(), rtol=0, atol=0)


def test_reset_parameters_honours_the_init_given():
    layer = _meta_riemannian(init="identity")
    layer.reset_parameters()
    torch.testing.assert_close(layer.weight.detach(), torch.eye(12, 4, dtype=F64), rtol=0, atol=0)


class Bare(nn.Module):
    """A module without a reset_parameters of its own."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(12, 4, dtype=F64))

    def forward(self, x):
        return x @ self.weight.T


def test_reset_parameters_of_a_module_without_its_own_reset_writes_a_point():
    with torch.device("meta"):
        m = orthogonalize(Bare(), method="riemannian")
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.weight.fill_(float("nan"))  # what uninitialised memory may hold
    m.reset_parameters()
    assert err64(m.weight) < tol(m.weight)


class Zeros(Bare):
    """A module whose own reset writes zeros, which have no nearest point."""

    def reset_parameters(self):
        nn.init.zeros_(self.weight)


def test_reset_parameters_draws_a_point_where_the_own_reset_has_no_nearest_one():
    m = orthogonalize(Zeros(), method="riemannian")
    m.reset_parameters()
    assert err64(m.weight) < tol(m.weight)


def test_the_reset_travels_with_deepcopy_and_pickling_and_resets_the_copy_only():
    layer = orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian")
    before = layer.weight.detach().clone()
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(layer), torch.load(buf, weights_only=False)):
        with torch.no_grad():
            twin.weight.mul_(3.0)  # off the manifold
        twin.reset_parameters()
        assert err64(twin.weight) < tol(twin.weight)
        assert torch.equal(layer.weight.detach(), before)


class Two(nn.Module):
    """Two weights with a reset of their own (Kaiming, as nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(12, 4, dtype=F64))
        self.other = nn.Parameter(torch.empty(6, 6, dtype=F64))

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.weight)
        nn.init.kaiming_uniform_(self.other)


def test_reset_parameters_of_a_module_with_a_map_and_a_riemannian_weight():
    with torch.device("meta"):
        m = orthogonalize(Two(), "weight", method="riemannian")
        orthogonalize(m, "other", method="cwy")
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert err64(m.weight) < tol(m.weight)
    assert err64(m.other) < tol(m.other)


# ---------------------------------------------------------------- torch.func


def test_functional_call_uses_a_substituted_weight_as_given_and_never_writes_it():
    layer = orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian")
    own = layer.weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 4, dtype=F64, generator=g)  # off the manifold
    given = w.clone()
    x = torch.randn(5, 4, dtype=F64, generator=g)
    out = torch.func.functional_call(layer, {"weight": w}, (x,))
    assert torch.equal(w, given)  # the caller's tensor is untouched
    torch.testing.assert_close(out, x @ given.T + layer.bias.detach(), rtol=0, atol=1e-12)
    assert torch.equal(layer.weight.detach(), own)
    assert isinstance(layer.weight, geoopt.ManifoldParameter)


def test_vmap_over_stacked_riemannian_modules():
    models = [orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian") for _ in range(3)]
    params, buffers = torch.func.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(1))

    def run(p, b):
        return torch.func.functional_call(base, (p, b), (x,))

    got = torch.vmap(run)(params, buffers)
    want = torch.stack([x @ m.weight.detach().T + m.bias.detach() for m in models])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the torch.optim guard


def test_the_torch_optim_guard_sees_a_manifold_weight_added_later():
    layer = orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian")
    other = nn.Linear(3, 3, dtype=F64)
    opt = torch.optim.SGD(other.parameters(), lr=0.5)
    other(torch.randn(2, 3, dtype=F64)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # nothing on a manifold yet: silent
    opt.add_param_group({"params": [layer.weight]})
    (layer(torch.randn(5, 4, dtype=F64)) ** 2).sum().backward()
    with pytest.warns(UserWarning, match="SGD is not a Riemannian optimizer"):
        opt.step()
    assert err64(layer.weight) > tol(layer.weight)  # what it warned about: off the manifold
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer


def test_the_torch_optim_guard_sees_a_weight_made_riemannian_after_the_first_step():
    lin = nn.Linear(4, 12, dtype=F64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(torch.randn(2, 4, dtype=F64)).sum().backward()
    opt.step()
    orthogonalize(lin, method="riemannian")  # keeps the Parameter the optimizer steps
    with pytest.warns(UserWarning, match="SGD is not a Riemannian optimizer"):
        opt.step()


# ---------------------------------------------------------------- a parametrization on top


class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrization_on_top_is_reset_and_stepped_on_the_manifold():
    with torch.device("meta"):
        layer = orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian")
        parametrize.register_parametrization(layer, "weight", Double())
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    original = layer.parametrizations.weight.original
    assert err64(original) < tol(original)
    assert original.manifold is binding.records(layer)["weight"][0]
    torch.testing.assert_close(layer.weight, 2 * original, rtol=0, atol=0)
    opt = optimizers.create("rgd", layer.parameters(), lr=0.1)
    x = torch.randn(16, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    start = original.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        (layer(x) ** 2).sum().backward()
        opt.step()
    assert (original.detach() - start).abs().max() > 1e-3  # it trained
    assert err64(original) < 100 * tol(original)


def test_a_parametrization_on_top_after_to_empty_is_marked_at_first_forward():
    with torch.device("meta"):
        layer = orthogonalize(nn.Linear(4, 12, dtype=F64), method="riemannian")
        parametrize.register_parametrization(layer, "weight", Double())
    layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.parametrizations.weight.original.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"non-finite.*reset_parameters\(\)"):
        layer(torch.randn(2, 4, dtype=F64))
