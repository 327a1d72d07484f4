"""The benchmark scripts (benchmarks/, not installed) run end to end on tiny sizes.

No timing assertions; the wheel holds no benchmark script.
"""

import importlib
import json
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    """The benchmarks package of this checkout (imported as ``python -m benchmarks.X`` would)."""
    sys.path.insert(0, str(ROOT))
    try:
        yield {
            n: importlib.import_module(f"benchmarks.{n}")
            for n in ("_timing", "maps", "optimizers", "precision", "init", "square", "batched")
        }
    finally:
        sys.path.remove(str(ROOT))


TINY_MAPS = [
    "--quick",
    "--sizes",
    "8,16",
    "--stiefel",
    "32x4",
    "--rollout",
    "3,16",
    "--repeats",
    "1",
    "--budget",
    "0",
]


def _positive(x) -> bool:
    return isinstance(x, float) and x > 0


def test_measure_counts_runs(bench):
    _timing = bench["_timing"]
    calls = []
    t = _timing.measure(lambda: calls.append(1), repeats=4, budget_s=10.0, warmup=2)
    assert t.runs == 4 and not t.cold and t.seconds >= 0
    assert len(calls) == 2 + 4
    # a call slower than the budget is timed once (the cold first call)
    t = _timing.measure(lambda: calls.append(1), repeats=4, budget_s=0.0, cold_s=0.0)
    assert t.runs == 1 and t.cold
    assert _timing.fmt_ratio(None) == "—" and _timing.fmt_ratio(12.345) == "12.3x"


def test_median_time_ends_warmup_after_a_slow_call(bench, monkeypatch):
    from stiefel.comparisons import cost as timing

    _timing = bench["_timing"]
    calls = []

    def timed(fn):
        calls.append(1)
        return 2.0  # every call "takes" two seconds

    monkeypatch.setattr(timing, "timed", timed)
    assert _timing.median_time(lambda: None, repeats=3, warmup=2) == 2.0
    assert len(calls) == 1 + 3  # one warm-up call, then the three timed ones
    calls.clear()
    monkeypatch.setattr(timing, "timed", lambda fn: calls.append(1) or 0.5)
    _timing.median_time(lambda: None, repeats=3, warmup=2)
    assert len(calls) == 2 + 3  # fast calls: the full warm-up


def test_maps_quick(bench, tmp_path, capsys):
    maps = bench["maps"]
    pytest.importorskip("geotorch")
    out = tmp_path / "maps.json"
    text = maps.main([*TINY_MAPS, "--json", str(out)])
    assert capsys.readouterr().out.strip() == text.strip()
    for title in ("O(8)", "O(16)", "St(32, 4)", "RNN rollout", "Targets (issue 3)"):
        assert title in text
    data = json.loads(out.read_text())
    names = {r["name"] for r in data["square"]}
    assert {"householder", "cwy", "exp", "cayley", *maps.ANCHORS} <= names
    # three reflection counts n/16, n/4, n per reflection map and size
    assert sorted(r["L"] for r in data["square"] if r["name"] == "cwy" and r["n"] == 16) == [
        1,
        4,
        16,
    ]
    for r in data["square"] + data["stiefel"]:
        assert _positive(r["fwd_s"]) and _positive(r["fwd_bwd_s"]), r
    assert {r["name"] for r in data["stiefel"]} >= {"tcwy", maps.GEO_EXP, maps.GEO_CAY}
    roll = {r["name"] for r in data["rollout"]}
    assert len(roll) == 6 and "cwy step = W.operator() once per rollout" in roll
    assert all(_positive(r["fwd_bwd_s"]) for r in data["rollout"])
    assert len(data["targets"]) == 7
    assert all(t["measured"] is None or t["measured"] > 0 for t in data["targets"])
    assert all(t["met"] in (True, False) for t in data["targets"])


def test_optimizers_quick(bench, tmp_path, capsys):
    optimizers = bench["optimizers"]
    out = tmp_path / "opt.json"
    argv = ["--quick", "--shapes", "16x2,8x8", "--repeats", "1", "--budget", "0"]
    text = optimizers.main([*argv, "--json", str(out)])
    assert capsys.readouterr().out.strip() == text.strip()
    for title in ("St(16, 2)", "O(8)", "Targets (issues 4 and 16)"):
        assert title in text
    data = json.loads(out.read_text())
    rows = data["results"]
    expected = set(optimizers.OURS) | set(optimizers.GEOOPT)
    for label in ("St(16, 2)", "O(8)"):
        assert {r["name"] for r in rows if r["manifold"] == label} == expected
    assert all(_positive(r["step_s"]) for r in rows)
    assert all(r["orthogonality_error"] < 1e-2 for r in rows)
    # issue 4: two ratios ≥ 150 on the first shape, radam / rgd ≤ 2 per shape;
    # issue 16: the QR step / geoopt's Euclidean step ≤ 1 per shape
    assert [t["goal"] for t in data["targets"]] == [150, 150, 2, 2, 1, 1]


