"""ConvNERUCell (no explosion over T = 1000) and OrthogonalConv2d (exactly orthogonal)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from stiefel.nn import ConvNERUCell, OrthogonalConv2d
from stiefel.parametrizations import kernels

DT = torch.float64


# --------------------------------------------------------------------------- ConvNERU
def _rollout(cell, g, xs):
    norms = []
    with torch.no_grad(), parametrize.cached():
        for x in xs:
            g = cell(x, g)
            norms.append(float(g.norm()))
    return g, norms


def _op_norm(conv, shape, iters=200):
    """‖conv‖₂ by power iteration on convᵀconv (an independent estimate)."""
    x = torch.randn(shape, dtype=DT)
    for _ in range(iters):
        x = x.requires_grad_(True)
        y = conv(x)
        (g,) = torch.autograd.grad(y, x, y)
        x = (g / g.norm()).detach()
    return float(conv(x).detach().norm())


@pytest.mark.parametrize("method", ["tcwy", "riemannian"])
def test_convneru_hidden_states_do_not_explode_over_1000_steps(method):
    torch.manual_seed(0)
    cell = ConvNERUCell(1, 3, 3, method=method, dtype=DT)
    with torch.no_grad():
        cell.bias.uniform_(-0.5, 0.5)
    T, bound = 1000, 1.0
    xs = torch.randn(T, 2, 1, 4, 4, dtype=DT)
    xs = xs * (bound / xs.flatten(1).norm(dim=1)).view(T, 1, 1, 1, 1)  # ‖X_t‖ = 1
    g0 = 10 * torch.randn(2, 3, 4, 4, dtype=DT)
    lin = _op_norm(cell.input, (2, 1, 4, 4))
    b = float(cell.bias.detach().norm()) * 4  # ‖B‖_F over a 4×4 image
    _, norms = _rollout(cell, g0, xs)
    # appendix C: ‖G_t‖ ≤ ‖G_{t−1}‖ + ‖B‖ + ‖K_in‖·‖X_t‖, no exponential growth
    for t, nt in enumerate(norms, 1):
        assert nt <= float(g0.norm()) + t * (b + lin * bound) * 1.01 + 1e-9
    # non-expansive in G: two trajectories driven by the same inputs never move apart
    with torch.no_grad(), parametrize.cached():
        g, h = g0, torch.zeros_like(g0)
        prev = scale = float((g - h).norm())
        for x in xs[:200]:
            g, h = cell(x, g), cell(x, h)
            d = float((g - h).norm())
            assert d <= prev + 1e-12 * scale
            prev = d
    # gradients through time stay bounded: ‖∂⟨c, G_T⟩/∂G_0‖ ≤ ‖c‖
    g0 = g0.requires_grad_(True)
    with parametrize.cached():
        g = g0
        for x in xs[:100]:
            g = cell(x, g)
        c = torch.randn_like(g)
        (grad,) = torch.autograd.grad((g * c).sum(), g0)
    assert float(grad.norm()) <= float(c.norm()) * (1 + 1e-12)


def test_unconstrained_convneru_can_explode():
    """An unconstrained K scaled up explodes in the same rollout (the test above can fail)."""
    torch.manual_seed(0)
    cell = ConvNERUCell(1, 3, 3, method=None, nonlinearity="identity", dtype=DT)
    with torch.no_grad():
        cell.recurrent.weight.mul_(4)
    xs = torch.zeros(100, 1, 1, 4, 4, dtype=DT)
    _, norms = _rollout(cell, torch.randn(1, 3, 4, 4, dtype=DT), xs)
    assert norms[-1] > 1e6 * norms[0]


def test_convneru_matches_the_formula_and_trains():
    torch.manual_seed(1)
    cell = ConvNERUCell(2, 3, 3, method="cwy", nonlinearity="tanh", dtype=DT)
    x, g = torch.randn(2, 2, 5, 5, dtype=DT), torch.randn(2, 3, 5, 5, dtype=DT)
    k, kin = cell.recurrent.weight, cell.input.weight
    drive = F.conv2d(g, k, padding=1) + cell.bias[:, None, None] + F.conv2d(x, kin, padding=1)
    ref = torch.tanh(drive)
    assert torch.allclose(cell(x, g), ref, atol=1e-12)
    cell(x, g).sum().backward()
    assert cell.recurrent.parametrizations.weight.original.grad is not None


def test_convneru_bad_input():
    with pytest.raises(ValueError, match="kernel_size=4 is even; allowed: a positive odd int"):
        ConvNERUCell(1, 2, 4)
    with pytest.raises(
        ValueError, match="nonlinearity='gelu' is not supported; allowed: relu, tanh"
    ):
        ConvNERUCell(1, 2, 3, nonlinearity="gelu")
    with pytest.raises(ValueError, match="'nope'"):
        ConvNERUCell(1, 2, 3, method="nope")


@pytest.mark.parametrize("method", ["tcwy", None])
def test_convneru_built_on_meta_takes_the_torch_recipe(method):
    # FSDP2's recipe: build on meta, to_empty, reset_parameters() on every module. The cell
    # had no reset of its own: its bias kept what to_empty left (NaN here, as a stand-in
    # for uninitialised memory), and the unconstrained K got nn.Conv2d's Kaiming init
    with torch.device("meta"):
        cell = ConvNERUCell(1, 3, 3, method=method, dtype=DT)
    cell.to_empty(device="cpu")
    with torch.no_grad():
        for p in cell.parameters():
            p.fill_(float("nan"))
    for module in cell.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.equal(cell.bias, torch.zeros(3, dtype=DT))  # a fresh build's bias
    x, g = torch.randn(2, 1, 5, 5, dtype=DT), torch.randn(2, 3, 5, 5, dtype=DT)
    assert torch.isfinite(cell(x, g)).all()
    if method is None:  # Glorot-uniform as built: U(−a, a), a = √(6/(fan_in + fan_out))
        w = cell.recurrent.weight.detach()
        a = (6 / (2 * 3 * 3 * 3)) ** 0.5
        assert float(w.abs().max()) <= a and float(w.abs().max()) > 0.75 * a


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: ConvNERUCell(1, 0, 3), ValueError, "hidden_channels=0 .*allowed: an int >= 1"),
        (lambda: ConvNERUCell(1, -1, 3), ValueError, "hidden_channels=-1 .*allowed: an int"),
        (lambda: ConvNERUCell(1, 4.5, 3), ValueError, "hidden_channels=4.5 .*allowed: an int"),
        (lambda: ConvNERUCell(0, 4, 3), ValueError, "in_channels=0 .*allowed: an int >= 1"),
        (lambda: ConvNERUCell(1, 4, 3, nonlinearity=["relu"]), TypeError, "nonlinearity="),
        (
            lambda: ConvNERUCell(1, 4, 3, dtype=torch.complex64),
            TypeError,
            "dtype=torch.complex64; allowed: torch.float32",
        ),
        (
            lambda: ConvNERUCell(1, 4, 3, method=None, dtype=torch.int64),
            TypeError,
            "dtype=torch.int64; allowed: torch.float32",
        ),
        (lambda: OrthogonalConv2d(4, 3, stride=1.0), ValueError, "stride=1.0; allowed: 1"),
        (lambda: OrthogonalConv2d(4, 3, bias="no"), TypeError, "bias='no' .*allowed: True"),
    ],
)
def test_conv_layers_refuse_bad_arguments_naming_them(build, error, message):
    # each built a layer (an empty one, one with float channels, a bias from "no") or
    # failed inside torch naming no argument
    with pytest.raises(error, match=message):
        build()


# --------------------------------------------------------------------------- OrthogonalConv2d
def _dense(layer, c, h, w):
    """The layer's matrix, built by applying it to the basis of (c, h, w) images."""
    basis = torch.eye(c * h * w, dtype=layer.weight.dtype, device=layer.weight.device)
    basis = basis.reshape(-1, c, h, w)
    return layer(basis).reshape(c * h * w, -1).T


