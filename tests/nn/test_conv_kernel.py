"""orthogonalize(conv, conv_kernel=True): the kernel matrix √k·K̂ on St, the conv non-expansive."""

import math

import geoopt
import pytest
import torch
from torch import nn

from stiefel import orthogonalize
from stiefel.parametrizations.conv import ConvKernel

METHODS = ["tcwy", "cwy", "householder", "cayley", "exp", "riemannian"]
DT = torch.float64


def kernel_matrix(conv: nn.Module) -> torch.Tensor:
    """√k·K̂, (in·k) × out, from the weight the module computes with."""
    w = conv.weight
    k = math.prod(w.shape[2:])
    return w.reshape(w.shape[0], -1).T * math.sqrt(k)


def make(kind, cin, cout, k, **kw):
    torch.manual_seed(0)
    return kind(cin, cout, k, dtype=DT, bias=False, **kw)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("kind", "cin", "cout", "k", "spatial"),
    [
        (nn.Conv1d, 2, 3, 3, (9,)),  # tall: in·k = 6 ≥ 3
        (nn.Conv2d, 3, 4, 3, (6, 5)),  # tall: 27 × 4
        (nn.Conv2d, 1, 6, 2, (5, 5)),  # wide: 4 < 6, K̂ᵀ on St(6, 4)
        (nn.Conv3d, 2, 2, 2, (3, 4, 3)),
    ],
)
def test_kernel_matrix_on_stiefel_and_conv_is_nonexpansive(
    method, kind, cin, cout, k, spatial, device
):
    conv = make(kind, cin, cout, k, padding=k // 2, device=device)
    orthogonalize(conv, "weight", method=method, conv_kernel=True)
    assert conv.weight.device.type == device
    q = kernel_matrix(conv).detach().cpu()
    t = q if q.shape[0] >= q.shape[1] else q.T
    eye = torch.eye(t.shape[1], dtype=DT)
    assert float((t.T @ t - eye).norm()) < 100 * t.shape[0] * torch.finfo(DT).eps
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(3, cin, *spatial, dtype=DT, generator=gen)
        y = conv(x.to(device)).detach().cpu()
        ratio = (y.flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)).max()
        assert ratio <= 1 + 1e-12, float(ratio)
    # the bound is attained up to boundary effects: not a trivially tiny kernel
    assert 0.3 < float(ratio)


def test_bound_is_tight_for_circular_one_tap_square_kernels():
    """k = 1, in = out, circular padding: y_p = Qᵀ x_p with Q orthogonal, ‖y‖ = ‖x‖."""
    for method in ["tcwy", "cayley", "riemannian"]:
        conv = make(nn.Conv2d, 5, 5, 1, padding_mode="circular")
        orthogonalize(conv, "weight", method=method, conv_kernel=True)
        x = torch.randn(4, 5, 6, 7, dtype=DT)
        assert torch.allclose(conv(x).flatten(1).norm(dim=1), x.flatten(1).norm(dim=1), rtol=1e-12)


def test_circular_padding_tall_kernel_nonexpansive_and_stride():
    conv = make(nn.Conv2d, 4, 3, 3, padding=1, padding_mode="circular")
    orthogonalize(conv, "weight", method="tcwy", conv_kernel=True)
    x = torch.randn(8, 4, 5, 5, dtype=DT)
    assert (conv(x).flatten(1).norm(dim=1) <= x.flatten(1).norm(dim=1) * (1 + 1e-12)).all()
    strided = make(nn.Conv2d, 4, 3, 3, padding=1, stride=2)
    orthogonalize(strided, "weight", method="cwy", conv_kernel=True)
    assert (strided(x).flatten(1).norm(dim=1) <= x.flatten(1).norm(dim=1)).all()


