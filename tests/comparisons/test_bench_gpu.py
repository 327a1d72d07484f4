"""The GPU run's scripts (benchmarks.cwy, benchmarks.syncs, benchmarks.gpu) on the CPU, tiny sizes.

No timing assertions: what is checked is that the compared methods compute the
same matrix, that the profiler counts host reads, and that the run's report
keeps every finished step when one is stopped.
"""

import importlib
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))
    try:
        yield {n: importlib.import_module(f"benchmarks.{n}") for n in ("cwy", "syncs", "gpu")}
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.parametrize("n, L", [(12, 3), (12, 12)])
def test_cwy_rows_compare_the_same_matrix(bench, n, L):
    """CWY, sequential and blocked Householder, built as the benchmark builds them, agree."""
    common = importlib.import_module("benchmarks._maps_common")
    q = {
        name: common.ours(method, (n, n), L, torch.Generator().manual_seed(n), **extra)[0]()
        for name, method, extra in [
            ("cwy", "cwy", {}),
            ("sequential", "householder", {"block": 1}),
            ("blocked", "householder", {}),
        ]
    }
    tol = 50 * n * torch.finfo(torch.float32).eps
    assert torch.allclose(q["sequential"], q["cwy"], atol=tol)
    assert torch.allclose(q["blocked"], q["cwy"], atol=tol)
    assert not torch.allclose(q["cwy"], torch.eye(n), atol=0.1)  # a random point, not I


def test_cwy_quick_prints_every_method_and_the_paper_claim(bench, capsys):
    text = bench["cwy"].main(["--quick", "--sizes", "8"])
    for name in ("cwy", "householder, block 1", "torch householder"):
        assert f"| {name} |" in text
    assert "Table 4" in text
    with pytest.raises(SystemExit):
        bench["cwy"].main(["--sizes", "0"])
    assert "comma-separated positive integers" in capsys.readouterr().err


def test_syncs_counts_host_reads(bench):
    x = torch.randn(8)
    cpu = torch.device("cpu")
    assert bench["syncs"].counts(lambda: (x * 2).sum(), cpu)["item"] == 0
    assert bench["syncs"].counts(lambda: (x.sum().item(), bool(x.max() > 0)), cpu)["item"] == 2


def test_syncs_table_has_a_row_per_registered_map_and_optimizer(bench):
    from stiefel import optimizers
    from stiefel.parametrizations import maps

    text = bench["syncs"].main(["--n", "8", "--stiefel", "16x4"])
    for name in maps():
        assert f"| map {name} |" in text
    for name in optimizers.available():
        assert f"| step {name} |" in text


def test_gpu_run_writes_the_report_and_keeps_finished_steps(bench, tmp_path, capsys):
    gpu = bench["gpu"]
    argv = ["--device", "cpu", "--quick", "--only", "cwy,roofline", "--out", str(tmp_path)]
    done = gpu.main(argv)
    assert [d["rc"] for d in done] == [0, 0]
    report = (tmp_path / "report.md").read_text()
    assert "## CWY against sequential Householder" in report and "| cwy | 0 |" in report
    # the harness's complexity.md, written in a scratch folder, is shown in the report
    assert "memory bandwidth" in report and "× roofline" in report
    # a step past its limit is stopped (children too) and recorded, not lost
    rc, text = gpu._run_process(
        [sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"], 2
    )
    assert rc == "timeout" and text.startswith("x") and "stopped after 2 s" in text
    for bad in (["--only", "nope"], ["--limit-s", "0"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            gpu.main(["--out", str(tmp_path), *bad])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cwy_and_syncs_on_cuda(bench):
    """On a GPU: the CWY rows agree there too, and the profile sees the device's copies."""
    common = importlib.import_module("benchmarks._maps_common")
    gen = torch.Generator().manual_seed(0)
    cwy = common.ours("cwy", (16, 16), 16, gen, "cuda")[0]()
    gen = torch.Generator().manual_seed(0)
    seq = common.ours("householder", (16, 16), 16, gen, "cuda", block=1)[0]()
    assert cwy.is_cuda and torch.allclose(cwy, seq, atol=800 * torch.finfo(torch.float32).eps)
    x = torch.randn(8, device="cuda")
    c = bench["syncs"].counts(lambda: x.sum().item(), torch.device("cuda"))
    assert c["item"] == 1 and c["D→H"] == 1
