"""The benchmark scripts (benchmarks/, not installed) run end to end on tiny sizes.

No timing assertions; the wheel holds no benchmark script.
"""

import importlib
import json
import mmap
import pathlib
import platform
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from stiefel.parametrizations.kernels import UNPIVOTED_BLOCKS_FROM

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules of this checkout, by name."""
    names = "_timing maps optimizers precision init square batched layers skew_cayley woodbury"
    names += " right_solve cayley_solve expm drift_seeds"
    return {n: importlib.import_module(f"stiefel.benchmarks.{n}") for n in names.split()}


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


def test_tables_escape_bars_and_headers_name_the_peers(bench):
    """A ``|`` inside a cell is escaped (markdown reads a bare one as a border); ratios
    keep two significant digits; a header names the compared libraries' versions."""
    import importlib.metadata

    _timing = bench["_timing"]
    text = _timing.table(["n", "max |Δ|"], [[1, "a|b"]])
    assert text.splitlines()[0] == "| n | max \\|Δ\\| |" and "| 1 | a\\|b |" in text
    assert [_timing.fmt_ratio(x) for x in (0.0912, 0.5, 12.345)] == ["0.091x", "0.50x", "12.3x"]
    assert [_timing.fmt_sig(x) for x in (0.0912, 1.234, 123.4)] == ["0.091", "1.2", "123"]
    line = _timing.header("T", peers=("torch", "no-such-dist"))
    assert line.endswith(
        f"; torch {importlib.metadata.version('torch')}, no-such-dist not installed"
    )
    assert "interleaved rounds" in _timing.rounds_line(5) and "5" in _timing.rounds_line(5)


def test_interleaved_rounds_give_every_call_both_neighbours(bench):
    """A fixed cyclic order times each call always after the same other one (whose pass
    over its data evicts this one's from the caches): the order alternates."""
    _timing = bench["_timing"]
    keys = ["a", "b", "c", "d"]
    order = _timing.schedule(keys, 8)
    assert sorted(order) == sorted(keys * 8)
    for r in range(8):  # every key once per round
        assert sorted(order[4 * r : 4 * r + 4]) == keys
    before = {k: {p for p, q in zip(order, order[1:], strict=False) if q == k} for k in keys}
    neighbours = {k: {keys[(i - 1) % 4], keys[(i + 1) % 4]} for i, k in enumerate(keys)}
    for k in keys:
        assert neighbours[k] <= before[k], (k, before[k])
    assert {order[4 * r] for r in range(8)} == set(keys)  # each key comes first in turn
    two = _timing.schedule(["a", "b"], 4)
    pairs = set(zip(two, two[1:], strict=False))
    assert {two[0], two[2], two[4], two[6]} == {"a", "b"} and {("a", "b"), ("b", "a")} <= pairs
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in keys}
    times = _timing.rounds(fns, 8, lambda f: f() or 1.0)
    assert calls == keys + order and all(v == [1.0] * 8 for v in times.values())


def test_median_time_ends_warmup_after_a_slow_call(bench, monkeypatch):
    from stiefel.comparisons import cost as timing

    _timing = bench["_timing"]
    calls = []

    def block(fn, n=1, seconds=2.0):
        calls.append(n)
        return seconds, seconds  # every call "takes" ``seconds`` on both clocks

    monkeypatch.setattr(timing, "_block", block)
    assert _timing.median_time(lambda: None, repeats=3, warmup=2) == 2.0
    assert calls == [1] * (1 + 3)  # one warm-up call, then the three timed ones
    calls.clear()
    monkeypatch.setattr(timing, "_block", lambda fn, n=1: block(fn, n, 0.5))
    _timing.median_time(lambda: None, repeats=3, warmup=2)
    assert calls == [1] * (2 + 3)  # fast calls: the full warm-up


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
    with pytest.raises(SystemExit):
        init.main(["--rounds", "0"])
    text = init.main(["--sizes", "8", "--inits", "haar", "--threads", "1", "--rounds", "2"])
    assert text.splitlines()[0].startswith(
        "orthogonalize(Linear(n, n), method='householder') — torch"
    )
    assert "median of 2 rounds" in text
    cells = [c.strip() for c in text.splitlines()[-1].strip("|").split("|")]
    assert cells[1] == "—" and cells[4] != "—"  # nearest left out, haar timed
    assert cells[4].endswith(("s", "ms", "µs")) and not cells[4].startswith("0.00")


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


