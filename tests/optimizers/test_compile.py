"""torch.compile of ``step`` gives the eager result.

Dynamo has been seen to compute a wrong step silently when ``step()`` branches on
``isinstance(p, geoopt.ManifoldParameter)`` inside a traced graph; our optimizers
classify parameters once, in ``add_param_group``. The graphs are run by a
counting backend that executes Dynamo's captured graph as is: it proves that
something was traced (not a silent fallback to eager) and isolates Dynamo's
tracing, which is where that bug lives, from Inductor's code generation (minutes
of C++ compilation on a CPU runner).
"""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import torch
from _optim_problems import haar_np, rule_names

from stiefel import optimizers, orthogonalize
from stiefel.manifolds import Stiefel

RNG = np.random.default_rng(5)
STEPS = 3

# every optimizer written on the rule interface at its defaults (registry-driven),
# and a few options that take other branches of the rules
CONFIGS = [(name, dict(lr=optimizers.info(name).default_lr)) for name in rule_names()] + [
    ("rgd", dict(lr=0.1, momentum=0.5)),
    ("rgd", dict(lr=0.1, metric="canonical", retraction="qr")),
]


def _params(starts):
    """Each kind of parameter: ours, geoopt's Stiefel, orthogonalize(riemannian), plain."""
    ours = geoopt.ManifoldParameter(torch.tensor(starts[0]), manifold=Stiefel(14, 3))
    theirs = geoopt.ManifoldParameter(torch.tensor(starts[1]), manifold=geoopt.EuclideanStiefel())
    made = orthogonalize(torch.tensor(starts[2]), method="riemannian").weight
    plain = torch.nn.Parameter(torch.tensor(starts[3]))
    return [ours, theirs, made, plain]


class CountingBackend:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CONFIGS)])
def test_compiled_step_equals_eager(config):
    name, hyper = config
    starts = [
        haar_np(RNG, 14, 3, False),
        haar_np(RNG, 9, 2, False),
        haar_np(RNG, 8, 8, True),
        RNG.standard_normal((4, 3)),
    ]
    grads = [[RNG.standard_normal(np.shape(s)) for s in starts] for _ in range(STEPS)]
    grads = [
        [g + 1j * RNG.standard_normal(g.shape) if k == 2 else g for k, g in enumerate(gs)]
        for gs in grads
    ]
    results = []
    torch._dynamo.reset()
    backend = CountingBackend()
    for compiled in (False, True):
        params = _params(starts)
        opt = optimizers.create(name, params, **hyper)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = torch.tensor(g)
            step()
        results.append([p.detach().clone() for p in params])
    assert backend.graphs > 0
    for eager, comp in zip(*results, strict=True):
        assert (eager - comp).abs().max() < 1e-6
    # every parameter moved, far above the tolerance above: by 1e-3, or by a tenth of a
    # learning rate below 0.01 (a plugin's default_lr may be)
    pairs = zip(results[0], starts, strict=True)
    moved = min(float((r - torch.tensor(s)).abs().max()) for r, s in pairs)
    assert moved > min(1e-3, 0.1 * hyper["lr"])


@pytest.mark.slow
@pytest.mark.parametrize("name", rule_names())
def test_a_float_lr_changed_between_compiled_steps_compiles_no_new_graph(name):
    # landing's safe step put a float lr into torch.where and clamp as a scalar operand, a
    # constant of the graph: each new lr (a scheduler's) compiled a graph, until the
    # recompile limit (fullgraph: an error at the eighth)
    st = Stiefel(8, 3)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float32), manifold=st)
    opt = optimizers.create(name, [w], lr=0.05)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")  # as the docs show
    target = torch.eye(8, 3)
    for _ in range(6):
        w.grad = w.detach() - target
        step()
        opt.param_groups[0]["lr"] *= 0.9
    assert counters["stats"]["unique_graphs"] <= 2  # the first step's, then with its state
