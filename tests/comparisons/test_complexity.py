"""The complexity section's measuring tools: peak memory, the measurement plans, and the
measured time as a multiple of the FLOP model at the GEMM rate."""

import itertools
import json
import math

import pytest
import torch

from stiefel import optimizers, parametrizations
from stiefel.comparisons import cli, complexity, cost, table
from stiefel.comparisons.complexity import map_plan, step_plan
from stiefel.comparisons.cost import peak_bytes

MiB = 2**20


def test_peak_bytes_follows_allocations_and_frees():
    def fn():
        x = torch.empty(MiB, dtype=torch.uint8)
        y = torch.empty(2 * MiB, dtype=torch.uint8)
        del x  # freed before z exists: the peak is x + y, not x + y + z
        z = torch.empty(MiB // 2, dtype=torch.uint8)  # y + z = 2.5 MiB < x + y
        return y, z

    assert peak_bytes(fn) == 3 * MiB

    def keep():
        return [torch.empty(MiB, dtype=torch.uint8) for _ in range(3)]

    assert peak_bytes(keep) == 3 * MiB


def test_peak_bytes_ignores_views_in_place_ops_and_earlier_tensors():
    a = torch.zeros(1024, 1024)
    assert peak_bytes(lambda: (a.add_(1), a[:10], a.T, a.detach())) == 0
    b = torch.randn(64, 64)
    # b @ b allocates one 64×64 float32 result: 16 KiB, the input is not counted
    assert peak_bytes(lambda: b @ b) == 64 * 64 * 4


def test_peak_bytes_sees_the_backward_pass():
    w = torch.randn(128, 128, requires_grad=True)

    def fwd_bwd():
        (w @ w).sum().backward()

    # the product (64 KiB) and at least the gradient of w (64 KiB) are held together
    assert peak_bytes(fwd_bwd) >= 2 * 128 * 128 * 4
    assert w.grad is not None


def test_plans_honour_limits():
    plan = map_plan(["cwy", "exp"], [8, 16, 32], [0.25, 1.0], {"exp": 16})
    assert [p for p in plan if p[0] == "exp"] == [("exp", 1.0, 8), ("exp", 1.0, 16)]
    assert len([p for p in plan if p[0] == "cwy"]) == 2 * 3
    steps = step_plan([(64, 4), (128, 4)], {"landing": 64})
    assert ("landing", 64, 4) in steps and ("landing", 128, 4) not in steps
    assert ("geoopt RiemannianSGD CanonicalStiefel", 128, 4) in steps


# ----------------------------------------------------------------- × FLOPs at GEMM rate
def approx(x, rel: float = 1e-6):
    """pytest.approx that also matches NaN with NaN (a map or step without a FLOP model)."""
    return pytest.approx(x, rel=rel, nan_ok=True)


def _map_model(name: str, n: int, L: int) -> float:
    """Forward FLOPs of map ``name`` read from its class (independent of the harness)."""
    cls = parametrizations.maps()[name]
    return float(cls.flops(n, n, L if cls.takes_reflections() else None))


def _step_model(label: str, n: int, m: int) -> float:
    info, variant = cost.optimizer_steps()[label]
    model = optimizers.info(info.name).step_flops
    return math.nan if model is None else float(model(n, m, **variant))


def test_gemm_multiple_is_time_over_model_time_for_every_map_and_step():
    rate = 3.0e10
    maps = [
        {"method": name, "n": 64, "L": 16, "forward_s": 0.01 * k, "forward_backward_s": 0.05 * k}
        for k, name in enumerate(parametrizations.maps(), start=1)
    ]
    steps = [
        {
            "optimizer": label,
            "N": 256,
            "M": 8,
            "step_s": 0.002 * k,
            "flops": _step_model(label, 256, 8),
        }
        for k, label in enumerate(cost.optimizer_steps(), start=1)
    ]
    for r in maps:
        r["flops"] = _map_model(r["method"], 64, 16)
    before = json.dumps([maps, steps])
    out_maps, out_steps = complexity.with_gemm_multiples(maps, steps, rate)
    assert json.dumps([maps, steps]) == before  # the inputs are left as they were
    assert [r["method"] for r in out_maps] == list(parametrizations.maps())
    for r in out_maps:
        fwd = _map_model(r["method"], 64, 16)
        assert r["forward_x_gemm"] == approx(r["forward_s"] * rate / fwd, rel=1e-12)
        # no map declares a backward model: fwd+bwd is charged 3× the forward FLOPs
        assert r["forward_backward_basis"] == "3× forward"
        assert r["forward_backward_flops"] == approx(3 * fwd, rel=1e-12)
        want = r["forward_backward_s"] / (3 * fwd / rate)
        assert r["forward_backward_x_gemm"] == approx(want, rel=1e-12)
    assert [r["optimizer"] for r in out_steps] == list(cost.optimizer_steps())
    for r in out_steps:
        model = _step_model(r["optimizer"], 256, 8)
        if math.isnan(model):  # an optimizer without a FLOP model has no multiple
            assert math.isnan(r["step_x_gemm"])
        else:
            assert r["step_x_gemm"] == approx(r["step_s"] * rate / model, rel=1e-12)
    assert cost.gemm_multiple(0.3, 1e9, 1e10) == approx(3.0)
    assert math.isnan(cost.gemm_multiple(0.3, 0.0, 1e10))


def test_forward_backward_is_three_forwards():
    fb, basis = cost.forward_backward_flops("cwy", 32, 32, 8)
    assert basis == "3× forward"
    assert fb == approx(3 * _map_model("cwy", 32, 8), rel=1e-12)


def _md_rows(md: str, header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in itertools.takewhile(lambda x: x.startswith("|"), lines[start + 2 :]):
        rows.append(dict(zip(names, [c.strip() for c in line.strip("|").split("|")], strict=True)))
    return rows


def _rows(out, task: str) -> list[dict]:
    """The table's rows of complexity part ``task`` regrouped as measured rows."""
    rows: dict[tuple, dict] = {}
    for r in table.read(out, section="complexity", task=task):
        rows.setdefault((r["strategy"], r["step"]), {})[r["metric"]] = r["value"]
    return list(rows.values())


def test_section_writes_the_column_to_the_table_and_markdown(tmp_path, monkeypatch):
    # a fake timer: the k-th timing returns k ms, so forward, forward+backward and steps differ
    ticks = itertools.count(1)
    fake = lambda fn, *a, **k: 1e-3 * next(ticks)  # noqa: E731
    monkeypatch.setattr(cost, "fastest_time", fake)  # the GEMM rate's
    monkeypatch.setattr(complexity, "fastest_time", fake)
    argv = ["complexity", "--out", str(tmp_path), "--sizes", "8", "--fractions", "0.5", "1"]
    cli.main(argv + ["--repeats", "1", "--shapes", "32x4"])
    (rate,) = [r["value"] for r in table.read(tmp_path, task="gemm")]
    assert rate == approx(2 * 512**3 / 1e-3)  # the first timing: the GEMM rate's
    maps, steps = _rows(tmp_path, "maps"), _rows(tmp_path, "steps")
    assert {r["method"] for r in maps} == set(parametrizations.maps())
    for r in maps:  # the multiples the markdown must show, from the table's raw values
        fwd = _map_model(r["method"], 8, r["L"])
        assert r["forward_s"] != r["forward_backward_s"]
        r["forward_x_gemm"] = r["forward_s"] / (fwd / rate)
        r["forward_backward_x_gemm"] = r["forward_backward_s"] / (3 * fwd / rate)
    assert {r["optimizer"] for r in steps} >= set(cost.optimizer_steps())
    for r in steps:  # geoopt's steps have no FLOP model: no multiple
        known = r["optimizer"] in cost.optimizer_steps()
        model = _step_model(r["optimizer"], 32, r["M"]) if known else math.nan
        r["step_x_gemm"] = r["step_s"] / (model / rate)
    # the markdown tables: one row per map × L/n, one per step, with the column
    md = (tmp_path / "complexity.md").read_text()
    assert "Forward+backward FLOPs here: 3× forward (" in md  # the caption names the basis
    md_maps = _md_rows(md, "| method |")
    assert {r["method"] for r in md_maps} == set(parametrizations.maps())
    for row in md_maps:
        frac = 0.5 if row["L"] == "L = 0.5·n" else 1.0
        r = next(r for r in maps if r["method"] == row["method"] and r["fraction"] == frac)
        assert float(row["fwd × FLOPs at GEMM rate"]) == approx(r["forward_x_gemm"], rel=5e-3)
        got = float(row["fwd+bwd × FLOPs at GEMM rate"])
        assert got == approx(r["forward_backward_x_gemm"], rel=5e-3)
    md_steps = {r["optimizer"]: r for r in _md_rows(md, "| optimizer |")}
    assert set(md_steps) >= set(cost.optimizer_steps())
    for r in steps:
        cell = md_steps[r["optimizer"]]["step × FLOPs at GEMM rate"]
        if math.isnan(r["step_x_gemm"]):
            assert cell == "–"
        else:
            assert float(cell) == approx(r["step_x_gemm"], rel=5e-3)


class _ProjectingSGD(torch.optim.Optimizer):
    """A plugin that projects onto St after each step but declares nothing."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(torch.linalg.qr(p - group["lr"] * p.grad)[0])


def test_section_says_which_optimizers_it_leaves_out(tmp_path, monkeypatch, capsys):
    from stiefel.optimizers import registry

    saved = registry.OPTIMIZERS.snapshot()
    try:
        optimizers.register("projecting_plugin")(_ProjectingSGD)
        assert not optimizers.info("projecting_plugin").riemannian
        left = complexity.left_out_steps()
        assert "projecting_plugin" in left and complexity.LEFT_OUT == "not declared riemannian=True"
        # exactly the registered optimizers that the steps table does not measure
        stepped = {info.name for info, _ in cost.optimizer_steps().values()}
        assert set(left) == set(optimizers.available()) - stepped
        ticks = itertools.count(1)
        fake = lambda fn, *a, **k: 1e-3 * next(ticks)  # noqa: E731
        monkeypatch.setattr(cost, "fastest_time", fake)
        monkeypatch.setattr(complexity, "fastest_time", fake)
        argv = ["complexity", "--out", str(tmp_path), "--sizes", "4", "--fractions", "1"]
        cli.main(argv + ["--repeats", "1", "--shapes", "8x2"])
    finally:
        registry.OPTIMIZERS.restore(saved)
    steps = {r["strategy"] for r in table.read(tmp_path, task="steps")}
    assert not any(s.startswith("projecting_plugin") for s in steps)
    md = (tmp_path / "complexity.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("Optimizers left out: "))
    assert (
        "projecting_plugin" in line
        and "adam" in line
        and line.endswith("(not declared riemannian=True).")
    )
    assert "rgd" not in line.replace("(", " ").split()  # a stepped one is not listed
    out = capsys.readouterr().out
    assert "complexity: left out: " in out and "projecting_plugin" in out