def _batched_quick(batched, *argv: str) -> None:
    """``benchmarks.batched --quick`` in this process with glibc's own malloc settings
    (``--malloc keep`` would change pytest's allocator for the rest of the session)."""
    batched.main(["--quick", *argv, "--malloc", "default"])


def test_batched_quick_reports_the_steps_run(bench, capsys):
    batched = bench["batched"]
    _batched_quick(batched, "--slow-s", "0")  # every row stops after its rounds' steps
    out = capsys.readouterr().out
    assert "malloc: default" in out
    rows = [line.split() for line in out.splitlines() if "(sgd)" in line]
    assert len(rows) == 4 and all(r[-3] == "18" for r in rows)  # "steps": 2 rounds of 9
    header = next(line.split() for line in out.splitlines() if "optimizer" in line)
    assert header[-4:] == ["faults", "steps", "drift", "loss"]
    assert all(float(r[-4]) >= 0 and float(r[-5]) > 0 for r in rows)  # faults, × pogo-torch
    assert "median of 2 interleaved rounds of the mean of 8 steps" in out
    # the fast rows run on to --steps
    _batched_quick(batched, "--problems", "O", "--steps", "25")
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "(sgd)" in line]
    assert len(rows) == 2 and all(r[-3] == "25" for r in rows)
    _batched_quick(batched, "--slow-s", "0", "--problems", "O")
    out = capsys.readouterr().out
    assert "O(64), batch" in out and "St(64, 16)" not in out
    with pytest.raises(SystemExit):
        _batched_quick(batched, "--problems", "SO")
    assert "allowed: St, O" in capsys.readouterr().err


def test_batched_counts_the_page_faults_of_fresh_memory(bench):
    # an anonymous mapping is backed at first touch: one minor fault per page at least
    pages = 256
    size = pages * mmap.PAGESIZE
    with mmap.mmap(-1, size) as buf:
        before = bench["batched"].minor_faults()
        for k in range(0, size, mmap.PAGESIZE):
            buf[k] = 1
        assert bench["batched"].minor_faults() - before >= pages


_KEEP_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from benchmarks.batched import keep_freed_memory, minor_faults
def work(size=4 << 20):  # four 16 MiB temporaries, freed together: glibc trims (or unmaps) them
    ts = [torch.ones(size) for _ in range(4)]
    del ts
def faults(size=4 << 20):
    work(size)
    work(size)
    before = minor_faults()
    for _ in range(3):
        work(size)
    return minor_faults() - before
