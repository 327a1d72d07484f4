"""A step taken inside an autocast region is the step taken outside it.

Note [An optimizer step computes in the parameters' precision]: a retraction's products
ran in bfloat16 inside ``torch.autocast``, leaving a float32 point 1e-2 off its manifold
silently (``rgd``, ``manifold_muon``, ``radam``'s first step) or failing on mixed
dtypes (``landing``, ``pogo``, ``radam``'s second step). The reference is the same
optimizer stepped outside the region on the same gradients, as torch's Adam is unchanged
by the region.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _optim_problems import rule_names

from stiefel import optimizers
from stiefel.manifolds import Stiefel


def _run(name: str, autocast: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    st = Stiefel(24, 8)
    ws = [geoopt.ManifoldParameter(st.random(), manifold=st) for _ in range(3)]
    bias = torch.nn.Parameter(torch.randn(8))
    opt = optimizers.create(name, [*ws, bias], lr=0.05)
    for _ in range(3):
        for p in [*ws, bias]:
            p.grad = torch.randn_like(p)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                opt.step()
        else:
            opt.step()
    return [p.detach().clone() for p in [*ws, bias]]


@pytest.mark.parametrize("name", rule_names())
def test_a_step_inside_autocast_is_the_step_outside(name):
    outside, inside = _run(name, False), _run(name, True)
    for a, b in zip(outside, inside, strict=True):
        assert b.dtype == a.dtype == torch.float32
        assert torch.equal(a, b)
    assert torch.is_autocast_enabled("cpu") is False  # the region was left as it was


def test_the_region_is_on_again_after_the_step():
    st = Stiefel(6, 3)
    w = geoopt.ManifoldParameter(st.random(), manifold=st)
    opt = optimizers.create("rgd", [w], lr=0.1)
    w.grad = torch.randn_like(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt.step()
        assert torch.is_autocast_enabled("cpu")
        assert (w @ w.T).dtype == torch.bfloat16


@pytest.mark.slow  # a compilation
def test_a_compiled_step_inside_a_region_compiles_whole_and_steps_as_outside():
    # the region is left by one torch.autocast context per device (an ExitStack made
    # torch.compile(fullgraph=True) fail inside a region); the reference is eager outside
    def run(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        st = Stiefel(8, 4)
        w = geoopt.ManifoldParameter(st.random(), manifold=st)
        opt = optimizers.create("rgd", [w], lr=0.05)
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        for _ in range(2):
            w.grad = torch.randn_like(w)
            if compiled:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    step()
            else:
                step()
        return w.detach()

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=1e-6)