def test_an_unconstrained_kernel_breaks_the_bound():
    """The property tested above can fail: the same kernel unscaled is expansive."""
    conv = make(nn.Conv2d, 3, 4, 3, padding=1)
    orthogonalize(conv, "weight", method="tcwy", conv_kernel=True)
    w = conv.weight.detach() * 3  # = √k·K̂ reshaped: the 1/√k dropped
    x = torch.ones(1, 3, 6, 6, dtype=DT)
    assert (
        max(
            float(torch.nn.functional.conv2d(xx, w, padding=1).norm() / xx.norm())
            for xx in (x, torch.randn(50, 3, 6, 6, dtype=DT))
        )
        > 1
    )


def test_riemannian_kernel_is_a_tall_manifold_parameter_and_trains():
    conv = make(nn.Conv2d, 1, 6, 2, padding=1)  # wide: stored as St(6, 4)
    orthogonalize(conv, "weight", method="riemannian", conv_kernel=True)
    p = conv.parametrizations.weight.original
    assert isinstance(p, geoopt.ManifoldParameter) and tuple(p.shape) == (6, 4)
    opt = geoopt.optim.RiemannianSGD(conv.parameters(), lr=0.1)
    conv(torch.randn(2, 1, 5, 5, dtype=DT)).square().sum().backward()
    opt.step()
    t = p.detach()
    assert float((t.T @ t - torch.eye(4, dtype=DT)).norm()) < 1e-12
    assert torch.allclose(kernel_matrix(conv).detach(), t.T, atol=1e-14)


def test_gradients_and_assignment_round_trip():
    conv = make(nn.Conv2d, 2, 3, 3, padding=1)
    orthogonalize(conv, "weight", method="tcwy", conv_kernel=True)
    conv(torch.randn(2, 2, 4, 4, dtype=DT)).sum().backward()
    g = conv.parametrizations.weight.original.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # assigning a point: a weight whose kernel matrix is on St(18, 3)
    other = make(nn.Conv2d, 2, 3, 3, padding=1)
    orthogonalize(other, "weight", method="cayley", conv_kernel=True, init="haar")
    with torch.no_grad():
        conv.weight = other.weight.detach()
    assert torch.allclose(conv.weight, other.weight, atol=1e-10)
    param = conv.parametrizations.weight[0]
    assert isinstance(param, ConvKernel) and param.taps == 9
    with pytest.raises(ValueError, match="not on"):
        with torch.no_grad():
            conv.weight = torch.randn(3, 2, 3, 3, dtype=DT)


def test_bad_input_names_the_argument_and_what_is_allowed():
    with pytest.raises(TypeError, match="conv_kernel=True needs a convolution module.*Conv1d"):
        orthogonalize(nn.Linear(4, 4), conv_kernel=True)
    with pytest.raises(TypeError, match="convolution module; got (Tensor|Parameter)"):
        orthogonalize(torch.randn(4, 4), conv_kernel=True)
    with pytest.raises(TypeError, match="conv_kernel=.* is not allowed; allowed: True, False"):
        orthogonalize(nn.Conv2d(2, 2, 3), conv_kernel="yes")
    grouped = nn.Conv2d(4, 4, 3, groups=2)
    before = grouped.weight.detach().clone()
    with pytest.raises(ValueError, match="groups=1, got groups=2"):
        orthogonalize(grouped, conv_kernel=True)
    assert torch.equal(grouped.weight, before) and not hasattr(grouped, "parametrizations")
    with pytest.raises(ValueError, match="padding_mode='reflect'; allowed: zeros, circular"):
        orthogonalize(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), conv_kernel=True)
    with pytest.raises(ValueError, match="name='bias' with conv_kernel=True; allowed: 'weight'"):
        orthogonalize(nn.Conv2d(2, 2, 3), "bias", conv_kernel=True)
    conv = nn.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match="method.*'nope'.*tcwy"):
        orthogonalize(conv, method="nope", conv_kernel=True)
    with pytest.raises(TypeError, match="unknown option"):
        orthogonalize(conv, method="cayley", conv_kernel=True, reflections=2)
    assert not hasattr(conv, "parametrizations")  # nothing half-done
    with pytest.raises(ValueError, match="already parametrized"):
        orthogonalize(orthogonalize(conv, conv_kernel=True), conv_kernel=True)