print(faults(), keep_freed_memory(), faults(), faults(16 << 20), sep="|")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's settings are glibc's")
def test_batched_keeps_freed_memory_so_steps_stop_faulting():
    # in a fresh process (mallopt's settings stay for the process's life): with glibc's
    # defaults the pages of freed 16 MiB temporaries fault again on every reuse, and
    # after keep_freed_memory() they do not
    out = subprocess.run(
        [sys.executable, "-c", _KEEP_SCRIPT, str(ROOT)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    before, kept, after, large = out.stdout.strip().split("|")
    pages = 3 * 4 * (16 << 20) // mmap.PAGESIZE
    assert kept.startswith("keep (blocks up to") and "refused" not in kept, kept
    assert float(before) > pages // 10 and float(after) < pages // 100
    # 64 MiB temporaries (geoopt's canonical step on the St batch) stay too, where glibc
    # takes the larger limit: a tenth of their pages fault at most (the default: all)
    if kept == "keep (blocks up to 256 MiB from the heap)":
        assert float(large) < 4 * pages // 10


def test_batched_layouts_are_the_same_points_stored_two_ways(bench, capsys):
    batched = bench["batched"]
    col, row = (batched._haar(3, 8, 4, 0, layout) for layout in ("column", "row"))
    assert col.stride(-2) == 1 and row.is_contiguous()  # QR's Q by columns; a copy by rows
    assert torch.equal(col, row)
    _batched_quick(batched, "--slow-s", "0", "--problems", "St", "--layout", "row")
    assert "points stored by rows" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        batched.main(["--quick", "--layout", "rows"])
    assert "invalid choice: 'rows'" in capsys.readouterr().err


def test_drift_seeds_quick_compares_each_row_with_its_anchor_on_the_same_points(bench, capsys):
    drift_seeds = bench["drift_seeds"]
    rows = drift_seeds.main(["--quick"])
    assert [(r["problem"], r["row"], r["anchor"], r["seed"]) for r in rows] == [
        (p, row, anchor, seed)
        for p in ("St(64, 16)", "O(64)")
        for seed in (0, 1)
        for row, anchor in (
            ("pogo (sgd)", "pogo-torch (sgd)"), ("pogo (adam)", "pogo-torch (vector adam)"),
        )
    ]  # fmt: skip
    for r in rows:  # 20 float32 steps from Haar points: both near float32 rounding
        assert 0 < r["largest"] < 1e-4 and 0 < r["ref_largest"] < 1e-4
        assert r["largest_ratio"] == pytest.approx(r["largest"] / r["ref_largest"])
    assert "median matrix: ours / pogo-torch" in capsys.readouterr().out
    # an anchor against itself: the same steps from the same points, so exactly its drift
    # (a row started from other points or targets would differ by several per cent)
    same = drift_seeds.main(["--quick", "--problems", "O", "--rows", "pogo-torch (sgd)"])
    assert [r["seed"] for r in same] == [0, 1]
    for r in same:
        assert abs(r["largest_ratio"] - 1) < 1e-6 and abs(r["median_ratio"] - 1) < 1e-6
    for bad, says in (
        ("--seeds=0", "allowed: at least 1 each"),
        ("--rows=adam", "allowed: pogo-torch (sgd)"),
        ("--problems=U", "allowed: St, O"),
    ):
        with pytest.raises(SystemExit):
            drift_seeds.main(["--quick", bad])
        assert says in capsys.readouterr().err


def test_right_solve_quick_times_both_forms_against_a_float64_solve(bench, capsys):
    rows = bench["right_solve"].main(["--quick"])
    assert [(r["batch"], r["n"], r["m"], r["layout"]) for r in rows] == [
        (1, 512, 16, "row"), (1, 512, 16, "column"), (64, 32, 8, "row"), (64, 32, 8, "column"),
    ]  # fmt: skip
    for r in rows:
        assert _positive(r["solve"]) and _positive(r["inverse"])
        assert r["ratio"] == pytest.approx(r["inverse"] / r["solve"])
        assert r["r_rows_ratio"] == pytest.approx(r["solve_r_rows"] / r["solve"])
        # float32 against the float64 solve, R well conditioned: both to rounding
        assert r["solve_err"] < 1e-5 and r["inverse_err"] < 1e-5
    assert [r["used"] for r in rows] == ["inverse", "inverse", "solve", "solve"]  # N ≥ 8M
    out = capsys.readouterr().out
    assert "inverse / solve" in out and "R by rows / by columns" in out
    for bad, says in (
        ("--shapes=4*0x2", "allowed: positive sizes"),
        ("--shapes=4x2x2", "allowed: NxM"),
        ("--shapes=a*8x2", "[B*]NxM"),
        ("--layouts=diagonal", "allowed: row"),
    ):
        with pytest.raises(SystemExit):
            bench["right_solve"].main([bad])
        assert says in capsys.readouterr().err


def test_cayley_solve_quick_times_both_eliminations_against_a_float64_solve(bench, capsys):
    rows = bench["cayley_solve"].main(["--quick"])
    assert [r["n"] for r in rows] == [160, 256]
    for r in rows:
        for mode in ("forward", "fwd+bwd"):
            assert _positive(r[f"{mode} unpivoted"]) and _positive(r[f"{mode} pivoted"])
        # float32 at ‖A‖₁ just under the path's limit: both to the maps' 10·n·eps
        eps = torch.finfo(torch.float32).eps
        assert r["unpivoted err"] < 10 * r["n"] * eps and r["pivoted err"] < 10 * r["n"] * eps
        # the dispatcher's choice: the elimination from its size on, ‖A‖₁ within the limit
        assert r["used"] == ("unpivoted" if r["n"] >= UNPIVOTED_BLOCKS_FROM else "pivoted")
    out = capsys.readouterr().out
    assert "unpivoted / pivoted" in out and "fwd+bwd" in out
    for bad in ("--sizes=64", "--sizes=a"):
        with pytest.raises(SystemExit):
            bench["cayley_solve"].main([bad])
        assert "allowed: orders above 128" in capsys.readouterr().err


def test_expm_quick_times_both_exponentials_at_each_norm_against_float64(bench, capsys):
    rows = bench["expm"].main(["--quick"])
    # Note [Padé degree by the dtype's unit roundoff]: float32 degrees by ‖A‖₁; the
    # CPU solves by the LU (Note [The Padé solve of a skew-Hermitian A by device type])
    assert [(r["norm"], r["plan"]) for r in rows] == [
        (0.3, (3, 0, False)), (1.5, (5, 0, False)), (3.5, (7, 0, False)), (36.0, (13, 3, False)),
    ]  # fmt: skip
    eps = torch.finfo(torch.float32).eps
    for r in rows:
        for mode in ("forward", "fwd+bwd"):
            assert _positive(r[f"{mode} ours"]) and _positive(r[f"{mode} torch"])
        assert r["ours err"] < 10 * r["n"] * eps and r["torch err"] < 10 * r["n"] * eps
    assert "fwd+bwd ours / torch" in capsys.readouterr().out
    for bad in ("--norms=0", "--sizes=a"):
        with pytest.raises(SystemExit):
            bench["expm"].main([bad])
        assert "allowed: positive orders and positive norms" in capsys.readouterr().err


def test_skew_cayley_quick_times_both_paths_and_marks_the_rows_used(bench, capsys):
    rows = bench["skew_cayley"].main(["--quick", "--radii", "0.01,0.5"])
    assert [(r["n"], r["r"]) for r in rows] == [(16, 0.01), (16, 0.5), (64, 0.01), (64, 0.5)]
    for r in rows:
        assert _positive(r["series"]) and _positive(r["solve"])
        # float32 against the float64 solve: both paths to rounding, a row not used too
        assert r["series_err"] < 1e-5 and r["solve_err"] < 1e-5
        assert r["used"] == (r["r"] == 0.01)  # 0.5 needs four factors in float32
    assert rows[1]["factors"] == 4
    assert "series / solve" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench["skew_cayley"].main(["--device", "tpu"])


def test_woodbury_quick_times_both_paths(bench, capsys):
    rows = bench["woodbury"].main(["--quick", "--betas", "0.5,0.01"])
    assert [(r["batch"], r["n"], r["m"], r["beta"], r["transport"]) for r in rows] == [
        (256, 64, 16, 0.5, False),
        (256, 64, 16, 0.5, True),
        (256, 64, 16, 0.01, False),
        (256, 64, 16, 0.01, True),
        (1, 1024, 64, 0.5, False),
        (1, 1024, 64, 0.5, True),
        (1, 1024, 64, 0.01, False),
        (1, 1024, 64, 0.01, True),
    ]
    for r in rows:
        assert _positive(r["elimination"]) and _positive(r["lu"])
        # float32 against the float64 LU, relative to the largest entry: both to rounding
        assert r["elimination_err"] < 1e-5 and r["lu_err"] < 1e-5
    # the short step takes Euler's product for both blocks (Note [Near-identity blocks of
    # the elimination]); at |β| = ½ the Schur complement's bound is past the CPU's limit
    assert [r["series"] for r in rows if r["beta"] == 0.01] == ["T, S"] * 4
    assert {r["series"] for r in rows if r["beta"] == 0.5} == {"T"}
    assert "elim. / LU" in capsys.readouterr().out
    for bad in (["--device", "tpu"], ["--betas", "0"], ["--betas", "5"], ["--betas", "a"]):
        with pytest.raises(SystemExit):
            bench["woodbury"].main(bad)
    assert "--betas: expected comma-separated numbers in (0, 4]" in capsys.readouterr().err


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
    _batched_quick(batched, "--slow-s", "0", "--problems", "O", "--device", "cpu")
    assert "cpu" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        batched.main(["--quick", "--device", "meta"])
    assert "--device 'meta'" in capsys.readouterr().err


OPT_TINY = ["--quick", "--shapes", "16x2,8x8", "--repeats", "1", "--budget", "0"]


@pytest.mark.parametrize("script", ["optimizers", "layers", "precision", "batched"])
def test_a_bad_device_is_a_parser_error(bench, capsys, monkeypatch, script):
    """An unknown device, CUDA without one, and the thread clock on CUDA: usage errors."""
    main = bench[script].main
    bad = ["tpu", "meta"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])
    for value in bad:
        with pytest.raises(SystemExit) as exc:
            main(["--quick", "--device", value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"--device {value!r}" in err and "allowed: cpu" in err, err
    if script in ("optimizers", "layers", "batched"):  # refused before CUDA is touched
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(SystemExit):
            main(["--quick", "--device", "cuda", "--clock", "thread"])
        assert "--clock thread with --device cuda" in capsys.readouterr().err


def test_optimizers_device_cpu_is_the_default(bench, tmp_path, capsys):
    """``--device cpu`` steps the same points with the same gradients as no ``--device``."""
    optimizers = bench["optimizers"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    optimizers.main([*OPT_TINY, "--json", str(a)])
    text = optimizers.main([*OPT_TINY, "--device", "cpu", "--json", str(b)])
    assert bench["_timing"].device_name("cpu") in text.splitlines()[0]
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["config"]["device"] == rb["config"]["device"] == "cpu"
    assert [(r["name"], r["orthogonality_error"]) for r in ra["results"]] == [
        (r["name"], r["orthogonality_error"]) for r in rb["results"]
    ]


def _layers_out(layers, capsys, argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """(norm table rows, timing table rows as cells) of one quick run of benchmarks.layers."""
    threads = torch.get_num_threads()
    try:
        layers.main(argv)  # the thread clock sets one thread
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("FFT layer"))
    norms = [line for line in lines[:cut] if line.startswith("| ") and "min" not in line]
    timed = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in lines[cut:]
        if line.startswith("| c = ")
    ]
    return norms, timed


def test_layers_quick_on_the_cpu(bench, capsys):
    """Norm table (orthogonal layers at 1), every timed layer present or its reason given."""
    layers = bench["layers"]
    norms, timed = _layers_out(layers, capsys, ["--quick"])
    norms_cpu, timed_cpu = _layers_out(layers, capsys, ["--quick", "--device", "cpu"])
    assert norms == norms_cpu  # the same layers and inputs: identical ratios
    exact = ("k=1, circular", "OrthogonalConv2d", "circular, stride 1", "OrthogonalRNN")
    rows = {line.strip("|").split("|")[0].strip(): line for line in norms}
    assert len(rows) == 16
    for name, line in rows.items():
        if any(e in name for e in exact):  # an orthogonal map: ‖y‖ = ‖x‖ and ‖layer‖₂ = 1
            lo, hi, op = (float(c) for c in line.strip("|").split("|")[1:])
            assert lo == hi == op == 1.0, line
    for table in (timed, timed_cpu):
        assert [(r[0], r[1]) for r in table] == [
            (f"c = 8, 8×8, stride {s}", name) for s in (1, 2) for name in layers.layers_for(8, s)
        ]
        for setting, name, t, ratio in table:
            if "stride 2" in setting and "FFT" in name:
                assert t == "not run: stride 1 only" and ratio == "—"
            else:
                assert t.endswith(" ms") and float(t[:-3]) > 0 and float(ratio) > 0, (name, t)


@pytest.mark.slow
def test_layers_compiled_rows(bench, capsys):
    """``--compiled``: this package's layers also under torch.compile (Inductor), each timed."""
    layers = bench["layers"]
    _, timed = _layers_out(layers, capsys, ["--quick", "--skip-norms", "--compiled"])
    compiled = [(s, n, t) for s, n, t, _ in timed if n.endswith(", torch.compile")]
    assert [(s, n) for s, n, _ in compiled] == [
        (f"c = 8, 8×8, stride {s}", f"{name}, torch.compile")
        for s in (1, 2)
        for name in ("OrthoConv2d (explicit kernel, cwy)", "OrthogonalConv2d (FFT, cayley)")
    ]
    for setting, name, t in compiled:
        if "stride 2" in setting and "FFT" in name:
            assert t == "not run: stride 1 only"
        else:
            assert t.endswith(" ms") and float(t[:-3]) > 0, (name, t)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_benchmarks_on_cuda(bench, tmp_path, capsys):
    """On a GPU: the quick runs measure there (wall clock) and find the same CPU ratios."""
    optimizers, layers = bench["optimizers"], bench["layers"]
    out = tmp_path / "opt.json"
    text = optimizers.main([*OPT_TINY, "--device", "cuda", "--json", str(out)])
    assert torch.cuda.get_device_name() in text
    data = json.loads(out.read_text())
    assert data["config"]["device"] == "cuda"
    assert all(_positive(r["step_s"]) and r["orthogonality_error"] < 1e-2 for r in data["results"])
    capsys.readouterr()  # the optimizers' table is not the layers' output
    norms_cpu, _ = _layers_out(layers, capsys, ["--quick", "--device", "cpu"])
    layers.main(["--quick", "--device", "cuda"])
    out_cuda = capsys.readouterr().out
    assert "wall clock" in out_cuda and torch.cuda.get_device_name() in out_cuda
    rows_cpu = [line.strip("|").split("|") for line in norms_cpu]
    rows_cuda = [
        line.strip("|").split("|")
        for line in out_cuda.split("FFT layer")[0].splitlines()
        if line.startswith("| ") and "min" not in line
    ]
    assert [r[0] for r in rows_cuda] == [r[0] for r in rows_cpu], out_cuda
    for a, b in zip(rows_cpu, rows_cuda, strict=True):  # float64: the same ratios to 1e-5
        for x, y in zip(a[1:], b[1:], strict=True):
            assert x.strip() == y.strip() == "nan" or abs(float(x) - float(y)) < 1e-5, (a, b)


@pytest.mark.slow
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
    assert presets == [
        "stiefel/configs/defaults.toml",
        "stiefel/configs/learning_rates.toml",
        "stiefel/configs/quick.toml",
    ]
    assert not [n for n in names if "experiments/" in n]
    bad = [n for n in names if "benchmarks/" in n or "/bench/" in n or "bench" in n.split("/")[-1]]
    assert bad == [], bad


def test_launch_describes_equal_shapes_once_and_times_both_clocks_on_the_same_calls():
    launch = importlib.import_module("stiefel.benchmarks.launch")
    text = launch.describe(launch.SETS["transformer"], False)
    assert text == "12 × St(768, 256) + 12 × O(256) + 24 × St(1024, 256) (48 parameters)"
    calls = []
    clock = launch._both(torch.device("cpu"))
    cpu, wall = clock(lambda: calls.append(sum(range(20000))))
    assert len(calls) == 1 and 0 <= cpu and 0 < wall  # one call, both clocks around it
    name, hyper = launch.VARIANTS["manifold_muon (inner_steps=1)"]
    assert name == "manifold_muon" and hyper == {"inner_steps": 1}
    assert "manifold_muon (inner_steps=1)" in launch.candidates()
