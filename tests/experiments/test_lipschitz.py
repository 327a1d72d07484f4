"""The lipschitz_digits task: the layer-norm product against dense references, and the harness."""

import math

import pytest
import torch

import experiments.lipschitz  # noqa: F401  (registers lipschitz_digits)
from experiments.lipschitz_net import LipschitzNet, maxmin, operator_norm
from stiefel.comparisons import tasks
from stiefel.comparisons.runner import RunConfig, run


def _dense(fn, shape, dtype=torch.float64) -> torch.Tensor:
    """The matrix of the linear map ``fn`` on inputs of ``shape`` (one column per basis vector)."""
    n = math.prod(shape)
    eye = torch.eye(n, dtype=dtype)
    with torch.no_grad():
        return torch.stack([fn(eye[i].reshape(shape)).reshape(-1) for i in range(n)], 1)


def test_operator_norm_matches_the_largest_singular_value():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=g, dtype=torch.float64)
    est = operator_norm(lambda v: a @ v, (5,), iters=200, generator=g, dtype=torch.float64)
    assert est == pytest.approx(float(torch.linalg.svdvals(a)[0]), rel=1e-8)


@pytest.mark.parametrize("method", ["cayley", "conv"])
def test_bound_is_the_product_of_dense_layer_norms(method):
    torch.manual_seed(0)
    net = LipschitzNet(
        method, channels=2, kernel_size=3, size=4, classes=3, scale=2.0, dtype=torch.float64
    )
    dense = [float(torch.linalg.svdvals(_dense(fn, shape))[0]) for fn, shape in net.layer_maps()]
    if method != "conv":  # orthogonal convolutions and an orthonormal-row head
        assert dense == pytest.approx([1.0, 1.0, 1.0], abs=1e-10)
    bound = net.lipschitz_bound(iters=300, generator=torch.Generator().manual_seed(1))
    assert bound == pytest.approx(2.0 * math.prod(dense), rel=1e-6)
    # the bound holds for the network's input-output differences
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 64, 1, 4, 4, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ratio = (net(x) - net(y)).norm(dim=-1) / (x - y).flatten(1).norm(dim=-1)
    assert float(ratio.max()) <= bound * (1 + 1e-9)


def test_maxmin_is_a_pointwise_permutation():
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    y = maxmin(x)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1))
    assert torch.equal(y.flatten(2).sort(1).values, x.flatten(2).sort(1).values)


@pytest.mark.parametrize("strategy", ["cayley+adam", "conv+adam"])
def test_task_runs_two_steps(strategy):
    assert "lipschitz_digits" in tasks.available()
    opts = {"channels": 2, "size": 8, "batch": 8}
    rec = run(RunConfig("lipschitz_digits", strategy, 0, 2, record_every=1, task_options=opts))
    m = rec["metrics"]
    assert 0 <= m["certified_accuracy"] <= m["test_accuracy"] <= 1
    if strategy == "cayley+adam":
        assert m["lipschitz_bound"] == pytest.approx(8.0, rel=1e-4)  # the logits' scale
        assert max(rec["drift"]) < 1e-4
    else:
        assert rec["drift"][0] is None and m["lipschitz_bound"] > 0


def test_bad_method_names_what_is_allowed():
    with pytest.raises(ValueError, match="method='householder'; allowed: cayley, exp, cwy, conv"):
        LipschitzNet("householder")
