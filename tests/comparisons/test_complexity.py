"""The complexity section's measuring tools: peak memory, the measurement plans, and the
measured time as a multiple of the FLOP model at the GEMM rate and of the roofline."""

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


# ------------------------------------------------------- × FLOPs at GEMM rate, × roofline
def approx(x, rel: float = 1e-6):
    """pytest.approx that also matches NaN with NaN (a map or step without a FLOP model)."""
    return pytest.approx(x, rel=rel, nan_ok=True)


def _map_model(name: str, n: int, L: int, kind: str = "flops") -> float:
    """Forward FLOPs (or float32 bytes) of map ``name`` read from its class (not the harness)."""
    cls = parametrizations.maps()[name]
    args = (n, n, L if cls.takes_reflections() else None)
    return float(cls.flops(*args) if kind == "flops" else cls.bytes(*args, itemsize=4))


def _step_model(label: str, n: int, m: int, kind: str = "flops") -> float:
    info, variant = cost.optimizer_steps()[label]
    if kind == "bytes":
        return float(optimizers.info(info.name).step_bytes(n, m, 4, **variant))
    model = optimizers.info(info.name).step_flops
    return math.nan if model is None else float(model(n, m, **variant))


def _by_hand(seconds: float, flops: float, nbytes: float, rate: float, bw: float):
    """(× GEMM, × roofline, bound) computed directly from the definitions."""
    if not (flops > 0 and nbytes > 0):  # NaN or no model: nothing to divide by
        return math.nan, math.nan, "–"
    t_flops, t_bytes = flops / rate, nbytes / bw
    return (
        seconds / t_flops,
        seconds / max(t_flops, t_bytes),
        max(("flops", t_flops), ("bytes", t_bytes), key=lambda kv: kv[1])[0],
    )


def test_multiples_are_time_over_model_time_for_every_map_and_step():
    # a bandwidth at which some rows are FLOP-bound and others bytes-bound
    rate, bw = 3.0e10, 2.0e9
    maps = [
        {"method": name, "n": 64, "L": 16, "forward_s": 0.01 * k, "forward_backward_s": 0.05 * k}
        for k, name in enumerate(parametrizations.maps(), start=1)
    ]
    steps = [
        {"optimizer": label, "N": 256, "M": 8, "step_s": 0.002 * k}
        | {"flops": _step_model(label, 256, 8), "bytes": _step_model(label, 256, 8, "bytes")}
        for k, label in enumerate(cost.optimizer_steps(), start=1)
    ]
    for r in maps:
        r.update(flops=_map_model(r["method"], 64, 16))
        r.update(bytes=_map_model(r["method"], 64, 16, "bytes"))
    before = json.dumps([maps, steps])
    out_maps, out_steps = complexity.with_multiples(maps, steps, rate, bw)
    assert json.dumps([maps, steps]) == before  # the inputs are left as they were
    assert [r["method"] for r in out_maps] == list(parametrizations.maps())
    bounds = set()
    for r in out_maps:
        fwd, fwd_b = _map_model(r["method"], 64, 16), _map_model(r["method"], 64, 16, "bytes")
        # forward+backward is charged 3× the forward FLOPs and bytes
        assert r["forward_backward_flops"] == approx(3 * fwd, rel=1e-12)
        assert r["forward_backward_bytes"] == approx(3 * fwd_b, rel=1e-12)
        for t, k in (("forward", 1), ("forward_backward", 3)):
            x_gemm, x_roof, bound = _by_hand(r[f"{t}_s"], k * fwd, k * fwd_b, rate, bw)
            assert r[f"{t}_x_gemm"] == approx(x_gemm, rel=1e-12)
            assert r[f"{t}_x_roofline"] == approx(x_roof, rel=1e-12)
            assert r[f"{t}_roofline_s"] == approx(r[f"{t}_s"] / x_roof, rel=1e-12)
            assert r[f"{t}_bound"] == bound
            bounds.add(bound)
    assert [r["optimizer"] for r in out_steps] == list(cost.optimizer_steps())
    for r in out_steps:
        model = _step_model(r["optimizer"], 256, 8)
        nbytes = _step_model(r["optimizer"], 256, 8, "bytes")
        x_gemm, x_roof, bound = _by_hand(r["step_s"], model, nbytes, rate, bw)
        assert r["step_x_gemm"] == approx(x_gemm, rel=1e-12)
        assert r["step_x_roofline"] == approx(x_roof, rel=1e-12)
        assert r["step_bound"] == bound
        bounds.add(bound)
    assert bounds >= {"flops", "bytes"}  # both branches of the max were exercised


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


