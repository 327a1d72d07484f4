"""Older open items: torch.func through the maps' Functions, tied heads in `rotate`,
``init="nearest"`` at extreme scales, and what a refused exp/cayley base says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stiefel.parametrizations import orthogonalize
from stiefel.parametrizations._cayley import BLOCK, cayley_solve, unpivoted
from stiefel.parametrizations._expm import expm as _expm
from stiefel.parametrizations._spectral import skew_spectral
from stiefel.parametrizations.finetuning import merge, rotate, rotation


def _skew(n, scale, seed, dtype=torch.float64, batch=()):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n, dtype=torch.float64, generator=gen)
    if dtype.is_complex:
        a = a + 1j * torch.randn(*batch, n, n, dtype=torch.float64, generator=gen)
    a = (a - a.mH).to(dtype)
    return scale * a / float(a.abs().sum(-1).max())  # ‖A‖₁ = scale


# ---------------------------------------------------------------- torch.func through the maps
# Each Function (Padé expm, the unpivoted Cayley solve, the eigh path) against torch's own
# differentiable kernels under the same transform: torch.linalg.matrix_exp and
# torch.linalg.solve are the independent references.


def _cayley_ref(a, b):
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    return torch.linalg.solve(eye + a, (eye - a) @ b)


@pytest.mark.parametrize("route", ["lu", "cholesky"])  # the Padé solve of each device type
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("scale", [0.01, 1.0, 20.0])  # Padé degrees 3 to 13, 0 to 3 squarings
def test_expm_under_torch_func_grad_and_jacrev(dtype, scale, route):
    def expm(x):  # the route as the exp map's dispatcher names it
        return _expm(x, cholesky=route == "cholesky")

    a = _skew(5, scale, 0, dtype)
    w = _skew(5, 1.0, 1, dtype)

    def loss(fn):
        return lambda x: (fn(x) * w.conj()).real.sum()

    want = torch.func.grad(loss(torch.linalg.matrix_exp))(a)
    got = torch.func.grad(loss(expm))(a)
    tol = 100 * torch.finfo(torch.float64).eps * max(1.0, scale)
    assert torch.allclose(got, want, rtol=0, atol=tol)
    leaf = a.clone().requires_grad_(True)  # the ordinary autograd gradient
    loss(expm)(leaf).backward()
    assert torch.allclose(got, leaf.grad, rtol=0, atol=tol)
    if not dtype.is_complex:  # jacrev of a complex output needs a real one
        jac = torch.func.jacrev(lambda x: expm(x)[:2])(a)
        ref = torch.func.jacrev(lambda x: torch.linalg.matrix_exp(x)[:2])(a)
        assert torch.allclose(jac, ref, rtol=0, atol=tol)
    if route == "lu":  # gradcheck's perturbed A is not skew: the LU only
        assert torch.autograd.gradcheck(expm, (a.clone().requires_grad_(True),))


@pytest.mark.parametrize("kind", ["exp", "cayley"])
def test_the_eigh_path_under_torch_func(kind):
    a = _skew(5, 300.0, 2)  # ‖A‖₁ far above the eigh threshold: the path the maps take there
    w = _skew(5, 1.0, 3)
    eye = torch.eye(5, dtype=torch.float64)

    def ref(x):
        s = 0.5 * (x - x.mT)
        return torch.linalg.matrix_exp(s) if kind == "exp" else torch.linalg.solve(eye + s, eye - s)

    got = torch.func.jacrev(lambda x: skew_spectral(x, kind)[0])(a)
    want = torch.func.jacrev(lambda x: ref(x)[0])(a)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * 300)
    batch = torch.stack([a, 0.5 * a])
    loss = lambda x: (skew_spectral(x, kind) * w).sum()  # noqa: E731
    want_b = torch.stack([(ref(x) * w).sum() for x in batch])
    assert torch.allclose(torch.func.vmap(loss)(batch), want_b, atol=1e-10)


def test_unpivoted_cayley_solve_under_torch_func():
    n = BLOCK + 3  # the elimination without pivoting (two blocks, the second ragged)
    a = _skew(n, 2.0, 4)
    norm = float(a.abs().sum(-1).max())
    assert unpivoted(n, norm)
    gen = torch.Generator().manual_seed(5)
    b = torch.randn(n, 2, dtype=torch.float64, generator=gen)
    w = torch.randn(n, 2, dtype=torch.float64, generator=gen)
    got = torch.func.grad(lambda x: (cayley_solve(x, b, "unpivoted_blocks") * w).sum())(a)
    want = torch.func.grad(lambda x: (_cayley_ref(x, b) * w).sum())(a)
    assert torch.allclose(got, want, rtol=0, atol=1e-11)
    jac = torch.func.jacrev(lambda x: cayley_solve(x, b, "unpivoted_blocks")[:2, 0])(a)
    ref = torch.func.jacrev(lambda x: _cayley_ref(x, b)[:2, 0])(a)
    assert torch.allclose(jac, ref, rtol=0, atol=1e-11)
    batch = torch.stack([a, 0.5 * a])
    got_b = torch.func.vmap(lambda x: cayley_solve(x, b, "unpivoted_blocks"))(batch)
    assert torch.allclose(got_b, _cayley_ref(batch, b), rtol=0, atol=1e-11)


@pytest.mark.parametrize("method", ["exp", "cayley", "scaled_cayley"])
def test_torch_func_grad_through_a_map_equals_autograd(method):
    lin = orthogonalize(nn.Linear(6, 4, bias=False).double(), method=method)
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = {k: v.detach().clone() for k, v in lin.named_parameters()}

    def loss(p):
        return (torch.func.functional_call(lin, p, (x,)) ** 2).sum()

    got = torch.func.grad(loss)(params)
    (loss_eager := (lin(x) ** 2).sum()).backward()
    assert loss_eager.isfinite()
    for name, p in lin.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=0, atol=1e-12), name
    # and the Jacobian against central differences of the very same call
    (name,) = params
    jac = torch.func.jacrev(loss)(params)[name]
    h, fd = 1e-6, torch.zeros_like(jac)
    for i in range(jac.numel()):
        e = torch.zeros(jac.numel(), dtype=torch.float64)
        e[i] = h
        plus = {name: params[name] + e.view_as(jac)}
        minus = {name: params[name] - e.view_as(jac)}
        fd.view(-1)[i] = (loss(plus) - loss(minus)) / (2 * h)
    assert torch.allclose(jac, fd, rtol=0, atol=1e-7)


# ---------------------------------------------------------------- rotate on a tied head


class _TiedLM(nn.Module):
    """A tiny language model whose output layer is tied to its embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, dtype=torch.float64)
        self.head = nn.Linear(4, 10, bias=False, dtype=torch.float64)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_rotate_refuses_a_tied_head_that_trains_and_changes_nothing():
    torch.manual_seed(0)
    model = _TiedLM()
    ids = torch.tensor([[1, 2, 3]])
    before = model(ids).detach()
    with pytest.raises(ValueError, match=r"Linear.weight, which is tied.*Embedding\.weight"):
        rotate(model.head, method="cayley")
    # nothing changed: the embedding still trains, no rotation, no hook
    assert model.emb.weight.requires_grad and model.head.weight is model.emb.weight
    assert not hasattr(model.head, "rotation")
    assert not model.head._forward_pre_hooks
    assert torch.equal(model(ids), before)
    model(ids).sum().backward()
    assert model.emb.weight.grad is not None


