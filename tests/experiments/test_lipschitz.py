"""The lipschitz_digits task: exact layer norms against dense references, the bound, the harness."""

import math

import pytest
import torch
from torch.nn.utils import parametrize

import experiments.lipschitz  # noqa: F401  (registers lipschitz_digits)
from experiments.lipschitz_layers import circular_norm, conv_layer
from experiments.lipschitz_net import LipschitzNet, maxmin, operator_norm
from stiefel.comparisons import tasks
from stiefel.comparisons.runner import RunConfig, run

LAYERS = ["fft", "conv_kernel", "orthoconv", "aoc", "conv"]


def _dtype(layer: str) -> torch.dtype:
    return torch.float32 if layer == "aoc" else torch.float64  # orthogonium: float32 only


def _dense(fn, shape, dtype=torch.float64) -> torch.Tensor:
    """The matrix of the linear map ``fn`` on inputs of ``shape`` (one column per basis vector)."""
    n = math.prod(shape)
    eye = torch.eye(n, dtype=dtype)
    with torch.no_grad():
        return torch.stack([fn(eye[i].reshape(shape)).reshape(-1) for i in range(n)], 1)


def _linear_part(layer):
    return lambda v: layer(v) - layer(torch.zeros_like(v))


def test_operator_norm_matches_the_largest_singular_value():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=g, dtype=torch.float64)
    est = operator_norm(lambda v: a @ v, (5,), iters=200, generator=g, dtype=torch.float64)
    assert est == pytest.approx(float(torch.linalg.svdvals(a)[0]), rel=1e-8)


@pytest.mark.parametrize("layer", LAYERS)
def test_circular_norm_is_the_dense_largest_singular_value(layer):
    torch.manual_seed(0)
    dtype = _dtype(layer)
    conv = conv_layer(layer, None, 4, 3, dtype=dtype)
    with torch.no_grad():  # a bias, so that the linear part must be taken
        conv.bias.normal_()
    with parametrize.cached():
        dense = _dense(_linear_part(conv), (1, 4, 5, 5), dtype).double()
        exact = circular_norm(conv, 4, 5)
    svals = torch.linalg.svdvals(dense)
    tol = 50 * torch.finfo(dtype).eps
    assert exact == pytest.approx(float(svals[0]), rel=tol)
    if layer in ("fft", "orthoconv"):  # exactly orthogonal: every singular value is 1
        assert torch.allclose(svals, torch.ones_like(svals), atol=tol)
    if layer == "conv_kernel":  # non-expansive
        assert exact <= 1 + tol
    if layer == "aoc":  # orthogonal up to its Björck iterations
        assert exact == pytest.approx(1.0, abs=1e-2)


def test_circular_norm_refuses_a_layer_that_changes_the_shape():
    conv = torch.nn.Conv2d(2, 2, 3)  # no padding: 5×5 → 3×3
    with pytest.raises(ValueError, match=r"maps \(3, 2, 5, 5\) to \(3, 2, 3, 3\)"):
        circular_norm(conv, 2, 5)


@pytest.mark.parametrize("layer", LAYERS)
def test_bound_is_the_product_of_dense_layer_norms(layer):
    torch.manual_seed(0)
    dtype = _dtype(layer)
    net = LipschitzNet(layer, channels=2, kernel_size=3, size=4, classes=3, scale=2.0, dtype=dtype)
    with parametrize.cached():
        dense = [_dense(_linear_part(c), (1, 2, 4, 4), dtype) for c in net.convs]
        dense.append(net.head.weight.detach().double())
        norms = [float(torch.linalg.svdvals(d.double())[0]) for d in dense]
        bound = net.lipschitz_bound()
        tol = 50 * torch.finfo(dtype).eps
        if layer in ("fft", "orthoconv"):  # orthogonal convolutions, an orthonormal-row head
            assert norms == pytest.approx([1.0, 1.0, 1.0], abs=tol)
            assert bound == pytest.approx(2.0, rel=3 * tol)
        assert bound == pytest.approx(2.0 * math.prod(norms), rel=3 * tol)
        # the bound holds for the network's input-output differences
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(2, 64, 1, 4, 4, generator=g, dtype=dtype)
        with torch.no_grad():
            ratio = (net(x) - net(y)).norm(dim=-1) / (x - y).flatten(1).norm(dim=-1)
        assert float(ratio.max()) <= bound * (1 + tol)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["orthoconv", "aoc"])
def test_bound_is_above_a_power_iteration_estimate_of_the_network(layer):
    """‖J(x)‖₂ by power iteration (a lower bound of the Lipschitz constant) ≤ the bound.

    MaxMin's Jacobian is a permutation, so J(x) = scale·W·P₂C₂P₁C₁E (E the channel
    padding): for orthogonal layers ‖J(x)‖₂ is close to the bound.
    """
    torch.manual_seed(0)
    dtype = _dtype(layer)
    net = LipschitzNet(layer, channels=4, kernel_size=3, size=6, classes=3, scale=2.0, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    with parametrize.cached():
        bound = net.lipschitz_bound()
        estimates = []
        for x in torch.randn(4, 1, 1, 6, 6, generator=g, dtype=dtype):

            def jvp(v, x=x):
                return torch.autograd.functional.jvp(net, x, v, create_graph=True)[1]

            estimates.append(operator_norm(jvp, tuple(x.shape), 100, g, dtype))
    tol = 50 * torch.finfo(dtype).eps
    assert 0.5 * bound < max(estimates) <= bound * (1 + tol)


def test_maxmin_is_a_pointwise_permutation():
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    y = maxmin(x)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1))
    assert torch.equal(y.flatten(2).sort(1).values, x.flatten(2).sort(1).values)


