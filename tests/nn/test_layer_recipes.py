"""The layers under the standard torch recipes: mixed dtypes, torch.func, bad sizes."""

import copy

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

from stiefel.nn import OrthogonalConv2d, OrthogonalRNN, OrthogonalRNNCell, singular_values

FFT_METHODS = ["cayley", "exp", "cwy"]


def _tol(dtype: torch.dtype, n: int) -> float:
    return 10 * n * torch.finfo(dtype).eps


# ------------------------------------------------------------ OrthogonalConv2d dtypes
@pytest.mark.parametrize("method", FFT_METHODS)
@pytest.mark.parametrize(
    ("layer_dtype", "x_dtype"),
    [
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float64),
    ],
)
def test_fft_conv_follows_the_input_dtype(method, layer_dtype, x_dtype):
    # the docstring's contract: y has x's dtype (bias included); the map is the layer's
    torch.manual_seed(0)
    conv = OrthogonalConv2d(4, 3, method=method, bias=True, dtype=layer_dtype)
    with torch.no_grad():
        conv.bias.uniform_(-1, 1)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64).to(x_dtype)
    with torch.no_grad():
        y = conv(x)
        # reference: the same (exactly representable) weights in float64, on the same input
        ref = copy.deepcopy(conv).double()(x.double())
    assert y.dtype == x_dtype and y.shape == x.shape
    worst = max(torch.finfo(layer_dtype).eps, torch.finfo(x_dtype).eps)
    err = float((y.double() - ref).norm() / ref.norm())
    assert err <= 10 * 4 * worst
    # still an isometry of the linear part, to the coarser of the two precisions
    lin = (y.double() - conv.bias.double()[:, None, None]).norm() / x.double().norm()
    assert abs(float(lin) - 1) <= 10 * 4 * worst


def test_fft_conv_refuses_dtypes_it_cannot_serve():
    for dtype in (torch.complex64, torch.int64):
        with pytest.raises(TypeError, match=rf"dtype={dtype}; allowed: torch.float32"):
            OrthogonalConv2d(4, 3, dtype=dtype)
    conv = OrthogonalConv2d(4, 3)
    x = torch.randn(2, 4, 6, 6, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"x has dtype torch.complex64; allowed: torch.float32"):
        conv(x)
    with pytest.raises(ValueError, match=r"stride=True; allowed: 1"):
        OrthogonalConv2d(4, 3, stride=True)


# ------------------------------------------------------------ OrthogonalConv2d vanishing columns
def test_fft_cwy_with_a_zero_kernel_is_the_identity_not_nan():
    # every column of P̂(ω) is 0: no reflection at any frequency (was 0/0: NaN everywhere)
    conv = OrthogonalConv2d(3, 3, method="cwy", dtype=torch.float64)
    with torch.no_grad():
        conv.weight.zero_()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    y = conv(x)
    assert float((y - x).abs().max()) <= _tol(torch.float64, 36) * float(x.abs().max())
    y.sum().backward()
    assert torch.isfinite(conv.weight.grad).all()


@pytest.mark.parametrize("method", FFT_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [(6, 6), (5, 8), (7, 5)])
def test_fft_conv_with_a_zero_sum_kernel_stays_orthogonal(method, dtype, size):
    # taps [[a, −a], [−a, a]]: P̂(ω) vanishes on the lines ω_h = 0 and ω_w = 0, where
    # each side of a conjugate pair rounded differently and the reflections of cwy
    # pointed elsewhere (‖y‖/‖x‖ = 0.98 in float32, 0.99 in float64, or NaN)
    torch.manual_seed(1)
    conv = OrthogonalConv2d(3, 2, method=method, dtype=dtype)
    with torch.no_grad():
        a = conv.weight[..., 1, 1].clone()
        conv.weight[..., 0, 0], conv.weight[..., 0, 1], conv.weight[..., 1, 0] = a, -a, -a
    shape = (3, *size)
    sv = singular_values(conv, shape, method="dense")
    assert float((sv - 1).abs().max()) <= _tol(dtype, 3 * size[0] * size[1] // 4)
    # the transfer matrices are conjugate-symmetric to rounding (the angles of a pair
    # are exact opposites), and exactly real where ω = −ω
    h, w = size
    t = OrthogonalConv2d(3, 3, dtype=dtype).transfer(size).detach().reshape(h, w // 2 + 1, 3, 3)
    scale = 4 * torch.finfo(dtype).eps * float(t.abs().max())
    for j in [0] + ([w // 2] if w % 2 == 0 else []):
        assert float((t[1:, j] - t[1:, j].flip(0).conj()).abs().max()) <= scale
        for i in [0] + ([h // 2] if h % 2 == 0 else []):
            assert torch.equal(t[i, j].imag, torch.zeros_like(t[i, j].imag))


# ------------------------------------------------------------ OrthogonalConv2d torch.func
@pytest.mark.parametrize("method", FFT_METHODS)
def test_fft_conv_gradient_under_torch_func_grad(method):
    torch.manual_seed(0)
    conv = OrthogonalConv2d(3, 3, method=method, bias=True, dtype=torch.float64)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    r = torch.randn(2, 3, 5, 5, dtype=torch.float64)  # ‖Qx‖² is constant: a linear loss

    def loss(params):
        return (functional_call(conv, params, (x,)) * r).sum()

    params = {k: v.detach() for k, v in conv.named_parameters()}
    got = grad(loss)(params)
    loss(dict(conv.named_parameters())).backward()
    for name, p in conv.named_parameters():
        scale = float(p.grad.norm())
        assert scale > 0
        assert float((got[name] - p.grad).norm()) <= _tol(torch.float64, 75) * scale


@pytest.mark.parametrize("method", FFT_METHODS)
def test_fft_conv_ensemble_under_vmap(method):
    # torch's model-ensembling recipe: stack_module_state + vmap over functional_call
    torch.manual_seed(0)
    models = [OrthogonalConv2d(3, 3, method=method, dtype=torch.float64) for _ in range(3)]
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def run(p, b):
        return functional_call(base, (p, b), (x,))

    y = vmap(run)(params, buffers)
    ref = torch.stack([m(x) for m in models]).detach()
    assert float((y - ref).abs().max()) <= _tol(torch.float64, 75) * float(ref.abs().max())


# ------------------------------------------------------------ recurrent sizes
@pytest.mark.parametrize(("n_in", "n_hidden", "name"), [(0, 8, "n_in"), (3, 0, "n_hidden")])
def test_rnn_refuses_non_positive_sizes_naming_them(n_in, n_hidden, name):
    value = n_in if name == "n_in" else n_hidden
    for make in (
        lambda: OrthogonalRNNCell(n_in, n_hidden),
        lambda: OrthogonalRNN(n_in, n_hidden, 2),
    ):
        with pytest.raises(ValueError, match=rf"{name}={value} is not allowed; allowed: an int"):
            make()


def test_fft_conv_repr_names_its_reflections_and_bias():
    from stiefel.nn import OrthogonalConv2d

    text = repr(OrthogonalConv2d(4, 3, method="cwy", reflections=2, bias=True))
    assert "reflections=2" in text and "bias=True" in text
    plain = repr(OrthogonalConv2d(4, 3))
    assert "reflections" not in plain and "bias=False" in plain
