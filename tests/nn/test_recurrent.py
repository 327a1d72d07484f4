"""stiefel.nn recurrent layers: modReLU and its guard, the complex (scuRNN) model, the cell."""

import math

import pytest
import torch
from torch.nn.utils import parametrize

from stiefel.comparisons.runner import RunConfig, run
from stiefel.comparisons.tasks.sequence import LSTMBaseline
from stiefel.nn import ModReLU, OrthogonalRNN, OrthogonalRNNCell
from stiefel.nn.recurrent import has_operator
from stiefel.parametrizations import available


def test_modrelu_real_and_complex_match_the_formula():
    torch.manual_seed(0)
    act = ModReLU(5)
    with torch.no_grad():
        act.bias.copy_(torch.tensor([-0.5, -0.1, 0.0, 0.2, 1.0], dtype=torch.float64))
    act = act.double()
    z = torch.randn(7, 5, dtype=torch.float64)
    # real: sign(z)·relu(|z| + b), up to the ε = 1e-5 in the denominator
    ref = torch.sign(z) * torch.relu(z.abs() + act.bias)
    assert torch.allclose(act(z), ref, atol=1e-4 * (1 + float(ref.abs().max())))
    # complex: (|z| + b)·z/|z| where |z| + b ≥ 0, with |z| smoothed as √(|z|² + ε)
    zc = torch.randn(7, 5, dtype=torch.complex128)
    mod = torch.sqrt(zc.abs() ** 2 + act.eps)
    ref_c = torch.relu(mod + act.bias) * zc / mod
    assert torch.allclose(act(zc), ref_c, atol=1e-12)


def test_modrelu_nonpositive_bias_guard():
    """With ``nonpositive_bias`` the bias in effect is min(b, 0): the derivative stays bounded."""
    act = ModReLU(3, nonpositive_bias=True).double()
    with torch.no_grad():
        act.bias.copy_(torch.tensor([0.7, -0.2, 0.0], dtype=torch.float64))
    z = torch.tensor([[1e-9, 0.5, -0.3]], dtype=torch.complex128, requires_grad=True)
    out = act(z)
    free = ModReLU(3).double()
    with torch.no_grad():
        free.bias.copy_(torch.tensor([0.0, -0.2, 0.0], dtype=torch.float64))
    assert torch.allclose(out, free(z.detach()), atol=1e-15)
    out.abs().sum().backward()
    assert torch.isfinite(z.grad).all()


def _modrelu(bias, eps=0.0):
    act = ModReLU(len(bias), eps=eps).double()
    with torch.no_grad():
        act.bias.copy_(torch.tensor(bias, dtype=torch.float64))
    return act


_BIASES = [-0.3, 0.0, 0.4]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_modrelu_with_eps_zero_is_finite_at_zero_and_matches_the_limit(dtype):
    # Note [modReLU at zero]: the limit formula sgn(z)·relu(|z| + b) with sgn(0) = 0
    act = _modrelu(_BIASES)
    z = torch.zeros(2, 3, dtype=dtype, requires_grad=True)
    out = act(z)
    assert torch.isfinite(torch.view_as_real(out) if out.is_complex() else out).all()
    assert float(out.abs().max()) == 0.0
    out.real.sum().backward()
    assert torch.isfinite(torch.view_as_real(z.grad) if dtype.is_complex else z.grad).all()
    assert torch.isfinite(act.bias.grad).all()
    # ∂σ/∂z(0) = 1[b ≥ 0] (the b > 0 entry: the continuous part of z + b·sgn(z))
    want = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64).expand(2, 3)
    assert torch.equal(z.grad.real, want)
    # σ(0) = 0 for every b, so ∂σ/∂b(0) = 0
    assert torch.equal(act.bias.grad, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_modrelu_with_eps_zero_matches_the_formula_and_gradcheck_away_from_zero(dtype):
    act = _modrelu(_BIASES)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 3, dtype=dtype, generator=g)
    z = z / z.abs() * (0.6 + torch.rand(4, 3, dtype=torch.float64, generator=g))  # |z| ≥ 0.6
    ref = torch.sgn(z) * torch.relu(z.abs() + act.bias.detach())
    assert torch.allclose(act(z), ref, rtol=0, atol=10 * torch.finfo(torch.float64).eps)
    bias = act.bias.detach().clone().requires_grad_(True)

    def f(z, b):
        return torch.func.functional_call(act, {"bias": b}, (z,))

    assert torch.autograd.gradcheck(f, (z.clone().requires_grad_(True), bias))