STRATEGIES = [
    "cayley+adam",
    "tcwy(layer=conv_kernel)+adam",
    "cwy(layer=orthoconv)+adam",
    "aoc+adam",
    "conv+adam",
]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_task_trains_every_variant(strategy):
    assert "lipschitz_digits" in tasks.available()
    opts = {"channels": 2, "size": 8, "batch": 8}
    rec = run(RunConfig("lipschitz_digits", strategy, 0, 3, record_every=1, task_options=opts))
    m = rec["metrics"]
    assert 0 <= m["certified_accuracy"] <= m["test_accuracy"] <= 1
    assert rec["loss"][-1] != rec["loss"][0]  # the steps changed the weights
    if strategy in ("cayley+adam", "cwy(layer=orthoconv)+adam"):
        assert m["lipschitz_bound"] == pytest.approx(8.0, rel=1e-5)  # the logits' scale
    elif strategy.startswith("tcwy"):
        assert 0 < m["lipschitz_bound"] <= 8.0 * (1 + 1e-5)  # non-expansive layers
    elif strategy.startswith("aoc"):
        assert m["lipschitz_bound"] == pytest.approx(8.0, rel=1e-2)
    else:
        assert rec["drift"][0] is None and m["lipschitz_bound"] > 0
    if not strategy.startswith("conv"):
        assert max(rec["drift"]) < 1e-4  # the head stays on St(c·s², 10)


def test_bad_layer_and_options_name_what_is_allowed():
    with pytest.raises(ValueError, match="layer='householder'; allowed: fft, conv_kernel"):
        LipschitzNet("householder")
    with pytest.raises(ValueError, match="layer='aoc' takes no map; got method='cwy'"):
        LipschitzNet("aoc", "cwy")
    with pytest.raises(ValueError, match="layer='aoc' with dtype=torch.float64"):
        LipschitzNet("aoc", dtype=torch.float64)
    task = tasks.make("lipschitz_digits", torch.float32, torch.device("cpu"), 0, channels=2, size=4)
    with pytest.raises(ValueError, match="layer='bcop'; allowed: fft, conv_kernel, orthoconv"):
        task.check_method("cwy", {"layer": "bcop"})
    with pytest.raises(ValueError, match="method 'aoc' with options"):
        task.check_method("aoc", {"layer": "fft"})
    with pytest.raises(ValueError, match="not supported; allowed: cayley, exp, cwy"):
        task.check_method("householder", {})  # the FFT layer's maps


def test_a_diverged_run_is_counted_not_a_crash():
    """NaN weights: the bound is NaN and nothing is certified (the norm check raised)."""
    opts = {"channels": 2, "size": 8, "batch": 8}
    rec = run(RunConfig("lipschitz_digits", "conv+sgd(lr=1e6)", 0, 5, task_options=opts))
    assert rec["diverged"]
    assert math.isnan(rec["metrics"]["lipschitz_bound"])
    assert rec["metrics"]["certified_accuracy"] == 0


@pytest.mark.parametrize("layer", ["fft", "aoc", "conv"])  # the maps refuse a NaN parameter
def test_the_norm_of_a_nan_layer_is_nan(layer):
    conv = conv_layer(layer, None, 2, 3, dtype=_dtype(layer))
    with torch.no_grad():
        for p in conv.parameters():
            p.fill_(math.nan)
    assert math.isnan(circular_norm(conv, 2, 4))
    net = LipschitzNet("conv", channels=2, kernel_size=3, size=4)
    with torch.no_grad():
        net.head.weight.fill_(math.nan)
    assert math.isnan(net.layer_norms()[-1]) and math.isnan(net.lipschitz_bound())


def test_circular_norm_is_exact_under_a_large_bias():
    """A bias far above A x (float32) leaves A x = layer(x) − layer(0) to rounding."""
    torch.manual_seed(0)
    conv = conv_layer("fft", None, 4, 3, dtype=torch.float32)
    with torch.no_grad():
        conv.bias.fill_(5e7)
    bias = conv.bias.detach().clone()
    assert circular_norm(conv, 4, 6) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(conv.bias, bias)  # restored


def test_scale_and_radius_are_checked():
    make = tasks.make
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"scale=-8.0; allowed: a finite number > 0"):
        make("lipschitz_digits", torch.float32, cpu, 0, channels=2, size=4, scale=-8.0)
    with pytest.raises(ValueError, match=r"radius=-0.3; allowed: a finite number >= 0"):
        make("lipschitz_digits", torch.float32, cpu, 0, channels=2, size=4, radius=-0.3)
    net = LipschitzNet("fft", channels=2, kernel_size=3, size=4, scale=-2.0, dtype=torch.float64)
    assert net.lipschitz_bound() == pytest.approx(2.0, rel=1e-12)  # |scale|


def test_a_map_the_fft_layer_refuses_names_the_layer_option():
    task = tasks.make("lipschitz_digits", torch.float32, torch.device("cpu"), 0, channels=2, size=4)
    with pytest.raises(ValueError, match=r"allowed: cayley, exp, cwy \(the FFT layer's maps; .*"
                       r"tcwy\(layer=conv_kernel\)"):  # fmt: skip
        task.check_method("tcwy", {})
