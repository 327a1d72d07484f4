"""Standard recipes: what orthogonalize returns, rotate's riemannian Q shape, init="torus",
the nearest point, paddings, tied weights, stacked gates and conv slices."""

from __future__ import annotations

import math

import pytest
import torch
from geotorch.so import torus_init_
from torch import nn

import stiefel
from stiefel.manifolds.kernels import polar
from stiefel.parametrizations import orthogonalize
from stiefel.parametrizations._polar import nearest_point

F32, F64 = torch.float32, torch.float64


def err64(q: torch.Tensor) -> float:
    q = q.detach().double()
    q = q.mT if q.shape[-2] < q.shape[-1] else q
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return float(torch.linalg.matrix_norm(q.mT @ q - eye).max())


def test_dotted_name_returns_the_model_given():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    assert orthogonalize(model, "1.0.weight", method="cwy") is model
    assert orthogonalize(model, "0.weight", method="riemannian") is model


def test_rotate_riemannian_one_block_is_n_by_n():
    layer = stiefel.rotate(nn.Linear(6, 6), method="riemannian")
    (q,) = layer.rotation.originals
    assert q.shape == (6, 6)
    assert stiefel.rotate(nn.Linear(6, 6), method="riemannian", blocks=2).rotation.originals[
        0
    ].shape == (2, 3, 3)


@pytest.mark.parametrize(("shape", "method"), [((7, 7), "exp"), ((6, 6), "cwy"), ((7, 3), "tcwy")])
def test_torus_init_is_geotorchs(shape, method):
    n, m = max(shape), min(shape)
    torch.manual_seed(3)
    ref = torus_init_(torch.empty(2, n, n, dtype=F64))[..., :m]  # geotorch's own construction
    torch.manual_seed(3)
    w = orthogonalize(torch.zeros(2, *shape, dtype=F64), method=method, init="torus")
    assert torch.allclose(w(), ref, atol=1e-12)
    gen = torch.Generator().manual_seed(4)
    w1 = orthogonalize(torch.zeros(n, n), method=method, init="torus", generator=gen)
    eig = torch.linalg.eigvals(w1().double()) if m == n else None
    if eig is not None:  # eigenvalues on the unit circle, in conjugate pairs
        assert torch.allclose(eig.abs(), torch.ones(n, dtype=F64), atol=1e-5)


def _with_singular_values(n: int, m: int, sigma: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=F64))[0]
    v = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=F64))[0]
    return (u * sigma) @ v.T


@pytest.mark.parametrize(("n", "m"), [(40, 40), (50, 12)])
@pytest.mark.parametrize("kappa", [4.0, 1e4])
def test_nearest_point_matches_the_svd_polar_factor(n, m, kappa):
    sigma = torch.logspace(0, -math.log10(kappa), m, dtype=F64)
    a64 = _with_singular_values(n, m, sigma, seed=int(kappa) + n)
    q = nearest_point(a64.float())
    ref = polar(a64)  # float64 SVD polar factor
    eps = torch.finfo(F32).eps
    assert q.dtype == F32 and err64(q) <= 20 * math.sqrt(m) * eps
    # the polar factor moves by up to ~κ·eps under a relative perturbation eps of A
    assert float((q.double() - ref).abs().max()) <= 10 * kappa * eps


def test_nearest_point_of_a_singular_matrix_is_the_svd_polar_factor():
    a = torch.zeros(4, 4)
    a[0, 0] = a[1, 1] = 1.0  # singular: the SVD's UVᴴ (zero directions kept)
    assert torch.equal(nearest_point(a), polar(a))


def test_default_init_is_the_nearest_point():
    torch.manual_seed(0)
    lin = nn.Linear(24, 24)
    ref = polar(lin.weight.detach().double())
    orthogonalize(lin, method="cwy")
    assert float((lin.weight.detach().double() - ref).abs().max()) < 1e-3


@pytest.mark.parametrize(
    ("kwargs", "ok"),
    [
        (dict(kernel_size=2, padding=1, padding_mode="circular"), False),
        (dict(kernel_size=3, padding=2, padding_mode="circular"), False),
        (dict(kernel_size=3, padding=1, padding_mode="circular"), True),
        (dict(kernel_size=3, padding="same", padding_mode="circular"), True),
        (dict(kernel_size=3, padding=4, padding_mode="zeros"), True),
    ],
)
def test_conv_kernel_padding(kwargs, ok):
    conv = nn.Conv2d(4, 4, bias=False, dtype=F64, **kwargs)
    if not ok:
        with pytest.raises(ValueError, match="padding_mode='circular' and padding=.*allowed"):
            orthogonalize(conv, method="cwy", conv_kernel=True)
        assert not hasattr(conv, "parametrizations")
        return
    orthogonalize(conv, method="cwy", conv_kernel=True, init="haar")
    x = torch.randn(1, 4, 7, 7, dtype=F64, requires_grad=True)
    for _ in range(60):  # power iteration on convᵀconv: ‖conv‖₂
        (g,) = torch.autograd.grad(conv(x).pow(2).sum() / 2, x)
        x = (g / g.norm()).detach().requires_grad_()
    assert float(conv(x).norm() / x.norm()) <= 1 + 1e-9


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 6)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_are_refused_when_the_root_is_given():
    model = Tied()
    with pytest.raises(ValueError, match=r"tied.*emb\.weight"):
        orthogonalize(model, "head.weight", method="cwy")
    assert not hasattr(model.head, "parametrizations")
    orthogonalize(model, "head.weight", method="riemannian")  # keeps the Parameter: allowed
    assert model.head.weight is model.emb.weight


def test_merge_refuses_a_tied_weight():
    model = Tied()
    before = model.emb.weight.detach().clone()
    with pytest.raises(ValueError, match="rotate would freeze.*tied.*Embedding"):
        stiefel.rotate(model.head, method="cwy")  # the tie still trains: refused first
    model.emb.weight.requires_grad_(False)  # a frozen base, as PEFT freezes one
    stiefel.rotate(model.head, method="cwy")
    with pytest.raises(ValueError, match="tied.*Embedding"):
        stiefel.merge(model.head)
    assert torch.equal(model.emb.weight, before)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_stacked_gates(cell):
    torch.manual_seed(0)
    rnn = cell(5, 5)
    with pytest.raises(ValueError, match="gate matrices.*gates=True"):
        orthogonalize(rnn, "weight_hh_l0", method="cwy")
    w0 = rnn.weight_hh_l0.detach().double().clone()
    orthogonalize(rnn, "weight_hh_l0", method="cwy", gates=True)
    g = 4 if cell is nn.LSTM else 3
    gates = rnn.weight_hh_l0.detach().double().reshape(g, 5, 5)
    assert rnn.weight_hh_l0.shape == (5 * g, 5)
    for i in range(g):  # each gate is its own nearest point
        assert float((gates[i] - polar(w0[5 * i : 5 * i + 5])).abs().max()) < 1e-4
    out, _ = rnn(torch.randn(3, 2, 5))
    out.sum().backward()
    with pytest.raises(ValueError, match="gates=True constrains"):
        orthogonalize(nn.Linear(4, 4), gates=True)


def test_conv_weight_without_conv_kernel_warns():
    with pytest.warns(UserWarning, match="conv_kernel=True"):
        orthogonalize(nn.Conv2d(3, 3, 2), method="cwy")