def _fake_timer(flagged=()):
    """A timer whose k-th measurement takes k ms (so forward, forward+backward and steps
    differ), flagged (± 0.5 ms) at the k in ``flagged``."""
    ticks = itertools.count(1)

    def measure(fn, *a, **k):
        t = next(ticks)
        why = "spread 0.5 (test)" if t in flagged else None
        return dict(s=1e-3 * t, cpu_s=1e-3 * t, wall_s=1e-3 * t, mad_s=5e-4, fastest_s=1e-3 * t,
                    flag=why)  # fmt: skip

    return measure


def _fake_timers(monkeypatch, flagged=()):
    """`_fake_timer` as `cost.measure` (the GEMM rate's, the bandwidth's) and, call by
    call in the order given, as the interleaved `measure_many` of the maps and steps."""
    monkeypatch.setattr(cost, "measure", _fake_timer(flagged))
    many = lambda fns, *a, **k: {key: cost.measure(fn) for key, fn in fns.items()}  # noqa: E731
    monkeypatch.setattr(complexity, "measure_many", many)


def test_section_writes_the_columns_to_the_table_and_markdown(tmp_path, monkeypatch):
    _fake_timers(monkeypatch)
    stream = cost.stream_bandwidth
    monkeypatch.setattr(cost, "stream_bandwidth", lambda device: stream(device, mib=1))
    argv = ["complexity", "--out", str(tmp_path), "--sizes", "8", "--fractions", "0.5", "1"]
    cli.main(argv + ["--repeats", "1", "--shapes", "32x4"])
    (rate,) = [r["value"] for r in table.read(tmp_path, task="gemm")]
    assert rate == approx(2 * 512**3 / 1e-3)  # the first timing: the GEMM rate's
    (bw,) = [r["value"] for r in table.read(tmp_path, task="bandwidth")]
    assert bw == approx(3 * 2**20 / 2e-3)  # the second: three 1 MiB arrays
    maps, steps = _rows(tmp_path, "maps"), _rows(tmp_path, "steps")
    assert {r["method"] for r in maps} == set(parametrizations.maps())
    want = {}  # (map / step, size) → (× GEMM, × roofline, bound) from the table's raw times
    for r in maps:
        fwd, fwd_b = _map_model(r["method"], 8, r["L"]), _map_model(r["method"], 8, r["L"], "bytes")
        assert r["forward_s"] != r["forward_backward_s"]
        assert (r["flops"], r["bytes"]) == (approx(fwd), approx(fwd_b))
        reflections = parametrizations.maps()[r["method"]].takes_reflections()
        L = f" L = {r['fraction']:g}·n" if reflections else ""
        for t, name, k in (("forward", "fwd", 1), ("forward_backward", "fwd+bwd", 3)):
            case = (f"{r['method']}{L}, {name}", "n = 8")
            want[case] = _by_hand(r[f"{t}_s"], k * fwd, k * fwd_b, rate, bw)
    assert {r["optimizer"] for r in steps} >= set(cost.optimizer_steps())
    for r in steps:  # geoopt's steps have no models: no multiples
        known = r["optimizer"] in cost.optimizer_steps()
        model = _step_model(r["optimizer"], 32, r["M"]) if known else math.nan
        nbytes = _step_model(r["optimizer"], 32, r["M"], "bytes") if known else math.nan
        want[(r["optimizer"], "St(32, 4)")] = _by_hand(r["step_s"], model, nbytes, rate, bw)
    md = (tmp_path / "complexity.md").read_text()
    assert f"memory bandwidth: {bw / 1e9:.1f} GB/s" in md.splitlines()[0]  # the intro
    got = {(r["map / step"], r["size"]): r for r in _md_rows(md, "| map / step |")}
    assert set(got) == set(want)  # every map × L/n × (fwd, fwd+bwd) and every step
    for case, (x_gemm, x_roof, bound) in want.items():
        row = got[case]
        assert row["bound"] == bound
        for cell, value in ((row["× FLOPs at GEMM rate"], x_gemm), (row["× roofline"], x_roof)):
            assert (
                cell == "–"
                if math.isnan(value)
                else float(cell.replace(",", "")) == approx(value, rel=5e-3)
            )


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
        _fake_timers(monkeypatch)
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