@pytest.mark.parametrize("method", ["cayley", "exp", "cwy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fft_conv_is_orthogonal(method, dtype, device):
    torch.manual_seed(0)
    layer = OrthogonalConv2d(3, 3, method=method, dtype=dtype, device=device)
    eps = torch.finfo(dtype).eps
    x = torch.randn(5, 3, 6, 7, dtype=dtype)  # odd width: the half spectrum has no Nyquist
    y = layer(x.to(device))
    assert y.dtype == dtype and y.shape == x.shape and y.device.type == device
    y, x = y.detach().cpu().double(), x.double()  # norms in float64 on the CPU
    rel = (y.flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1) - 1).abs().max()
    assert float(rel) < 200 * eps
    for h, w in [(4, 4), (3, 5)]:
        m = _dense(layer, 3, h, w).detach().cpu().double()
        eye = torch.eye(m.shape[0], dtype=torch.float64)
        assert float((m.T @ m - eye).abs().max()) < 200 * eps
        assert float((m @ m.T - eye).abs().max()) < 200 * eps


def test_fft_cayley_equals_the_cayley_transform_of_the_skew_convolution():
    """Dense reference: C = circular conv by P (a (c·h·w)² matrix), A = C − Cᵀ, Q = (I+A)⁻¹(I−A)."""
    torch.manual_seed(2)
    c, h, w, k = 2, 5, 4, 3
    layer = OrthogonalConv2d(c, k, dtype=DT)

    def conv(x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), layer.weight)

    n = c * h * w
    basis = torch.eye(n, dtype=DT).reshape(n, c, h, w)
    cmat = conv(basis).reshape(n, n).T
    a = cmat - cmat.T
    eye = torch.eye(n, dtype=DT)
    q = torch.linalg.solve(eye + a, eye - a)
    assert torch.allclose(_dense(layer, c, h, w), q, atol=1e-12)
    # the spatial support of A is k×k: A x is the skew convolution (C − Cᵀ) x
    pf = layer.transfer((h, w))
    x = torch.randn(1, c, h, w, dtype=DT)
    xf = torch.fft.rfft2(x).permute(2, 3, 1, 0).reshape(-1, c, 1)
    af = ((pf - pf.mH) @ xf).reshape(h, w // 2 + 1, c, 1).permute(3, 2, 0, 1)
    ax = torch.fft.irfft2(af, s=(h, w))
    assert torch.allclose(ax.reshape(-1), a @ x.reshape(-1), atol=1e-12)


@pytest.mark.parametrize("method", ["cayley", "cwy"])
def test_fft_conv_gradients_match_finite_differences(method):
    torch.manual_seed(3)
    layer = OrthogonalConv2d(2, 3, method=method, bias=True, dtype=DT)
    x = torch.randn(2, 2, 4, 3, dtype=DT, requires_grad=True)

    def f(x, weight, bias):
        return torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x,))

    assert torch.autograd.gradcheck(f, (x, layer.weight, layer.bias))


