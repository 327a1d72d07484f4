"""Map contract and the issue-13 regressions: what users do with orthogonalize."""

import importlib.metadata
import warnings

import geoopt
import pytest
import torch
from torch import nn

from stiefel.parametrizations import OrthogonalMap, available, base, get, maps, orthogonalize
from stiefel.parametrizations._householder import householder_apply
from stiefel.parametrizations._inverse import _stable_loop, reflections_from_point
from stiefel.parametrizations.kernels import householder_matrix

MAPS = list(maps())


def orth_err(w):
    w = w.detach()
    w = w.mT if w.shape[-2] < w.shape[-1] else w
    hi = torch.complex128 if w.is_complex() else torch.float64
    w = w.to(hi)
    return float(torch.linalg.matrix_norm(w.mH @ w - torch.eye(w.shape[-1], dtype=hi)).max())


# ---------------------------------------------------------------- registry and capabilities
def test_capabilities_have_defaults_and_riemannian_is_not_a_map():
    assert available() == [*maps(), "riemannian"]
    with pytest.raises(ValueError, match="not a map"):
        get("riemannian")

    class Bare(OrthogonalMap):
        def matrix(self, a):
            return a

        def inverse(self, q):
            return q

    assert not Bare.has_operator() and not Bare.takes_reflections()
    assert Bare.formula == "" and Bare.domain == "" and Bare.flops(4, 4, None) != Bare.flops(4, 4)
    for name, cls in maps().items():  # every built-in declares a finite FLOP model
        assert cls.flops(64, 16, 8) > 0, name


def test_method_may_be_a_class():
    cls = get("cwy")
    W = orthogonalize(torch.randn(5, 5, dtype=torch.float64), method=cls)
    assert W.method == "cwy" and orth_err(W()) < 1e-13
    with pytest.raises(TypeError, match="not an OrthogonalMap subclass"):
        orthogonalize(torch.randn(3, 3), method=nn.Linear)


def test_entry_point_clashing_with_a_builtin_is_ignored_with_a_warning(monkeypatch):
    ep = importlib.metadata.EntryPoint("cwy", "os:getcwd", base.ENTRY_POINT_GROUP)
    broken = importlib.metadata.EntryPoint("broken", "no_such_module:X", base.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [ep, broken])
    saved = base.MAPS.snapshot()
    try:
        with pytest.warns(RuntimeWarning, match="'cwy'.*clashes"):
            assert base.load_entry_points(force=True) == ["broken"]  # scanned, not loaded
        assert "broken" in available()
        with pytest.warns(RuntimeWarning, match="'broken'.*could not be loaded"):
            names = list(maps())
        assert get("cwy").__name__ == "CWY" and "broken" not in names + available()
        with pytest.raises(ValueError, match="method='broken'.*could not be loaded.*no_such"):
            get("broken")
    finally:
        base.MAPS.restore(saved)
    assert "broken" not in available()


# ---------------------------------------------------------------- float32-trained points
@pytest.mark.parametrize("method", MAPS)
def test_a_float32_trained_weight_is_assignable_back(method):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="conv_kernel=True"):  # a batch of 3×3 slices, on purpose
        conv = orthogonalize(nn.Conv2d(8, 4, 3), method=method)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    x = torch.randn(2, 8, 6, 6)
    for _ in range(2):
        opt.zero_grad()
        conv(x).sum().backward()
        opt.step()
    w = conv.weight.detach().clone()
    conv.weight = conv.weight  # torch's assignment round trip
    assert (conv.weight - w).abs().max() < 1e-5
    conv.double()
    w64 = conv.weight.detach().clone()
    conv.weight = w64  # judged as the float32 point it is (Note [Tolerance of right inverses])
    assert (conv.weight - w64).abs().max() < 1e-5
    assert orth_err(conv.weight) < 1e-12  # stored parameters now map onto the manifold exactly
    with pytest.raises(ValueError, match="not on"):
        conv.weight = 1.01 * w64


