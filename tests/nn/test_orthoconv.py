"""OrthoConv2d, OrthoConvTranspose2d: exactness (dense float64 SVDs), adjoints, orthogonium."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from stiefel.nn import OrthoConv2d, OrthoConvTranspose2d
from stiefel.nn.orthoconv import _adjoint_pad
from stiefel.nn.orthokernel import compose_kernels, projector_step
from stiefel.parametrizations import initialize

DT = torch.float64


def _tol(dtype):
    return 100 * torch.finfo(DT).eps if dtype == DT else 1e-5


def _dtype(layer):
    return next(layer.parameters()).dtype


def fft_singular_values(layer, in_channels, n, dtype=None):
    """Singular values of a stride-1 circular layer: FFT of its impulse responses, float64 SVD."""
    x = torch.zeros(in_channels, in_channels, n, n, dtype=dtype or _dtype(layer))
    x[torch.arange(in_channels), torch.arange(in_channels), 0, 0] = 1
    with torch.no_grad():
        y = layer(x).double()  # (in, out, n, n): the response to an impulse in each channel
    transfer = torch.fft.fft2(y).permute(2, 3, 1, 0)  # (n, n, out, in)
    return torch.linalg.svdvals(transfer).flatten()


def dense_singular_values(layer, shape, dtype=None):
    """Singular values of the layer as a dense matrix of the whole image (float64)."""
    numel = math.prod(shape)
    basis = torch.eye(numel, dtype=dtype or _dtype(layer)).reshape(numel, *shape)
    with torch.no_grad():
        y = layer(basis).reshape(numel, -1).double()
    return torch.linalg.svdvals(y)


def _train(layer, shape, steps=50):
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    x = torch.randn(4, *shape, dtype=next(layer.parameters()).dtype)
    target = torch.randn_like(layer(x))
    for _ in range(steps):
        opt.zero_grad()
        loss = (layer(x) - target).square().sum()
        loss.backward()
        opt.step()
    return layer


# (in, out, k, groups, dilation): equal channels, in < out, in > out, even k, groups, dilation
STRIDE1 = [
    (4, 4, 3, 1, 1),
    (3, 5, 3, 1, 1),
    (6, 2, 3, 1, 1),
    (4, 4, 2, 1, 1),
    (4, 6, 4, 1, 1),
    (4, 8, 3, 2, 1),
    (4, 4, 3, 1, 2),
    (5, 5, 1, 1, 1),
]


@pytest.mark.parametrize("dtype", [DT, torch.float32])
@pytest.mark.parametrize("cfg", STRIDE1, ids=str)
def test_every_singular_value_is_one_with_circular_padding(cfg, dtype):
    torch.manual_seed(0)
    ci, co, k, g, d = cfg
    layer = OrthoConv2d(ci, co, k, groups=g, dilation=d, bias=False, dtype=dtype)
    start = layer.weight.detach().clone()
    for when in ("init", "after 50 Adam steps"):
        sv = fft_singular_values(layer, ci, 8)
        assert sv.numel() == 64 * min(ci, co)
        assert (sv - 1).abs().max() <= _tol(dtype), when
        _train(layer, (ci, 8, 8))
    assert not torch.allclose(layer.weight, start, atol=1e-3)  # training moved the kernel


STRIDED = [  # (in, out, k, stride, groups, dilation)
    (4, 4, 3, 2, 1, 1),  # co-isometry: inter = in, R row-orthonormal
    (4, 16, 3, 2, 1, 1),  # square: inter·s² = out
    (4, 32, 3, 2, 1, 1),  # isometry: inter = out/s² > in
    (8, 4, 4, 2, 1, 1),  # even k, in > out
    (4, 4, 2, 2, 1, 1),  # k = s: the reshaped factor alone
    (8, 4, 1, 2, 1, 1),  # k < s: a co-isometry on 1×1 of every 2×2 block
    (4, 4, 3, 2, 1, 3),  # dilation coprime to the stride
    (4, 8, 3, 2, 2, 1),  # groups
    (2, 9, 4, 3, 1, 1),  # stride 3
]


@pytest.mark.parametrize("cfg", STRIDED, ids=str)
def test_strided_and_transposed_layers_have_unit_singular_values(cfg):
    torch.manual_seed(0)
    ci, co, k, s, g, d = cfg
    n = 6 if s == 3 else 8
    conv = OrthoConv2d(ci, co, k, stride=s, groups=g, dilation=d, bias=False, dtype=DT)
    up = OrthoConvTranspose2d(co, ci, k, stride=s, groups=g, dilation=d, bias=False, dtype=DT)
    for layer, shape in ((conv, (ci, n, n)), (up, (co, n // s, n // s))):
        for _ in range(2):  # at init, then after training
            sv = dense_singular_values(layer, shape)
            assert sv.numel() == min(ci * n * n, co * (n // s) ** 2)
            assert (sv - 1).abs().max() <= _tol(DT)
            _train(layer, shape, steps=20)


def test_fft_and_dense_singular_values_agree():
    torch.manual_seed(1)
    w = torch.randn(4, 3, 3, 3, dtype=DT)  # unconstrained, so that the spectra are not all ones
    free = lambda x: F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), w)  # noqa: E731
    a = fft_singular_values(free, 3, 5, DT).sort().values
    b = dense_singular_values(free, (3, 5, 5), DT).sort().values
    assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("mode", ["circular", "zeros"])
@pytest.mark.parametrize("k", [2, 3])
def test_forward_matches_nn_conv2d_with_the_assembled_kernel(mode, k):
    torch.manual_seed(0)
    layer = OrthoConv2d(4, 6, k, padding_mode=mode, dtype=DT)
    with torch.no_grad():
        layer.bias.normal_()
    ref = nn.Conv2d(4, 6, k, padding="same", padding_mode=mode, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    x = torch.randn(2, 4, 7, 9, dtype=DT)
    assert torch.allclose(layer(x), ref(x), atol=1e-12)


@pytest.mark.parametrize("mode", ["circular", "zeros"])
@pytest.mark.parametrize("cfg", [(3, 5, 3, 1), (4, 4, 2, 1), (4, 8, 3, 2), (8, 4, 4, 2)], ids=str)
def test_transposed_layer_is_the_adjoint(cfg, mode):
    torch.manual_seed(0)
    ci, co, k, s = cfg
    conv = OrthoConv2d(ci, co, k, stride=s, padding_mode=mode, bias=False, dtype=DT)
    up = OrthoConvTranspose2d(co, ci, k, stride=s, padding_mode=mode, bias=False, dtype=DT)
    up.load_state_dict(conv.state_dict())
    assert torch.equal(up.weight, conv.weight)
    x = torch.randn(2, ci, 8, 8, dtype=DT, requires_grad=True)
    y = conv(x)
    u = torch.randn_like(y)
    (vjp,) = torch.autograd.grad(y, x, u)
    assert torch.allclose(up(u), vjp, atol=1e-12)


def test_zero_padding_is_non_expansive_and_isometric_in_the_interior():
    torch.manual_seed(0)
    zeros = OrthoConv2d(3, 5, 3, padding_mode="zeros", bias=False, dtype=DT)
    circ = OrthoConv2d(3, 5, 3, padding_mode="circular", bias=False, dtype=DT)
    circ.load_state_dict(zeros.state_dict())
    x = torch.randn(1, 3, 8, 8, dtype=DT)
    for _ in range(200):  # power iteration on convᵀconv
        x = x.requires_grad_(True)
        y = zeros(x)
        (g,) = torch.autograd.grad(y, x, y)
        x = (g / g.norm()).detach()
    norm = float(zeros(x).detach().norm())
    assert 0.5 < norm <= 1 + 1e-12
    inner = torch.zeros(4, 3, 10, 10, dtype=DT)
    inner[..., 2:-2, 2:-2] = torch.randn(4, 3, 6, 6, dtype=DT)  # d(k − 1) = 2 from the border
    with torch.no_grad():
        out, ref = zeros(inner), circ(inner)
    assert torch.allclose(out, ref, atol=1e-13)
    assert torch.allclose(out.flatten(1).norm(dim=1), inner.flatten(1).norm(dim=1), rtol=1e-13)


def test_assembly_matches_orthogonium_with_our_factors():
    bcop = pytest.importorskip("orthogonium.layers.conv.AOC.fast_block_ortho_conv")
    torch.manual_seed(0)
    layer = OrthoConv2d(6, 6, 3, bias=False, dtype=DT)
    h = layer.kernel.isometry.detach()  # (1, 6, 6)
    v = layer.kernel.projectors.detach()  # (1, 4, 6, 3)
    p = v @ v.mT
    # orthogonium: c11, then 2×2 blocks of (vertical projector, horizontal projector), composed
    res = h[0].reshape(6, 6, 1, 1)
    for j in range(2):
        block = bcop.block_orth(p[:, None, 2 * j + 1], p[:, None, 2 * j])[0]
        res = bcop.fast_matrix_conv(res, block)
    assert torch.allclose(layer.weight, res, atol=1e-13)
    # our full-convolution composition against theirs, grouped
    a, b = torch.randn(2, 4, 3, 2, 2, dtype=DT), torch.randn(2, 5, 4, 3, 3, dtype=DT)
    theirs = bcop.fast_matrix_conv(a.reshape(8, 3, 2, 2), b.reshape(10, 4, 3, 3), groups=2)
    assert torch.allclose(compose_kernels(a, b).reshape(10, 3, 4, 4), theirs, atol=1e-12)


def test_projector_step_is_the_two_tap_composition():
    torch.manual_seed(0)
    k = torch.randn(1, 4, 3, 2, 2, dtype=DT)
    v = torch.linalg.qr(torch.randn(1, 4, 2, dtype=DT))[0]
    p = (v @ v.mT)[0]
    two_tap = torch.stack([p, torch.eye(4, dtype=DT) - p], -1)[None, ..., None, :]  # 1×2
    assert torch.allclose(projector_step(k, v, -1), compose_kernels(k, two_tap), atol=1e-13)
    assert torch.allclose(
        projector_step(k, v, -2), compose_kernels(k, two_tap.transpose(-1, -2)), atol=1e-13
    )


@pytest.mark.parametrize("method", ["householder", "tcwy", "exp", "cayley", "riemannian"])
def test_every_map_serves_the_factors(method):
    torch.manual_seed(0)
    layer = OrthoConv2d(4, 6, 3, bias=False, method=method, dtype=DT)
    sv = fft_singular_values(layer, 4, 6)
    assert (sv - 1).abs().max() <= _tol(DT)


def test_gradients_match_finite_differences():
    torch.manual_seed(0)
    layer = OrthoConv2d(2, 3, 2, stride=1, dtype=DT)
    x = torch.randn(1, 2, 4, 4, dtype=DT, requires_grad=True)
    params = [layer.kernel.parametrizations.isometry.original]
    params.append(layer.kernel.parametrizations.projectors.original)

    assert torch.autograd.gradcheck(layer, (x,), eps=1e-6, atol=1e-8)  # input gradients
    y = layer(x).square().sum()
    grads = torch.autograd.grad(y, params)
    for p, g in zip(params, grads, strict=True):
        d = torch.randn_like(p)
        with torch.no_grad():
            base = p.clone()
            p.copy_(base + 1e-6 * d)
            up = float(layer(x).square().sum())
            p.copy_(base - 1e-6 * d)
            down = float(layer(x).square().sum())
            p.copy_(base)
        assert abs((up - down) / 2e-6 - float((g * d).sum())) < 1e-6 * max(1.0, abs(up))


def test_low_precision_kernel_is_orthogonal_to_its_precision():
    torch.manual_seed(0)
    layer = OrthoConv2d(4, 4, 3, dtype=DT).to(torch.bfloat16)
    x = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    layer.bias = None
    sv = fft_singular_values(layer, 4, 8)
    assert (sv - 1).abs().max() < 3e-2


def test_meta_init_then_reset_parameters_gives_an_orthogonal_layer():
    with torch.device("meta"):
        layer = OrthoConv2d(4, 6, 3, stride=2, dtype=DT)
    layer.to_empty(device="cpu")
    layer.reset_parameters(generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer.bias, torch.zeros(6, dtype=DT))
    layer.bias = None
    sv = dense_singular_values(layer, (4, 8, 8))
    assert (sv - 1).abs().max() <= _tol(DT)


def test_state_dict_round_trip():
    torch.manual_seed(0)
    a = OrthoConv2d(4, 6, 3, dtype=DT)
    _train(a, (4, 6, 6), steps=3)
    b = OrthoConv2d(4, 6, 3, dtype=DT)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    assert torch.equal(a(x), b(x))


def test_kernel_is_cached_without_gradients_until_a_factor_changes():
    torch.manual_seed(0)
    layer = OrthoConv2d(4, 4, 3)
    with torch.no_grad():
        w1, w2 = layer.weight, layer.weight
    assert w1 is w2
    assert layer.weight is not w1 and layer.weight.requires_grad  # with gradients: afresh
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.randn(1, 4, 5, 5)).sum().backward()
    opt.step()
    with torch.no_grad():
        w3 = layer.weight
    assert w3 is not w1 and not torch.equal(w3, w1)
    with parametrize.cached():
        a = layer.kernel.isometry
        assert layer.kernel.isometry is a


def _raises(match, **kw):
    args = dict(in_channels=4, out_channels=4, kernel_size=3)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        OrthoConv2d(**args)
    # the transposed layer is the adjoint of the convolution out → in
    args["in_channels"], args["out_channels"] = args["out_channels"], args["in_channels"]
    match = match.replace("in_", "@").replace("out_", "in_").replace("@", "out_")
    with pytest.raises(ValueError, match=match):
        OrthoConvTranspose2d(**args)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(stride=0), "stride=0 is not allowed; allowed: an int >= 1"),
        (dict(dilation=0), "dilation=0 is not allowed; allowed"),
        (dict(kernel_size=0), "kernel_size=0 is not allowed; allowed"),
        (dict(groups=3), "groups=3 does not divide both channel counts"),
        (dict(padding_mode="reflect"), "padding_mode='reflect'; allowed: circular, zeros"),
        (dict(padding="full"), "padding='full'; allowed"),
        (dict(stride=2, dilation=2), "dilation=2 with stride=2"),
        (
            dict(in_channels=1, out_channels=8, kernel_size=1, stride=2),
            "needs out_channels/groups ≤ in_channels/groups·k² = 1; got in_channels=1",
        ),
        (dict(in_channels=1, out_channels=1), "needs at least 2 channels per group"),
        (dict(init="nearest"), "init='nearest'; allowed: haar, identity, random"),
        (dict(method="nope"), "nope"),
    ],
    ids=str,
)
def test_bad_arguments_are_refused_at_construction(kw, match):
    _raises(match, **kw)


def test_bad_dtype_and_options_are_type_errors():
    with pytest.raises(TypeError, match="complex64"):
        OrthoConv2d(4, 4, 3, dtype=torch.complex64)
    with pytest.raises(TypeError, match="unknown option"):
        OrthoConv2d(4, 4, 3, colour="blue")


def test_riemannian_factors_stay_exact_under_a_riemannian_optimizer():
    from stiefel import optimizers

    torch.manual_seed(0)
    layer = OrthoConv2d(4, 6, 3, stride=1, bias=False, method="riemannian", dtype=DT)
    opt = optimizers.create("rgd", layer.parameters(), lr=0.1)
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    target = torch.randn(2, 6, 6, 6, dtype=DT)
    before = layer.weight.detach().clone()
    for _ in range(10):
        opt.zero_grad()
        (layer(x) - target).square().sum().backward()  # ‖y‖ = ‖x‖: fit a target instead
        opt.step()
    assert not torch.allclose(layer.weight, before)
    assert (fft_singular_values(layer, 4, 6) - 1).abs().max() <= _tol(DT)


@pytest.mark.parametrize("padding", [2, (1, 2), (2, 0)], ids=str)
@pytest.mark.parametrize("cls", [OrthoConv2d, OrthoConvTranspose2d])
def test_circular_padding_longer_than_same_is_refused(cls, padding):
    """A circular padding with 2p > d(k − 1) wraps around: expansive, refused as conv_kernel's.

    The reference is the dense float64 operator: built with zero padding and the
    wrapped input by hand (what the layer computed before the refusal), its
    largest singular value is well above 1; a padding up to "same" stays ≤ 1.
    """
    torch.manual_seed(0)
    conv = OrthoConv2d(4, 4, 3, padding="valid", padding_mode="zeros", bias=False, dtype=DT)
    p = (padding, padding) if isinstance(padding, int) else padding

    def wrapped(x):  # the old layer: circular pad by p, then the kernel without padding
        return conv(F.pad(x, (p[1], p[1], p[0], p[0]), mode="circular"))

    assert dense_singular_values(wrapped, (4, 5, 5), DT).max() > 1.2
    with pytest.raises(ValueError, match=rf"^{cls.__name__} with padding_mode='circular' and "):
        cls(4, 4, 3, padding=padding)
    with pytest.raises(ValueError, match=r"2·padding ≤ dilation·\(kernel_size − 1\)"):
        cls(4, 4, 3, padding=padding, dilation=1)
    cls(4, 4, 3, padding=padding, dilation=4)  # 2p ≤ d(k − 1): allowed
    cls(4, 4, 3, padding=padding, padding_mode="zeros")  # zeros: any padding


@pytest.mark.parametrize("padding", [1, (0, 1), (1, 0)], ids=str)
def test_circular_padding_up_to_same_is_non_expansive(padding):
    """Allowed circular paddings (2p ≤ d(k − 1)): σ_max ≤ 1 by the dense float64 operator."""
    torch.manual_seed(0)
    for cls in (OrthoConv2d, OrthoConvTranspose2d):
        layer = cls(4, 4, 3, padding=padding, bias=False, dtype=DT)
        assert dense_singular_values(layer, (4, 7, 7)).max() <= 1 + _tol(DT)


def test_strided_circular_padding_other_than_same_is_refused():
    """With a stride, a circular int/pair padding wraps a torus the stride does not tile.

    Reference: the dense float64 operator of what the transposed layer computed
    before (the adjoint of the zero-padded strided convolution, its output
    wrapped back circularly): σ_max 1.49.
    """
    torch.manual_seed(0)
    conv = OrthoConv2d(4, 4, 3, stride=2, padding="valid", padding_mode="zeros", dtype=DT)
    conv.bias = None

    def old(x):  # F.conv_transpose2d, then the adjoint of a circular padding by 1
        y = F.conv_transpose2d(x, conv.weight, stride=2)
        return _adjoint_pad(y, (1,) * 4, "circular")

    assert dense_singular_values(old, (4, 4, 4), DT).max() > 1.4
    for cls in (OrthoConv2d, OrthoConvTranspose2d):
        with pytest.raises(ValueError, match=r"padding=1 and stride=2: .* allowed with a stride"):
            cls(4, 4, 3, stride=2, padding=1)
        cls(4, 4, 3, stride=2, padding=1, padding_mode="zeros")
        cls(4, 4, 3, stride=2, padding="valid")


# (in, out, k, stride, dilation, n, refused): the strided blocks wrap onto each other on an
# n×n image the stride does not divide (n = 7, 9, 10), or they do not (n = 8 for s = 3, d = 2),
# or s divides n
STRIDED_DILATED = [
    (2, 8, 2, 2, 3, 7, True),
    (2, 8, 3, 2, 3, 7, True),
    (4, 4, 3, 2, 3, 9, True),
    (4, 4, 3, 3, 2, 10, True),
    (4, 4, 3, 3, 2, 8, False),
    (4, 4, 3, 2, 3, 8, False),
    (4, 4, 3, 3, 2, 9, False),
]


def test_strided_dilated_circular_layer_is_non_expansive_or_refused():
    """Stride > 1, dilation > 1, circular "same": σ ≤ 1 on every image the layer accepts.

    Reference: the dense float64 operator of one circular ``F.conv2d`` with the
    layer's kernel (what the layer computed before the refusal): σ_max up to 2
    where the stride's blocks wrap around onto positions they already read.
    """
    for ci, co, k, s, d, n, refused in STRIDED_DILATED:
        torch.manual_seed(0)
        conv = OrthoConv2d(ci, co, k, stride=s, dilation=d, bias=False, dtype=DT)
        tol = 10 * ci * n * n * torch.finfo(DT).eps

        def circular(x, conv=conv, s=s, d=d):
            return F.conv2d(F.pad(x, conv.pads, mode="circular"), conv.weight, None, s, 0, d)

        ref = dense_singular_values(circular, (ci, n, n), DT)
        cfg = (ci, co, k, s, d, n)
        if refused:
            assert ref.max() > 1.2, cfg
            match = rf"stride={s}, dilation={d} and circular padding='same' on a {n}×{n} image"
            with pytest.raises(ValueError, match=match):
                conv(torch.zeros(1, ci, n, n, dtype=DT))
            m = n - n % s  # a size the stride divides: served
            assert conv(torch.zeros(1, ci, m, m, dtype=DT)).shape == (1, co, m // s, m // s)
        else:
            sv = dense_singular_values(conv, (ci, n, n))
            assert torch.allclose(sv, ref, atol=tol), cfg
            assert sv.max() <= 1 + tol, cfg
            if n % s == 0:
                assert (sv - 1).abs().max() <= tol, cfg
        # the transposed layer maps n to n·s, which the stride divides: orthogonal
        up = OrthoConvTranspose2d(co, ci, k, stride=s, dilation=d, bias=False, dtype=DT)
        sv = dense_singular_values(up, (co, n, n))
        assert (sv - 1).abs().max() <= 10 * co * n * n * torch.finfo(DT).eps, cfg
    # zero padding and padding="valid" never wrap: the refused sizes are allowed there
    for kw in (dict(padding_mode="zeros"), dict(padding="valid")):
        conv = OrthoConv2d(4, 4, 3, stride=2, dilation=3, bias=False, dtype=DT, **kw)
        assert dense_singular_values(conv, (4, 7, 7)).max() <= 1 + 10 * 196 * torch.finfo(DT).eps


@pytest.mark.parametrize("cls", [OrthoConv2d, OrthoConvTranspose2d])
def test_integer_and_bool_inputs_are_refused_and_complex_ones_served(cls):
    """An integer input would meet a kernel cast to integers (zeros): a TypeError instead."""
    torch.manual_seed(0)
    layer = cls(4, 4, 3, dtype=DT)
    for dtype in (torch.uint8, torch.int64, torch.bool):
        x = torch.randint(0, 2 if dtype == torch.bool else 256, (1, 4, 6, 6)).to(dtype)
        with pytest.raises(TypeError, match=rf"got an input of dtype {dtype}; allowed: .*float32"):
            layer(x)
    z = torch.randn(2, 4, 6, 6, dtype=torch.complex128)  # the real kernel on both parts
    with torch.no_grad():
        y, re, im = layer(z), layer(z.real), layer(z.imag)
    bias = layer.bias[:, None, None]
    assert torch.allclose(y, torch.complex(re, im - bias), atol=1e-12)
    assert torch.allclose((y - bias).norm(), z.norm(), rtol=1e-12)


@pytest.mark.parametrize("cls", [OrthoConv2d, OrthoConvTranspose2d])
@pytest.mark.parametrize(
    "edit",
    [
        lambda p, d: p.data.add_(d),  # an EMA or a hand-written optimizer
        lambda p, d: p.data.copy_(p.data + d),
    ],
    ids=["data.add_", "data.copy_"],
)
def test_cache_sees_in_place_writes_through_data(cls, edit):
    # ``p.data`` has a version counter of its own: the layer's output in evaluation must
    # follow such a write all the same. The reference is the layer computed afresh.
    torch.manual_seed(0)
    layer = cls(4, 4, 3, dtype=DT).eval()
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    with torch.no_grad():
        before = layer(x)
        for p in layer.parameters():
            edit(p, 0.5 * torch.randn_like(p))
        after = layer(x)
    fresh = layer(x).detach()  # with gradients: assembled afresh, no cache
    assert float((before - fresh).abs().max()) > 1e-2
    tol = 100 * torch.finfo(DT).eps * float(fresh.abs().max())
    assert float((after - fresh).abs().max()) <= tol
    with torch.no_grad():  # cached again while nothing changes
        assert layer.weight is layer.weight


def test_cache_sees_data_assignment():
    """``param.data = …`` (vector_to_parameters) swaps memory and keeps ``_version``.

    The reference is the same layer computed afresh (with gradients: no cache).
    The old cache, keyed on identity and version, returned the previous kernel
    (off by 25 here).
    """
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    torch.manual_seed(0)
    layer = OrthoConv2d(4, 4, 3, dtype=DT)
    other = OrthoConv2d(4, 4, 3, dtype=DT)
    other.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    with torch.no_grad():
        before = layer(x)
        vector_to_parameters(parameters_to_vector(other.parameters()), layer.parameters())
        after = layer(x)
    fresh = layer(x)  # with gradients: assembled afresh
    assert not torch.allclose(before, fresh)
    assert torch.allclose(
        after, fresh, rtol=0, atol=100 * torch.finfo(DT).eps * float(fresh.detach().abs().max())
    )
    assert torch.allclose(fresh, other(x))
    with torch.no_grad():  # cached again while nothing changes
        assert layer.weight is layer.weight


@pytest.mark.parametrize("method", ["cwy", "riemannian"])
@pytest.mark.parametrize(("channels", "k", "groups"), [(4, 3, 1), (6, 5, 1), (8, 3, 2)])
@pytest.mark.parametrize("padding_mode", ["circular", "zeros"])
def test_identity_init_is_the_identity_convolution_for_odd_k(
    method, channels, k, groups, padding_mode
):
    # every factor at its identity point shifted half the channels by k − 1 against the
    # other half (max |conv(x) − x| = 4 at k = 3); the projector steps now alternate
    # (Note [The identity convolution from projector steps]); reference: x itself
    x = torch.randn(2, channels, 7, 7, dtype=torch.float64)
    conv = OrthoConv2d(channels, channels, k, groups=groups, padding_mode=padding_mode,
                       bias=False, method=method, init="identity", dtype=torch.float64)  # fmt: skip
    assert torch.allclose(conv(x), x, atol=1e-12)
    weight = conv.weight.detach()
    centre = weight[..., k // 2, k // 2]
    assert torch.allclose(weight.sum((-2, -1)), centre, atol=1e-12)  # all at the centre tap
    initialize(conv.kernel, init="haar")  # another point of every factor
    assert not torch.allclose(conv(x), x, atol=1e-3)
    conv.reset_parameters()  # back to the identity
    assert torch.allclose(conv(x), x, atol=1e-12)
    initialize(conv.kernel, init="haar")
    initialize(conv, init="identity")  # the layer's identity, not its factors' alone
    assert torch.allclose(conv(x), x, atol=1e-12)
    model = nn.Sequential(conv, nn.ReLU())
    initialize(model, init="haar")
    initialize(model, init="identity")
    assert torch.allclose(conv(x), x, atol=1e-12)
    initialize(model, init="haar")
    for module in model.modules():  # torch's recipe: the kernel's own reset comes last
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.allclose(conv(x), x, atol=1e-12)


def test_identity_init_keeps_factors_at_identity_where_no_centre_exists():
    # even k: no rank-⌊c/2⌋ steps delay every channel equally; the layer stays orthogonal
    conv = OrthoConv2d(4, 4, 2, init="identity", bias=False, dtype=torch.float64)
    x = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    assert torch.allclose(conv(x).norm(), x.norm(), rtol=1e-12)


def test_identity_init_builds_on_meta_and_is_the_identity_after_reset():
    # its projectors were written through the map's right inverse on meta (no kernel there)
    with torch.device("meta"):
        conv = OrthoConv2d(4, 4, 3, init="identity", bias=False, dtype=torch.float64)
    conv.to_empty(device="cpu")
    conv.reset_parameters()
    x = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    assert torch.allclose(conv(x), x, atol=1e-12)
    with torch.device("meta"):
        conv = OrthoConv2d(4, 4, 3, init="identity", bias=False, dtype=torch.float64)
    conv.to_empty(device="cpu")
    for module in conv.modules():  # torch's recipe
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.allclose(conv(x), x, atol=1e-12)