@pytest.mark.parametrize("bias", [-0.3, 0.0])
def test_modrelu_with_eps_zero_gradient_at_zero_matches_finite_differences(bias):
    # where σ is differentiable at 0 (b ≤ 0): central differences along 1 and i
    act = _modrelu([bias])
    h = 1e-6
    for dtype, steps in ((torch.float64, (1.0,)), (torch.complex128, (1.0, 1j))):
        for step in steps:
            dz = torch.tensor([[step]], dtype=dtype)
            zero = torch.zeros(1, 1, dtype=dtype, requires_grad=True)
            fd = (act(h * dz) - act(-h * dz)).detach() / (2 * h)  # directional derivative
            (act(zero) * dz.conj()).real.sum().backward()
            # for σ(z) = z·s with s real: the directional derivative is s·dz, the
            # gradient of Re⟨σ, dz⟩ is s·dz as well (s = 0 for b < 0, 1 for b = 0)
            assert torch.allclose(zero.grad, fd, atol=1e-9), (dtype, step, zero.grad, fd)


@pytest.mark.parametrize("eps", [-1e-5, -1, float("nan"), float("inf")])
def test_modrelu_refuses_a_negative_or_non_finite_eps(eps):
    with pytest.raises(ValueError, match=r"eps=.* is out of range; allowed: \[0.0, inf\)"):
        ModReLU(3, eps=eps)
    with pytest.raises(TypeError, match="eps must be a real number"):
        ModReLU(3, eps="0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_cell_is_unitary_and_matches_a_dense_loop(dtype):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = OrthogonalRNN(2, 6, 3, method="scaled_cayley", complex=True, generator=gen, dtype=dtype)
    cdtype = dtype.to_complex()
    w = model.transition_matrix()
    assert w.dtype == cdtype and model.inp.dtype == cdtype and model.out.weight.dtype == dtype
    eye = torch.eye(6, dtype=cdtype)
    assert float((w.mH @ w - eye).norm()) < 10 * 6 * torch.finfo(dtype).eps
    x = torch.randn(4, 5, 2, dtype=dtype)
    # the reference: h_t = modReLU(U x_t + W h_{t−1}) written out, y = V [Re h, Im h] + c
    h = model.h0.expand(4, 6)
    with torch.no_grad():
        for t in range(5):
            h = model.act(x[:, t].to(cdtype) @ model.inp.T + h @ w.T)
        ref = model.out(torch.cat((h.real, h.imag), -1))
        got = model(x)
    assert got.shape == (4, 3) and got.dtype == dtype
    assert torch.allclose(got, ref, atol=100 * torch.finfo(dtype).eps)
    loss = model(x).square().sum()
    loss.backward()
    grads = [p.grad for p in model.transition.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_operator_and_matrix_forms_give_the_same_outputs():
    gen = torch.Generator().manual_seed(2)
    kw = dict(method="cwy", method_options={"reflections": 3}, dtype=torch.float64)
    a = OrthogonalRNN(2, 8, 3, operator=True, generator=gen, **kw)
    b = OrthogonalRNN(2, 8, 3, operator=False, **kw)
    b.load_state_dict(a.state_dict())
    assert a.use_operator and not b.use_operator
    x = torch.randn(3, 7, 2, dtype=torch.float64)
    assert torch.allclose(a(x, all_steps=True), b(x, all_steps=True), atol=1e-12)


def test_model_dtype_follows_the_run():
    """A float64 / complex128 run trains a float64 / complex128 model, LSTM included."""
    opts = {"n": 4, "T": 3, "batch": 2}
    for strategy, dtype, want in [
        ("cwy+adam", "float64", torch.float64),
        ("scaled_cayley+rmsprop", "complex128", torch.complex128),
        ("lstm+adam", "float64", torch.float64),
    ]:
        rec = run(RunConfig("copying", strategy, steps=3, dtype=dtype, task_options=opts))
        assert all(math.isfinite(v) for v in rec["loss"])
        if not strategy.startswith("lstm"):
            # drift of a float64/complex128 map: float64 rounding, not float32's
            assert max(rec["drift"]) < 100 * 4 * torch.finfo(torch.float64).eps, (strategy, want)
    lstm = LSTMBaseline(2, 4, 3, dtype=torch.float64)
    assert lstm(torch.randn(1, 5, 2)).dtype == torch.float64
    with pytest.raises(TypeError, match="dtype=torch.float16; allowed: torch.float32, torch"):
        OrthogonalRNN(2, 4, 3, dtype=torch.float16)


def test_operator_capability_comes_from_the_map_class():
    """No hand list: the capability is the map class's (it overrides ``operator``), and
    every map's ``operator`` equals F.linear(x, W) (formed densely where it has none)."""
    from stiefel import orthogonalize
    from stiefel.parametrizations import OrthogonalMap

    x = torch.randn(3, 6, dtype=torch.float64)
    for name in available():
        if name == "riemannian":
            continue
        w = orthogonalize(torch.eye(6, dtype=torch.float64), method=name)
        y = w.map.operator(w.parametrizations.weight.original, x)
        overrides = type(w.map).operator is not OrthogonalMap.operator
        assert has_operator(w.map) == overrides, name
        assert torch.allclose(y, x @ w().T, atol=1e-12), name
    assert has_operator(orthogonalize(torch.eye(6), method="cwy").map)
    assert not has_operator(orthogonalize(torch.eye(6), method="exp").map)
    assert not has_operator(orthogonalize(torch.eye(6), method="cayley").map)
    assert not has_operator(None)


@pytest.mark.parametrize("complex_", [False, True])
def test_cell_steps_match_the_model(complex_):
    gen = torch.Generator().manual_seed(3)
    kw = dict(method="cwy", complex=complex_, generator=gen, dtype=torch.float64)
    model = OrthogonalRNN(2, 6, 3, **kw)
    x = torch.randn(2, 5, 2, dtype=torch.float64)
    h = model.h0.expand(2, 6)
    with torch.no_grad(), parametrize.cached():
        for t in range(5):
            h = model.cell(x[:, t], h)
        hs = torch.cat((h.real, h.imag), -1) if complex_ else h
        assert torch.allclose(model.out(hs), model(x), atol=1e-12)
    step = model.cell.rollout_step(operator=True)
    h1 = model.cell(x[:, 0], model.h0.expand(2, 6), step)
    h2 = model.cell(x[:, 0], model.h0.expand(2, 6))
    assert torch.allclose(h1, h2, atol=1e-12)


def test_cell_rejects_bad_arguments():
    with pytest.raises(
        ValueError, match="init='nope' is not supported; allowed: henaff, haar, identity"
    ):
        OrthogonalRNNCell(2, 4, init="nope")
    with pytest.raises(ValueError, match="operator='x'; allowed"):
        OrthogonalRNN(2, 4, 3, operator="x")


@pytest.mark.parametrize(
    "build",
    [
        lambda: OrthogonalRNNCell(3, 4, complex="no"),
        lambda: OrthogonalRNNCell(3, 4, nonpositive_bias="no"),
        lambda: OrthogonalRNN(3, 4, 2, complex="no"),
        lambda: OrthogonalRNN(3, 4, 2, nonpositive_bias=1),
        lambda: ModReLU(4, nonpositive_bias="yes"),
        lambda: OrthogonalRNNCell(3, 4).rollout_step(operator="yes"),
        lambda: OrthogonalRNN(3, 4, 2)(torch.randn(1, 2, 3), all_steps="no"),
    ],
)
def test_bool_arguments_must_be_bools(build):
    # a truthy string ("no") built a unitary cell before
    with pytest.raises(TypeError, match=r"=('no'|'yes'|1) is not allowed; allowed: True, False"):
        build()


@pytest.mark.parametrize("operator", [1, 0])
def test_operator_one_or_zero_is_not_a_bool(operator):
    with pytest.raises(ValueError, match=f"operator={operator}; allowed: True, False, 'auto'"):
        OrthogonalRNN(2, 4, 3, operator=operator)


@pytest.mark.parametrize("build", [lambda: OrthogonalRNNCell(3, 8), lambda: OrthogonalRNN(3, 8, 2)])
def test_a_recurrent_layer_built_on_meta_is_refused_with_the_reason(build):
    # it failed inside its init with "Tensor.item() cannot be called on meta tensors"; and
    # with no reset_parameters, to_empty would leave it unset
    with torch.device("meta"), pytest.raises(ValueError, match="build it on a real device"):
        build()
    assert next(build().parameters()).device.type == "cpu"  # outside the context: built


@pytest.mark.parametrize("shape", [(2, 0, 3), (5, 3), (2, 4, 5)])
def test_an_input_of_another_shape_is_refused_naming_the_one_allowed(shape):
    # T = 0 failed in torch.stack, a 2-D input in an unpacking, a wrong n_in in a matmul
    rnn = OrthogonalRNN(3, 8, 2)
    with pytest.raises(ValueError, match=r"allowed: \(batch, T, n_in\) with T ≥ 1 and n_in = 3"):
        rnn(torch.randn(shape))


@pytest.mark.parametrize("complex_", [False, True])
def test_the_cell_casts_its_state_as_it_casts_its_input(complex_):
    # real float32 zeros, as the docs start a sequence, failed in a matmul on a complex or
    # float64 cell: h was not cast as x was
    cell = OrthogonalRNNCell(3, 4, complex=complex_, dtype=torch.float64)
    x = torch.randn(2, 3)
    out = cell(x, torch.zeros(2, 4))
    dtype = cell.inp.dtype
    ref = cell.act(x.to(dtype) @ cell.inp.T + torch.zeros(2, 4, dtype=dtype) @ cell.transition().T)
    assert out.dtype == dtype
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "x, h, error, message",
    [
        ((2, 5), (2, 4), ValueError, r"x has shape \(2, 5\); allowed: \(batch, n_in = 3\)"),
        ((2, 3), (2, 5), ValueError, r"h has shape \(2, 5\); allowed: \(batch, n_hidden = 4\)"),
        ((2, 3), (4,), ValueError, r"h has shape \(4,\); allowed: \(batch, n_hidden = 4\)"),
        ((2, 3), (3, 4), ValueError, "x has batch 2, h 3; allowed: the same batch"),
        ("complex", (2, 4), TypeError, "x has dtype torch.complex64 and the cell is real"),
        ((2, 3), "complex", TypeError, "h has dtype torch.complex64 and the cell is real"),
    ],
)
def test_the_cell_refuses_an_input_or_state_it_cannot_step_naming_it(x, h, error, message):
    # each gave torch's matmul error naming neither, and a complex x or h on a real cell lost
    # its imaginary part with only torch's cast warning
    def make(shape, width):
        return (
            torch.randn(2, width, dtype=torch.complex64)
            if shape == "complex"
            else torch.randn(shape)
        )

    with pytest.raises(error, match=message):
        OrthogonalRNNCell(3, 4)(make(x, 3), make(h, 4))


def test_the_model_refuses_a_complex_input_for_a_real_cell():
    with pytest.raises(TypeError, match="x has dtype torch.complex64 and the cell is real"):
        OrthogonalRNN(3, 4, 2)(torch.randn(2, 5, 3, dtype=torch.complex64))


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_modrelu_refuses_a_number_of_features_that_is_not_a_positive_int(n):
    # 0 built an empty layer; -1 and 2.5 failed in torch.full naming neither
    with pytest.raises(ValueError, match=f"n={n!r}"):
        ModReLU(n)


def test_modrelu_refuses_an_input_of_another_width_naming_it():
    with pytest.raises(ValueError, match=r"z has shape \(2, 5\); allowed: \(\.\.\., 4\)"):
        ModReLU(4)(torch.randn(2, 5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex128])
def test_modrelu_output_follows_the_input_dtype(dtype):
    # a float16 input came back float32: the float32 bias promoted it
    act = ModReLU(4)
    with torch.no_grad():
        act.bias.copy_(torch.tensor([-0.3, 0.0, 0.2, 0.5]))
    z = torch.randn(3, 4, dtype=torch.complex128 if dtype.is_complex else torch.float64)
    z = z.to(dtype)
    out = act(z)
    assert out.dtype == dtype
    wide = z.to(torch.complex128 if dtype.is_complex else torch.float64)
    ref = _modrelu(act.bias.double().tolist(), eps=act.eps)(wide)  # the same float32 bias
    tol = 10 * 4 * torch.finfo(out.real.dtype if dtype.is_complex else dtype).eps
    assert torch.allclose(out.to(ref.dtype), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("complex_", [False, True])
def test_a_haar_cell_starts_haar_on_its_group_with_inputs_of_its_kind(complex_):
    # init="haar" took the Q of torch.linalg.qr without its sign fix (W₀₀ < 0 in 200 of
    # 200 seeds) and a complex cell started on a real matrix with real input weights.
    # Reference: the moments of a Haar entry on O(n) / U(n) of size n: E W₀₀ = 0,
    # E|W₀₀|² = 1/n, and a complex W₀₀ has a uniform phase (E W₀₀² = 0)
    n, draws = 4, 300
    cells = [
        OrthogonalRNNCell(2, n, complex=complex_, init="haar", dtype=torch.float64,
                          generator=torch.Generator().manual_seed(s))
        for s in range(draws)
    ]  # fmt: skip
    w00 = torch.stack([c.transition_matrix().detach()[0, 0] for c in cells])
    sd = (1 / n) ** 0.5 / draws**0.5  # of the mean of W₀₀ (Var W₀₀ = 1/n)
    assert w00.mean().abs() < 4 * sd
    assert abs(float((w00.abs() ** 2).mean()) - 1 / n) < 0.25 / n
    if complex_:
        assert (w00**2).mean().abs() < 4 * sd
        inp = torch.stack([c.inp.detach() for c in cells])
        assert inp.is_complex() and inp.imag.abs().max() > 0
        assert abs(float((inp.abs() ** 2).mean()) * 2 - 1) < 0.1  # E|w|² = 1/n_in


def _cast(model, cast):
    return model.to(torch.complex128) if cast == "complex128" else getattr(model, cast)()


@pytest.mark.parametrize(
    "complex_, cast",
    [
        (True, "double"),
        (True, "complex128"),
        (True, "half"),
        (True, "bfloat16"),
        (False, "complex128"),
    ],
)
def test_a_cast_keeps_each_tensor_kind_and_the_model_runs_as_a_dense_loop(complex_, cast):
    # .double() left a complex cell's U and W complex64 beside float64 real parts, and
    # .to(complex128) made the readout and the modReLU bias complex: a dtype mismatch at
    # the next forward (a real model refused .to(complex128) in its map)
    gen = torch.Generator().manual_seed(4)
    model = OrthogonalRNN(3, 6, 2, method="scaled_cayley", complex=complex_, generator=gen)
    with torch.no_grad():
        model.act.bias.uniform_(-0.4, 0.2, generator=gen)
    model = _cast(model, cast)
    wide = cast in ("double", "complex128")
    real = torch.float64 if wide else getattr(torch, cast)
    inner = torch.float64 if wide else (torch.float32 if complex_ else real)
    kind = inner.to_complex() if complex_ else inner  # no complex-half: complex64 at least
    assert model.inp.dtype == kind and model.h0.dtype == kind
    assert model.act.bias.dtype == real and model.out.weight.dtype == real
    x = torch.randn(2, 4, 3, generator=gen)
    with torch.no_grad():
        got = model(x)
        # the reference in complex128, from the cast tensors: h ← modReLU(W h + U x),
        # y = V [Re h, Im h] + c (V h + c for a real cell)
        c128 = torch.complex128
        w, u = model.transition_matrix().to(c128), model.inp.to(c128)
        b, eps = model.act.bias.double(), model.act.eps
        h = model.h0.to(c128).expand(2, 6)
        for t in range(4):
            z = x[:, t].to(c128) @ u.T + h @ w.T
            mod = (z.abs() ** 2 + eps).sqrt() if complex_ else z.abs()
            h = torch.relu(mod + b) * z / (mod if complex_ else mod + eps)
        hs = torch.cat((h.real, h.imag), -1) if complex_ else h.real
        ref = hs @ model.out.weight.double().T + model.out.bias.double()
    assert got.dtype == real
    tol = 50 * torch.finfo(real).eps * (1 + float(ref.abs().max()))
    assert float((got.double() - ref).abs().max()) <= tol


def test_modrelu_bias_stays_real_under_a_complex_cast():
    # .to(complex128) made the bias complex; its imaginary part was dropped at each forward
    act = ModReLU(3).to(torch.complex128)
    assert act.bias.dtype == torch.float64
    assert ModReLU(3).double().bias.dtype == torch.float64


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: OrthogonalRNN(3, 4, 0), ValueError, "n_out=0 .*allowed: an int >= 1"),
        (lambda: OrthogonalRNN(3, 4, -2), ValueError, "n_out=-2 .*allowed: an int >= 1"),
        (lambda: OrthogonalRNN(3, 4, 2.5), ValueError, "n_out=2.5 .*allowed: an int >= 1"),
        (
            lambda: OrthogonalRNNCell(3, 4, method_options=[("reflections", 2)]),
            TypeError,
            r"method_options=\[\('reflections', 2\)\]; allowed: None or a dict",
        ),
        (
            lambda: OrthogonalRNN(3, 4, 2, generator=5),
            TypeError,
            "generator=5; allowed: None or a torch.Generator",
        ),
    ],
)
def test_recurrent_layers_refuse_bad_arguments_naming_them(build, error, message):
    # n_out = 0 built an empty readout; the others failed inside torch naming no argument
    with pytest.raises(error, match=message):
        build()