# ---------------------------------------------------------------- LAPACK initialisation
@pytest.mark.parametrize("shape", [(6, 6), (7, 3), (2, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_reflections_of_special_points_reproduce_them(shape, dtype):
    gen = torch.Generator().manual_seed(4)
    n, m = shape[-2:]
    eye = torch.eye(n, m, dtype=dtype).expand(shape)
    perm = eye[..., torch.randperm(n, generator=gen), :]  # columns already reduced, in place
    q = torch.linalg.qr(torch.randn(shape, dtype=dtype, generator=gen))[0]
    for target in (eye, -eye, perm, q, -q):
        v, d = reflections_from_point(target.to(dtype), m, 1e-10)
        assert (v.norm(dim=-2) > 0.5).all()
        assert (householder_matrix(v, d, m) - target).abs().max() < 1e-13


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_blocked_elimination_across_panels(dtype):
    gen = torch.Generator().manual_seed(6)
    for n, m in [(9, 9), (9, 5)]:
        q = torch.linalg.qr(torch.randn(n, m, dtype=dtype, generator=gen))[0]
        v, d = _stable_loop(q, block=2)  # five panels: the trailing WY update is exercised
        assert (householder_matrix(v, d, m) - q).abs().max() < 1e-13
        assert (d.abs() - 1).abs().max() < 1e-14


# ---------------------------------------------------------------- torch.func
def test_householder_under_vmap_and_grad():
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(3, 6, 4, dtype=torch.float64, generator=gen)
    x = torch.randn(3, 6, 2, dtype=torch.float64, generator=gen)
    batched = torch.func.vmap(lambda a, b: householder_apply(a, b, 2))(v, x)
    assert torch.allclose(batched, householder_apply(v, x, 2), atol=1e-14)

    def loss(a):
        return householder_apply(a, x[0], 2).pow(3).sum()

    g = torch.func.grad(loss)(v[0])
    a = v[0].clone().requires_grad_()
    (ref,) = torch.autograd.grad(loss(a), a)
    assert torch.allclose(g, ref, atol=1e-12)
    per_sample = torch.func.vmap(torch.func.grad(loss))(v)
    assert torch.allclose(per_sample[0], ref, atol=1e-12)


# ---------------------------------------------------------------- parameters and names
def test_a_parameter_constrains_its_module_without_a_warning():
    lin = nn.Linear(4, 4, dtype=torch.float64)
    p = lin.weight
    before = p.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert orthogonalize(p, method="cwy") is p
        orthogonalize(torch.randn(4, 4), method="cwy")  # a plain tensor: no warning
    assert lin.parametrizations.weight.original is p
    assert orth_err(lin.weight) < 1e-12
    # the nearest point of the old value (polar factor, by the SVD in float64)
    u, _, vh = torch.linalg.svd(before)
    assert torch.allclose(lin.weight, u @ vh, atol=1e-10)


def test_dotted_names_reach_submodules():
    model = nn.Sequential(nn.Linear(3, 5), nn.RNN(5, 5))
    orthogonalize(model, "1.weight_hh_l0", method="householder")
    assert orth_err(model[1].weight_hh_l0) < 1e-5
    with pytest.raises(ValueError, match="no submodule 'rnn'"):
        orthogonalize(model, "rnn.weight_hh_l0", method="cwy")
    # a container has no weight of its own: the error names its submodules' matrices
    with pytest.raises(ValueError, match=r"not a tensor of Sequential; allowed: 0\.weight, "):
        orthogonalize(model, method="riemannian")


# ---------------------------------------------------------------- riemannian in place
def test_riemannian_keeps_the_parameter_object_and_ties():
    emb = nn.Embedding(6, 3)
    head = nn.Linear(3, 6, bias=False)
    head.weight = emb.weight  # tied
    param, ptr = emb.weight, emb.weight.data_ptr()
    opt = torch.optim.SGD([param], lr=0.1)  # built before the call
    orthogonalize(emb, method="riemannian")
    assert emb.weight is param and head.weight is param and param.data_ptr() == ptr
    assert isinstance(param, geoopt.ManifoldParameter) and param.manifold.n == 6
    assert orth_err(param) < 1e-6
    ropt = geoopt.optim.RiemannianSGD([param], lr=0.1)
    param.grad = torch.randn_like(param)
    ropt.step()
    assert orth_err(param) < 1e-5 and head.weight is param
    before = param.detach().clone()
    opt.step()
    assert not torch.equal(param.detach(), before)  # the pre-built optimizer steps the weight


def test_riemannian_and_a_map_on_one_weight_are_refused():
    lin = orthogonalize(nn.Linear(4, 4), method="cwy")
    with pytest.raises(ValueError, match="already parametrized"):
        orthogonalize(lin, method="riemannian")
    lin = orthogonalize(nn.Linear(4, 4), method="riemannian")
    for method in ("cwy", "riemannian"):
        with pytest.raises(ValueError, match="already a manifold parameter"):
            orthogonalize(lin, method=method)


def test_real_map_refuses_a_complex_conversion():
    lin = orthogonalize(nn.Linear(4, 4, bias=False), method="cwy")
    lin.to(torch.complex64)
    with pytest.raises(TypeError, match="refused"):
        _ = lin.weight


# ---------------------------------------------------------------- meta device
@pytest.mark.parametrize("method", MAPS)
@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])
def test_meta_then_to_empty_then_assign_a_point(method, shape):
    with torch.device("meta"):
        lin = nn.Linear(*shape)
    orthogonalize(lin, method=method)  # no value is read on meta
    assert lin.weight.device.type == "meta" and lin.weight.shape == (shape[1], shape[0])
    lin.to_empty(device="cpu")
    q = nn.init.orthogonal_(torch.empty(shape[1], shape[0]))  # Note [Meta weights]
    lin.weight = q
    assert (lin.weight - q).abs().max() < 1e-5 and orth_err(lin.weight) < 1e-5


def test_meta_riemannian_is_converted_again_after_to_empty():
    with torch.device("meta"):
        lin = nn.Linear(4, 6)
    orthogonalize(lin, method="riemannian")
    lin.to_empty(device="cpu")  # torch rebuilds the Parameter (a plain one)
    orthogonalize(lin, method="riemannian", init="haar")
    assert isinstance(lin.weight, geoopt.ManifoldParameter) and orth_err(lin.weight) < 1e-5
