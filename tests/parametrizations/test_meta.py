"""Deferred initialisation (FSDP2's recipe): build on meta, to_empty, one call for a valid point."""

import geoopt
import pytest
import torch
from torch import nn

from stiefel.parametrizations import initialize, maps, orthogonalize


def err64(w):
    w = w.detach().double()
    w = w.mT if w.shape[-2] < w.shape[-1] else w
    return float(torch.linalg.matrix_norm(w.mT @ w - torch.eye(w.shape[-1], dtype=w.dtype)).max())


class Net(nn.Module):
    """A model whose __init__ orthogonalizes (the layers are born on whatever device is set)."""

    def __init__(self, method):
        super().__init__()
        self.square = orthogonalize(nn.Linear(6, 6), method=method)
        self.wide = orthogonalize(nn.Linear(6, 4, bias=False), method=method)

    def forward(self, x):
        return self.wide(self.square(x))


@pytest.mark.parametrize("method", list(maps()))
def test_built_under_meta_then_initialize_gives_a_valid_point(method):
    with torch.device("meta"):
        net = Net(method)  # orthogonalize inside the meta context (no value is read)
    assert net.square.weight.device.type == "meta" and net.wide.weight.shape == (4, 6)
    with pytest.raises(ValueError, match="meta device"):
        initialize(net)
    net.to_empty(device="cpu")
    with torch.no_grad():  # what to_empty leaves: uninitialised memory, here made hostile
        for p in [*net.parameters(), *net.buffers()]:
            p.fill_(float("nan"))
    initialize(net, generator=torch.Generator().manual_seed(0))
    eps = torch.finfo(torch.float32).eps
    for layer in (net.square, net.wide):
        w = layer.weight
        assert torch.isfinite(w).all() and err64(w) <= 100 * 6 * eps
    # the point is a proper parametrized point: gradients flow, a step keeps it orthogonal
    net.square.bias.data.zero_()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    net(torch.randn(3, 6)).square().sum().backward()
    opt.step()
    assert err64(net.square.weight) <= 100 * 6 * eps
    # "identity" and the same generator seed reproduce
    initialize(net, init="identity")
    assert torch.allclose(net.square.weight, torch.eye(6), atol=1e-6)
    a = initialize(net, init="haar", generator=torch.Generator().manual_seed(3)).wide.weight
    b = initialize(net, init="haar", generator=torch.Generator().manual_seed(3)).wide.weight
    assert torch.equal(a, b) and not torch.allclose(a, torch.eye(4, 6), atol=1e-3)


def test_riemannian_under_meta():
    with torch.device("meta"):
        lin = orthogonalize(nn.Linear(4, 6), method="riemannian")
    st = lin.weight.manifold
    lin.to_empty(device="cpu")  # torch rebuilds a plain Parameter ...
    assert not isinstance(lin.weight, geoopt.ManifoldParameter)
    initialize(lin, init="haar")  # ... the module recorded its manifold: found again
    assert isinstance(lin.weight, geoopt.ManifoldParameter) and lin.weight.manifold == st
    assert err64(lin.weight) <= 100 * 6 * torch.finfo(torch.float32).eps
    # initialize also writes points into live ManifoldParameters
    with torch.no_grad():
        lin.weight.fill_(0.0)
    initialize(lin, init="identity")
    assert torch.equal(lin.weight.detach(), torch.eye(6, 4))


def test_initialize_bad_input():
    lin = orthogonalize(nn.Linear(4, 4), method="cwy")
    with pytest.raises(ValueError, match="init.*nearest|allowed"):
        initialize(lin, init="nearest")
    with pytest.raises(TypeError, match="generator"):
        initialize(lin, generator=0)
    with pytest.raises(ValueError, match="no orthogonalized weight"):
        initialize(nn.Linear(3, 3))