def test_rotate_on_a_frozen_tied_head_and_on_an_untied_one():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3]])
    # frozen first (the whole base, as PEFT does): the tie freezes nothing more
    model = _TiedLM().requires_grad_(False)
    rotate(model.head, method="cayley")
    w = model.emb.weight.detach().clone()
    with torch.no_grad():
        for p in model.head.rotation.parameters():
            p.normal_()
    q = rotation(model.head).detach()
    x = model.emb(ids)
    # reference: the dense float64 product x (W Q)ᵀ with Q from its own matrix
    assert torch.allclose(model(ids), x @ (w @ q).T, atol=1e-12)
    assert torch.equal(model.emb.weight, w) and not model.emb.weight.requires_grad
    with pytest.raises(ValueError, match=r"tied weight.*Embedding\.weight"):
        merge(model.head)
    # untied first: rotate proceeds and the embedding keeps training
    model = _TiedLM()
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    rotate(model.head, method="cayley")
    assert model.emb.weight.requires_grad and not model.head.weight.requires_grad
    model(ids).sum().backward()
    assert model.emb.weight.grad is not None and model.head.weight.grad is None


# ---------------------------------------------------------------- init="nearest" at extreme scales


def _polar64(w):
    """The reference: U Vᴴ of the float64 SVD of the very values stored."""
    hi = torch.complex128 if w.is_complex() else torch.float64
    u, _, vh = torch.linalg.svd(w.detach().to(hi), full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("scale", [1e20, 1e30, 1e-20, 1e-30, 1e-40])  # 1e-40: subnormal
@pytest.mark.parametrize("method", ["cayley", "exp", "riemannian"])
def test_init_nearest_is_the_polar_factor_at_extreme_scales(method, scale):
    lin = nn.Linear(4, 6, bias=False)  # a tall 6×4 weight: every method serves it
    with torch.no_grad():
        w = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
        lin.weight.copy_(w * scale)
    ref = _polar64(lin.weight)  # of the float32 values stored, in float64
    orthogonalize(lin, method=method, init="nearest")
    tol = 100 * 6 * torch.finfo(torch.float32).eps  # κ(W)·n·eps with κ(W) of a few units
    assert float((lin.weight.detach().double() - ref).abs().max()) <= tol


@pytest.mark.parametrize(
    "dtype,scales",
    [
        (torch.float32, [1e19, 1.0, 1e-19]),
        (torch.complex64, [1e19, 1.0, 1e-19]),
        (torch.float64, [1e160, 1.0, 1e-160]),  # the Gram of 1e160 overflows float64
    ],
)
def test_nearest_point_of_scaled_batches(dtype, scales):
    from stiefel.parametrizations._polar import nearest_point

    gen = torch.Generator().manual_seed(8)
    a = torch.randn(3, 7, 4, dtype=dtype, generator=gen)
    # the reference: the float64 SVD's polar factor of the unscaled matrices (polar(cA) =
    # polar(A) for c > 0); each matrix of the batch gets its own scale
    ref = _polar64(a)
    scaled = a * torch.tensor(scales, dtype=torch.float64).to(a.real.dtype).view(3, 1, 1)
    got = nearest_point(scaled)
    tol = 100 * 7 * torch.finfo(dtype).eps
    assert float((got.to(ref.dtype) - ref).abs().max()) <= tol


# ---------------------------------------------------------------- what a refused base says
# The exp/cayley base must be a point (`_Based.check_state`): a finite base off the
# manifold is refused as "not a point … orthonormal columns", in every path that reads
# it (load, a conversion that repairs rounded bases, first use), never as "not finite".


def _with_base(method, base_of, path):
    lin = orthogonalize(nn.Linear(5, 5), method=method)
    fmap = lin.parametrizations.weight[0]
    bad = base_of(fmap.base)
    if path == "load":
        sd = lin.state_dict()
        sd["parametrizations.weight.0.base"] = bad
        lin.load_state_dict(sd)
        return lin
    with torch.no_grad():
        fmap.base.copy_(bad)
    if path == "convert":
        lin.double()  # the repair of a rounded base runs here, and must leave this one alone
    return lin.weight


@pytest.mark.parametrize("path", ["load", "convert", "use"])
@pytest.mark.parametrize("method", ["exp", "cayley"])
def test_a_finite_base_off_the_manifold_is_refused_as_not_a_point(method, path):
    gen = torch.Generator().manual_seed(9)
    for scale in (3.0, 1e30):  # far off; and huge, where a repair would overflow
        with pytest.raises(ValueError) as caught:
            _with_base(method, lambda b, s=scale: s * torch.randn(b.shape, generator=gen), path)
        msg = str(caught.value)
        assert "buffer 'base' is not a point" in msg and "orthonormal columns" in msg, msg
        assert "not finite" not in msg, msg


@pytest.mark.parametrize("method", ["exp", "cayley"])
def test_a_non_finite_base_is_refused_as_not_finite(method):
    def nan_base(b):
        out = b.clone()
        out[0, 0] = float("nan")
        return out

    with pytest.raises(ValueError, match="not finite"):
        _with_base(method, nan_base, "use")


# ---------------------------------------------------------------- one padding check, two callers


def test_check_padding_names_its_caller():
    from types import SimpleNamespace

    from stiefel.nn import OrthoConvTranspose2d
    from stiefel.parametrizations.conv import _check_padding

    def conv(mode, padding):
        return SimpleNamespace(
            padding_mode=mode, padding=padding, kernel_size=(3, 3), dilation=(1, 1)
        )

    with pytest.raises(ValueError, match=r"^conv_kernel=True with padding_mode='circular' and"):
        _check_padding(conv("circular", (2, 1)))
    with pytest.raises(ValueError, match=r"^MyLayer with padding_mode='circular' and padding=\(2"):
        _check_padding(conv("circular", (2, 1)), what="MyLayer")
    with pytest.raises(ValueError, match=r"^MyLayer with padding_mode='reflect'; allowed"):
        _check_padding(conv("reflect", (1, 1)), what="MyLayer")
    _check_padding(conv("circular", (1, 1)), what="MyLayer")  # "same" for k = 3: allowed
    # the layers pass their class name; the message names the (h, w) padding
    with pytest.raises(ValueError, match=r"^OrthoConvTranspose2d with .* padding=\(1, 2\) "):
        OrthoConvTranspose2d(4, 4, 3, padding=[1, 2])