def test_precision_quick(bench, tmp_path, capsys):
    """Every registered map and Riemannian optimizer variant, timed in float32 and bfloat16."""
    import math

    import torch

    from stiefel import optimizers
    from stiefel.parametrizations import maps

    precision = bench["precision"]
    out = tmp_path / "precision.json"
    text = precision.main(
        ["--quick", "--n", "8", "--repeats", "1", "--budget", "0", "--json", str(out)]
    )
    assert capsys.readouterr().out.strip() == text.strip()
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["maps"]] == list(maps())
    riemannian = [n for n in optimizers.available() if optimizers.info(n).riemannian]
    variants = sum(len(optimizers.info(n).variants) for n in riemannian)
    assert len(data["optimizers"]) == variants
    assert {r["name"].split("(")[0] for r in data["optimizers"]} == set(riemannian)
    bound = math.sqrt(8) * torch.finfo(torch.bfloat16).eps  # a stored bfloat16 point
    for r in data["maps"] + data["optimizers"]:
        assert _positive(r["float32"]) and _positive(r["bfloat16"]), r
        assert math.isclose(r["ratio"], r["bfloat16"] / r["float32"])
        assert r["bfloat16_error"] <= bound and r["float32_error"] < 1e-4, r
        assert f"| {r['name']} |" in text


def test_init_quick(bench, capsys):
    init = bench["init"]
    text = init.main(["--quick", "--sizes", "8,12", "--threads", "1"])
    assert capsys.readouterr().out.strip() == text.strip()
    rows = [
        line for line in text.splitlines() if line.startswith("| 8 ") or line.startswith("| 12 ")
    ]
    assert len(rows) == 2
    for row in rows:
        cells = row.strip("|").split("|")
        assert len(cells) == 9 and all(c.strip() for c in cells)
    with pytest.raises(SystemExit):
        init.main(["--sizes", "0"])
    with pytest.raises(SystemExit):
        init.main(["--inits", "nearest,qr"])
    text = init.main(["--sizes", "8", "--inits", "haar", "--threads", "1"])
    cells = [c.strip() for c in text.splitlines()[-1].strip("|").split("|")]
    assert cells[1] == "nan s" and cells[4] != "nan s"  # nearest left out, haar timed


def test_square_quick(bench, tmp_path, capsys):
    """O(n) and U(n): every step timed (geoopt's complex QR failure reported), drift measured."""
    square = bench["square"]
    out = tmp_path / "square.json"
    text = square.main(["--quick", "--json", str(out)])
    assert capsys.readouterr().out.strip().endswith(text.strip())
    data = json.loads(out.read_text())
    assert [(r["n"], r["dtype"]) for r in data["results"]] == [
        (16, "float32"),
        (32, "float32"),
        (16, "complex64"),
        (32, "complex64"),
    ]
    for r in data["results"]:
        assert set(r["step"]) == {square._label(*v) for v in square.OURS} | {
            square.GEO_QR,
            square.GEO_CAYLEY,
        }
        for label in r["step"]:
            if label.startswith("rgd"):  # ours: timed, and on the manifold after 20 steps
                assert _positive(r["step"][label]) and r["drift"][label] < 1e-5, (r, label)
        if r["dtype"] == "complex64":  # geoopt's QR retraction takes the sign of a complex R
            assert r["step"][square.GEO_QR].startswith("fails: NotImplementedError")
        else:
            assert _positive(r["step"][square.GEO_QR])
    # per size and dtype: four step ratios, and a drift target per float32 step of ours
    assert len(data["targets"]) == 4 * 4 + 2 * 4
    assert "Targets (issue 16)" in text


def test_batched_quick_reports_the_steps_run(bench, capsys):
    batched = bench["batched"]
    batched.main(["--quick", "--slow-s", "0"])  # every row stops after its timed steps
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "(sgd)" in line]
    assert len(rows) == 4 and all(r[-3] == "9" for r in rows)  # "steps": the 9 timed
    batched.main(["--quick", "--slow-s", "0", "--problems", "O"])
    out = capsys.readouterr().out
    assert "O(64), batch" in out and "St(64, 16)" not in out
    with pytest.raises(SystemExit):
        batched.main(["--quick", "--problems", "SO"])
    assert "allowed: St, O" in capsys.readouterr().err


def test_device_option_of_the_gpu_benchmarks(bench, capsys):
    # issue 16's GPU runs: --device of batched and precision (cuda when present)
    timing, batched = bench["_timing"], bench["batched"]
    assert timing.device_of(None) == torch.device("cpu")
    assert timing.device_of("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="allowed: cpu, cuda"):
        timing.device_of("tpu")
    with pytest.raises(ValueError, match="allowed: cpu, cuda"):
        timing.device_of("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            timing.device_of("cuda")
    batched.main(["--quick", "--slow-s", "0", "--problems", "O", "--device", "cpu"])
    assert "cpu" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--device 'meta'"):
        batched.main(["--quick", "--device", "meta"])


def test_wheel_holds_no_benchmark(tmp_path):
    """The wheel built from this checkout has the harness and its presets, but no benchmark
    script and no experiment (both run from a checkout)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, src, ignore=ignore)  # build outside the checkout: no build/ left there
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-q", "-w", str(tmp_path)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("stiefel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "stiefel/comparisons/cli.py" in names and "stiefel/comparisons/cost.py" in names
    presets = sorted(n for n in names if n.startswith("stiefel/configs/"))
    assert presets == ["stiefel/configs/defaults.toml", "stiefel/configs/quick.toml"]
    assert not [n for n in names if "experiments/" in n]
    bad = [n for n in names if "benchmarks/" in n or "/bench/" in n or "bench" in n.split("/")[-1]]
    assert bad == [], bad