def test_fft_conv_bad_input():
    with pytest.raises(ValueError, match="stride=2; allowed: 1"):
        OrthogonalConv2d(3, 3, stride=2)
    with pytest.raises(
        ValueError, match="method='householder' is not .*; allowed: cayley, exp, cwy"
    ):
        OrthogonalConv2d(3, 3, method="householder")
    with pytest.raises(TypeError, match="unknown option.*reflections.*allowed: dtype, device"):
        OrthogonalConv2d(3, 3, reflections=2)
    with pytest.raises(
        ValueError,
        match="reflections=5 is out of range; allowed: an int with 1 <= reflections <= 3",
    ):
        OrthogonalConv2d(3, 3, method="cwy", reflections=5)
    with pytest.raises(ValueError, match="reflections=0 is out of range"):
        OrthogonalConv2d(3, 3, method="cwy", reflections=0)  # built with reflections=3 before
    layer = OrthogonalConv2d(2, 5)
    with pytest.raises(ValueError, match="kernel_size=5 is larger than the input .4×6.*≤ min"):
        layer(torch.randn(1, 2, 4, 6))
    with pytest.raises(ValueError, match=r"x must have shape \(batch, 2, h, w\)"):
        layer(torch.randn(1, 3, 8, 8))


@pytest.mark.parametrize("k, h, w", [(3, 5, 4), (2, 4, 7), (4, 6, 6)])
def test_fft_transfer_by_direct_dft_equals_the_fft_of_the_padded_kernel(k, h, w):
    torch.manual_seed(4)
    layer = OrthogonalConv2d(3, k, dtype=DT)
    p = (k - 1) // 2
    g = F.pad(layer.weight, (0, w - k, 0, h - k)).roll((-p, -p), (-2, -1))
    ref = torch.fft.rfft2(g).conj().permute(2, 3, 0, 1).reshape(h * (w // 2 + 1), 3, 3)
    pf = layer.transfer((h, w))
    assert torch.allclose(pf, ref, atol=1e-13)
    assert torch.allclose(layer.skew_transfer((h, w)), ref - ref.mH, atol=1e-13)


def test_cayley_map_without_base_and_in_operator_form():
    torch.manual_seed(5)
    raw = torch.randn(7, 5, 5, dtype=torch.complex128)
    a = raw - raw.mH
    eye = torch.eye(5, dtype=a.dtype)
    ref = torch.linalg.solve(eye + a, eye - a)
    x = torch.randn(7, 5, 3, dtype=a.dtype)
    for spectral in (None, False, True):
        assert torch.allclose(kernels.cayley_map(a, spectral=spectral), ref, atol=1e-13)
        assert torch.allclose(kernels.cayley_map(a, x, spectral=spectral), ref @ x, atol=1e-13)
        # a 2-D B broadcasts over the batch of A (it is not a batch of vectors)
        assert torch.allclose(kernels.cayley_map(a, eye, spectral=spectral), ref, atol=1e-13)


def test_fft_cayley_path_is_chosen_once_per_weight_version():
    torch.manual_seed(6)
    layer = OrthogonalConv2d(4, 3, dtype=DT)
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    layer(x)
    path = layer._path
    assert path[2] is False
    layer(x)
    assert layer._path is path  # same version: no new bound, no host read
    # the bound holds: max over ω of ‖A(ω)‖₁ ≤ the tap bound
    a = layer.skew_transfer((6, 6))
    taps = layer.weight.detach().abs().sum((-2, -1))
    bound = float((taps + taps.T).sum(0).max())
    assert float(torch.linalg.matrix_norm(a, ord=1).max()) <= bound * (1 + 1e-12)
    with torch.no_grad():  # in place: a new version, a large kernel: the eigh path
        layer.weight.mul_(1e3)
    y = layer(x)
    assert layer._path is not path and layer._path[2] is None
    assert float((y.flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1) - 1).abs().max()) < 1e-12


def test_fft_cayley_path_follows_a_data_assignment():
    # ``weight.data = …`` keeps the version counter: the address tells the new values
    torch.manual_seed(6)
    layer = OrthogonalConv2d(4, 3, dtype=DT)
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    layer(x)
    assert layer._path[2] is False
    layer.weight.data = 1e3 * layer.weight.detach()
    y = layer(x)
    assert layer._path[2] is None  # the large kernel's path, chosen again
    assert float((y.flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1) - 1).abs().max()) < 1e-12


