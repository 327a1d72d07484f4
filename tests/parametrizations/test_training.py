"""Training with torch optimizers, serialization, copies, caching and torch.compile."""

import copy
import io

import geoopt
import pytest
import torch
from _compile import Counting
from torch.nn.utils import parametrize

from stiefel.parametrizations import available, maps, orthogonalize

MAPS = list(maps())  # the registry, never a hand list


def orth_err(w):
    w = w.detach()
    w = w.mT if w.shape[-2] < w.shape[-1] else w
    eye = torch.eye(w.shape[-1], dtype=w.dtype)
    return float(torch.linalg.matrix_norm(w.mH @ w - eye).max())


@pytest.mark.parametrize("method", MAPS)
def test_adamw_default_weight_decay_keeps_weight_orthogonal(method):
    """AdamW's decoupled decay (0.01) shrinks every trainable tensor: signs must not live there."""
    torch.manual_seed(0)
    n = 8
    lin = orthogonalize(torch.nn.Linear(n, n, bias=False), method=method)
    with torch.no_grad():
        det0 = torch.linalg.det(lin.weight)
    target = torch.linalg.qr(torch.randn(n, n))[0]
    target = target * torch.sign(torch.linalg.det(target) * det0)  # same component as the init
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    x = torch.randn(64, n)
    loss0 = float(((lin(x) - x @ target.T) ** 2).mean())
    for _ in range(100):
        opt.zero_grad()
        loss = ((lin(x) - x @ target.T) ** 2).mean()
        loss.backward()
        opt.step()
    w = lin.weight.detach()
    assert orth_err(w) < 100 * n * torch.finfo(torch.float32).eps
    s = torch.linalg.svdvals(w)
    assert float(s.min()) > 0.999 and float(s.max()) < 1.001  # non-degenerate
    assert torch.sign(torch.linalg.det(w)) == torch.sign(det0)  # signs kept
    assert float(loss) < 0.5 * loss0  # and it learned
    original = lin.parametrizations.weight.original
    assert torch.isfinite(original).all() and float(original.abs().max()) > 1e-3


def procrustes_target(n, m, dtype, gen):
    """A point of the same connected component as I, at a moderate distance."""
    a = torch.randn(n, n, dtype=dtype, generator=gen)
    a = 0.4 * (a - a.mH)
    return torch.linalg.matrix_exp(a)[:, :m]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(5, 5), (6, 3)])
@pytest.mark.parametrize("method", available())
def test_procrustes_with_adam(method, shape, dtype):
    gen = torch.Generator().manual_seed(1)
    n, m = shape
    target = procrustes_target(n, m, dtype, gen)
    a = torch.randn(20, n, dtype=dtype, generator=gen)
    b = a @ target  # min ‖A W − B‖: the solution is W = target
    w = orthogonalize(torch.eye(n, m, dtype=dtype), method=method)
    if method == "riemannian":
        opt = geoopt.optim.RiemannianAdam(w.parameters(), lr=0.05)
    else:
        opt = torch.optim.Adam(w.parameters(), lr=0.05)
    for _step in range(300):
        opt.zero_grad()
        loss = (a @ w() - b).abs().pow(2).sum()
        loss.backward()
        opt.step()
    assert float((w() - target).abs().max()) < 2e-2, float(loss)
    assert orth_err(w()) < 1e-10


@pytest.mark.parametrize("method", MAPS)
def test_state_dict_round_trip(method):
    torch.manual_seed(2)
    dtype = torch.complex128 if method == "scaled_cayley" else torch.float64
    src = orthogonalize(torch.randn(5, 5, dtype=dtype), method=method, init="haar")
    src.weight = -src.weight.detach()  # change the buffers (signs, base, scaling) as well
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    dst = orthogonalize(torch.randn(5, 5, dtype=dtype), method=method, init="identity")
    dst.load_state_dict(state)
    assert torch.equal(dst(), src())
    lin = orthogonalize(torch.nn.Linear(4, 6), method=method)
    lin2 = orthogonalize(torch.nn.Linear(4, 6), method=method, init="identity")
    lin2.load_state_dict(lin.state_dict())
    assert torch.equal(lin2.weight, lin.weight)


@pytest.mark.parametrize("method", MAPS)
def test_deepcopy_is_independent(method):
    lin = orthogonalize(torch.nn.Linear(5, 5), method=method)
    twin = copy.deepcopy(lin)
    assert torch.equal(twin.weight, lin.weight)
    with torch.no_grad():
        lin.parametrizations.weight.original.add_(0.1)
    assert not torch.equal(twin.weight, lin.weight)
    assert orth_err(twin.weight) < 1e-5


def test_parametrize_cached():
    lin = orthogonalize(torch.nn.Linear(6, 6), method="cwy")
    w = orthogonalize(torch.randn(6, 6), method="householder", reflections=3)
    x = torch.randn(2, 6)
    with parametrize.cached():
        assert lin.weight is lin.weight
        assert w() is w()
        assert torch.allclose(w.linear(x), torch.nn.functional.linear(x, w()), atol=1e-6)


@pytest.mark.parametrize("shape", [(6, 6), (4, 9)], ids=["square", "wide"])
@pytest.mark.parametrize("method", MAPS)
def test_every_map_compiles_into_one_graph_under_cached_and_matches_eager(method, shape):
    # a forward that reads the weight twice, under parametrize.cached() (the map once):
    # Dynamo traces the map and both uses into one graph, with eager's values and gradients
    torch.manual_seed(3)
    lin = orthogonalize(
        torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.float64), method=method
    )
    x = torch.randn(3, shape[1], dtype=torch.float64)

    def forward(x):
        return lin(x) + lin(x).pow(2)

    eager = forward(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    backend = Counting()
    torch._dynamo.reset()
    with parametrize.cached():
        out = torch.compile(forward, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    assert backend.graphs == 1
    tol = 100 * max(shape) * torch.finfo(torch.float64).eps
    assert float((out - eager).abs().max()) <= tol
    for p, g in zip(lin.parameters(), grads, strict=True):
        assert float((p.grad - g).abs().max()) <= tol


def test_rnn_rollout_operator_form_matches_dense():
    torch.manual_seed(4)
    n, L, T = 16, 4, 5
    w = orthogonalize(torch.randn(n, n, dtype=torch.float64), method="cwy", reflections=L)
    h0 = torch.randn(3, n, dtype=torch.float64)
    h, hd = h0, h0
    q = w()
    for _ in range(T):
        h = torch.tanh(w.linear(h))
        hd = torch.tanh(hd @ q.T)
    assert (h - hd).abs().max() < 1e-12
    h.sum().backward()
    g1 = w.parametrizations.weight.original.grad.clone()
    w.zero_grad()
    hd = h0
    for _ in range(T):
        hd = torch.tanh(hd @ w().T)
    hd.sum().backward()
    assert (g1 - w.parametrizations.weight.original.grad).abs().max() < 1e-10
