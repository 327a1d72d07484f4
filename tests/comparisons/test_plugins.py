"""A plugin map and a plugin optimizer run in drift, convergence and complexity by name.

Both are registered the way a third party would (``stiefel.parametrizations.register``,
``stiefel.optimizers.register``) with their capabilities declared on the class; the
harness is not edited. The registrations are removed again after the test.
"""

from typing import ClassVar

import pytest
import torch

from stiefel import optimizers, parametrizations
from stiefel.comparisons import cli, cost, table
from stiefel.manifolds import kernels
from stiefel.optimizers import RiemannianOptimizer

MAP, OPT = "polar_plugin", "plugin_rsgd"


class PolarMap(parametrizations.OrthogonalMap):
    """Q = polar(A), the nearest point of the manifold to a free matrix A."""

    formula: ClassVar[str] = "n³ (SVD)"
    domain: ClassVar[str] = "St(n, m)"

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None) -> float:
        return 22.0 * n * m * m

    def matrix(self, original):
        return kernels.polar(original)

    def inverse(self, q):
        # A = Q·diag(1, 2, …, m) has polar factor Q and distinct singular values,
        # where the SVD's backward is finite (at A = Q it divides by σᵢ − σⱼ = 0)
        d = torch.arange(1, q.shape[-1] + 1, dtype=q.real.dtype, device=q.device)
        return q * d


class PluginRSGD(RiemannianOptimizer):
    """Riemannian gradient descent with the QR retraction, written as a plugin."""

    default_lr = 0.1
    riemannian = True
    formula = "4NM² + QR"
    variants: ClassVar[list] = [{}]

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr, retraction="qr", repair_every=None))

    @classmethod
    def step_flops(cls, n: int, m: int, **hyper) -> float:
        return 8.0 * n * m * m

    def update(self, geo, x, grad, state, group):
        return geo.descend(x, geo.rgrad(x, grad), group["lr"])


@pytest.fixture
def plugins(monkeypatch):
    from stiefel.optimizers import registry as opt_registry
    from stiefel.parametrizations import base

    # registered through the public decorators; undone through the registries' snapshots
    saved = base.MAPS.snapshot(), opt_registry.OPTIMIZERS.snapshot()
    parametrizations.register(MAP)(PolarMap)
    optimizers.register(OPT)(PluginRSGD)
    if hasattr(optimizers, "info"):  # the contract's info() reads the class attributes
        assert optimizers.info(OPT).default_lr == 0.1
    yield
    base.MAPS.restore(saved[0])
    opt_registry.OPTIMIZERS.restore(saved[1])


def test_plugins_are_read_from_the_registries(plugins):
    assert MAP in parametrizations.maps() and MAP in parametrizations.available()
    assert cost.map_flops(MAP, 8, 4) == 22.0 * 8 * 16
    assert cost.map_bytes(MAP, 8, 4, None, 4) == 2 * 8 * 4 * 4  # the default: original, result
    o = optimizers.info(OPT)
    assert (o.default_lr, o.riemannian, o.flops(8, 4)) == (0.1, True, 8.0 * 8 * 16)
    assert cost.optimizer_steps()[OPT] == (o, {})


@pytest.mark.slow  # every subcommand end to end: about ten seconds
def test_plugins_run_in_every_subcommand(plugins, tmp_path):
    tiny = ["--n", "5", "--m", "2", "--steps", "6", "--record-every", "2", "--seeds", "1"]
    tiny += ["--jobs", "1"]  # registered in this process only: a spawned worker has no plugin
    strategies = [f"{MAP}+adam", f"riemannian+{OPT}", f"{MAP}+{OPT}"]
    out = tmp_path / "d"
    cli.main(["drift", "--out", str(out), "--strategies", *strategies, "--dtype", "float64", *tiny])
    lrs = table.read(out, metric="lr")
    assert [r["strategy"] for r in lrs] == strategies
    assert lrs[1]["value"] == 0.1  # the plugin's declared default learning rate
    # both keep the matrix on St(5, 2) in float64
    assert max(r["value"] for r in table.read(out, metric="drift")) < 1e-12
    out = tmp_path / "c"
    cli.main(
        ["convergence", "--out", str(out), "--tasks", "brockett", "--strategies", *strategies]
        + ["--dtype", "float64", *tiny]
    )
    assert {r["strategy"] for r in table.read(out, metric="final_loss")} == set(strategies)
    out = tmp_path / "x"
    cli.main(
        ["complexity", "--out", str(out), "--sizes", "4", "8", "--fractions", "1"]
        + ["--repeats", "1", "--shapes", "16x2"]
    )
    polar = table.read(out, task="maps", strategy=MAP, metric="flops")  # no L: it takes none
    assert [r["step"] for r in polar] == [4, 8] and polar[0]["value"] == 22.0 * 4**3
    (flops,) = table.read(out, task="steps", strategy=f"{OPT} M=2", metric="flops")
    (step_s,) = table.read(out, task="steps", strategy=f"{OPT} M=2", metric="step_s")
    assert flops["value"] == 8.0 * 16 * 4 and step_s["value"] > 0
    assert "n³ (SVD)" in (out / "complexity.md").read_text()
    assert torch.isfinite(torch.tensor(step_s["value"]))