@pytest.mark.parametrize("method", ["cayley", "exp", "cwy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fft_conv_in_half_precision_is_the_float64_layer_rounded(method, dtype):
    # torch.fft has no half precision on the CPU: the layer transforms in float32 and
    # rounds its output once; the reference is the float64 layer with the same weights
    torch.manual_seed(2)
    ref = OrthogonalConv2d(6, 3, method=method, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_((ref.weight + 0.3 * torch.randn_like(ref.weight)).to(dtype))
    layer = OrthogonalConv2d(6, 3, method=method, dtype=dtype)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 8, 7, dtype=dtype)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == dtype and layer.weight.grad.dtype == dtype
    expected = ref(x.to(DT)).detach()
    tol = 4 * torch.finfo(dtype).eps * float(expected.abs().max())
    assert float((y.detach().to(DT) - expected).abs().max()) <= tol


@pytest.mark.parametrize("method", ["cayley", "cwy"])
def test_fft_conv_built_on_meta_takes_the_torch_recipe(method):
    # FSDP2's recipe: build on meta, to_empty, reset_parameters() on every module that has it
    with torch.device("meta"):
        layer = OrthogonalConv2d(4, 3, method=method, bias=True, dtype=DT)
    layer.to_empty(device="cpu")
    torch.manual_seed(3)
    layer.reset_parameters()
    torch.manual_seed(3)
    eager = OrthogonalConv2d(4, 3, method=method, bias=True, dtype=DT)
    assert torch.equal(layer.weight, eager.weight) and torch.equal(layer.bias, eager.bias)
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    assert torch.equal(layer(x), eager(x))


def test_fft_conv_refuses_a_q_for_another_image_size():
    # Q(ω) of a 4×10 image has 24 frequencies, as a 6×6 one's: it gave a wrong output
    # silently; a 6×5 one's (18) failed in a matmul naming neither size
    torch.manual_seed(7)
    layer = OrthogonalConv2d(2, 3, method="exp", dtype=DT)
    x = torch.randn(2, 2, 6, 6, dtype=DT)
    with torch.no_grad():
        q = layer.frequency_matrices((6, 6))
        assert q.image_size == (6, 6)
        assert torch.allclose(layer(x, q), layer(x), atol=1e-12)  # the q of x's size
        for size in [(4, 10), (6, 5)]:
            other = layer.frequency_matrices(size)
            with pytest.raises(ValueError, match=rf"q is for a {size[0]}×{size[1]} image and x"):
                layer(x, other)
        copy = q.clone()  # a copy has no record: refused, and accepted once given one
        with pytest.raises(ValueError, match=r"q has no image_size.*frequency_matrices\(\(6, 6"):
            layer(x, copy)
        copy.image_size = (6, 6)
        assert torch.equal(layer(x, copy), layer(x, q))
