"""A plugin map and a plugin optimizer run in drift, convergence and complexity by name.

Both are registered the way a third party would (``stiefel.parametrizations.register``,
``stiefel.optimizers.register``) with their capabilities declared on the class; the
harness is not edited. The registrations are removed again after the test.
"""

import json
from typing import ClassVar

import pytest
import torch

from stiefel import optimizers, parametrizations
from stiefel.comparisons import cli, registry
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
    assert MAP in registry.maps() and MAP in registry.methods()
    info = registry.map_info(MAP)
    assert info.formula == "n³ (SVD)" and info.flops(8, 4) == 22.0 * 8 * 16
    assert not info.reflections and not info.operator
    o = registry.optimizer_info(OPT)
    assert (o.default_lr, o.riemannian, o.flops(8, 4)) == (0.1, True, 8.0 * 8 * 16)
    assert OPT in registry.optimizer_steps()


def test_plugins_run_in_every_subcommand(plugins, tmp_path):
    tiny = ["--n", "5", "--m", "2", "--steps", "6", "--record-every", "2", "--seeds", "1"]
    strategies = [f"{MAP}+adam", f"riemannian+{OPT}", f"{MAP}+{OPT}"]
    out = tmp_path / "d"
    cli.main(["drift", "--out", str(out), "--strategies", *strategies, "--dtype", "float64", *tiny])
    runs = json.loads((out / "drift.json").read_text())["runs"]
    assert [r["strategy"] for r in runs] == strategies
    for r in runs:
        assert max(r["drift"]) < 1e-12  # both keep the matrix on St(5, 2) in float64
    assert runs[1]["lr"] == 0.1  # the plugin's declared default learning rate
    out = tmp_path / "c"
    cli.main(
        ["convergence", "--out", str(out), "--tasks", "brockett", "--strategies", *strategies]
        + ["--dtype", "float64", *tiny]
    )
    summary = json.loads((out / "convergence.json").read_text())["summary"]
    assert {s["strategy"] for s in summary} == set(strategies)
    out = tmp_path / "x"
    cli.main(
        ["complexity", "--out", str(out), "--sizes", "4", "8", "--fractions", "1"]
        + ["--repeats", "1", "--shapes", "16x2"]
    )
    data = json.loads((out / "complexity.json").read_text())
    polar = [r for r in data["maps"] if r["method"] == MAP]
    assert [r["n"] for r in polar] == [4, 8] and polar[0]["flops"] == 22.0 * 4**3
    (step,) = [r for r in data["optimizer_steps"] if r["optimizer"] == OPT]
    assert step["flops"] == 8.0 * 16 * 4 and step["step_s"] > 0
    assert "n³ (SVD)" in (out / "complexity.md").read_text()
    assert torch.isfinite(torch.tensor(step["step_s"]))
