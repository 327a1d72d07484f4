"""``torch.compile`` of the orthogonal convolutions: one graph for the kernel and the convolution.

The kernel of `OrthoConv2d` is built at every forward from its factors (a chain of
projector steps, `stiefel.nn.orthokernel`); `OrthogonalConv2d` builds its
per-frequency Cayley transforms. Under ``torch.compile(fullgraph=True)`` the
construction and the convolution are traced into one graph (a graph break
raises), forward and backward; the compiled layer must give the eager layer's
output and gradients. The graphs run with ``aot_eager`` (`Counting` of
tests/_compile.py): Dynamo's tracing is what is tested, not Inductor's code
generation (minutes of C++ on a CPU runner). In evaluation (no gradients) the
eager layer caches its kernel, checked against a copy of the factors; a traced forward
assembles it in the graph instead.
"""

from __future__ import annotations

import pytest
import torch
from _compile import Counting

from stiefel.nn import OrthoConv2d, OrthoConvTranspose2d, OrthogonalConv2d

DT = torch.float64


LAYERS = {
    "OrthoConv2d-cwy": lambda: OrthoConv2d(6, 6, 3, dtype=DT),
    "OrthoConv2d-cayley-k4": lambda: OrthoConv2d(6, 6, 4, method="cayley", dtype=DT),
    "OrthoConv2d-stride2": lambda: OrthoConv2d(6, 12, 3, stride=2, bias=False, dtype=DT),
    "OrthoConv2d-groups2-exp": lambda: OrthoConv2d(8, 8, 3, groups=2, method="exp", dtype=DT),
    "OrthoConvTranspose2d": lambda: OrthoConvTranspose2d(12, 6, 3, stride=2, dtype=DT),
    "OrthogonalConv2d-cayley": lambda: OrthogonalConv2d(6, 3, dtype=DT),
}


def _layer_and_input(name: str):
    torch.manual_seed(0)
    layer = LAYERS[name]()
    channels = 12 if name == "OrthoConvTranspose2d" else (8 if "groups" in name else 6)
    x = torch.randn(2, channels, 8, 8, dtype=DT)
    return layer, x


def _compiled(fn):
    torch._dynamo.reset()
    backend = Counting()
    return torch.compile(fn, fullgraph=True, backend=backend), backend


def _loss_and_grads(layer, fn, x, c):
    layer.zero_grad(set_to_none=True)
    loss = (fn(x) * c).sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in layer.named_parameters()}


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_compiled_layer_is_one_graph_with_the_eager_output_and_gradients(name):
    layer, x = _layer_and_input(name)
    c = torch.randn_like(layer(x).detach())
    compiled, backend = _compiled(layer)
    eager = _loss_and_grads(layer, layer, x, c)
    traced = _loss_and_grads(layer, compiled, x, c)
    assert backend.graphs == 1  # fullgraph: a break would have raised; no recompile
    tol = 100 * x.shape[1] * torch.finfo(DT).eps
    assert abs(float(eager[0] - traced[0])) <= tol * max(1.0, abs(float(eager[0])))
    assert eager[1].keys() == traced[1].keys() and eager[1]
    for k, g in eager[1].items():
        assert float((g - traced[1][k]).abs().max()) <= tol * max(1.0, float(g.abs().max())), k


@pytest.mark.parametrize("name", ["OrthoConv2d-cwy", "OrthogonalConv2d-cayley"])
def test_a_compiled_layer_in_evaluation_is_one_graph_and_follows_its_factors(name):
    layer, x = _layer_and_input(name)
    compiled, backend = _compiled(layer)
    tol = 100 * x.shape[1] * torch.finfo(DT).eps
    with torch.no_grad():
        before, eager_before = compiled(x), layer(x)
        for p in layer.parameters():  # an optimizer's step: in place
            p.add_(0.1 * torch.randn_like(p))
        after, eager_after = compiled(x), layer(x)
    assert backend.graphs == 1
    for traced, eager in ((before, eager_before), (after, eager_after)):
        assert float((traced - eager).abs().max()) <= tol * float(eager.abs().max())
    assert float((after - before).abs().max()) > 1e-3  # the new factors were used
