"""The GPU run's scripts (benchmarks.cwy, benchmarks.syncs, benchmarks.gpu) on the CPU, tiny sizes.

No timing assertions: what is checked is that the compared methods compute the
same matrix, that the profiler counts host reads, and that the run's report
keeps every finished step when one is stopped.
"""

import importlib
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


bench = {n: importlib.import_module(f"stiefel.benchmarks.{n}") for n in ("cwy", "syncs", "gpu")}


@pytest.mark.parametrize("n, L", [(12, 3), (12, 12)])
def test_cwy_rows_compare_the_same_matrix(n, L):
    """CWY, sequential and blocked Householder, built as the benchmark builds them, agree."""
    common = importlib.import_module("stiefel.benchmarks._maps_common")
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


def test_cwy_quick_prints_every_method_and_the_paper_claim(capsys):
    text = bench["cwy"].main(["--quick", "--sizes", "8"])
    for name in ("cwy", "householder, block 1", "torch householder"):
        assert f"| {name} |" in text
    assert "Table 4" in text
    with pytest.raises(SystemExit):
        bench["cwy"].main(["--sizes", "0"])
    assert "comma-separated positive integers" in capsys.readouterr().err


def test_syncs_counts_host_reads_as_launch_does():
    """The reads column is benchmarks.launch's StepCounter: ``.tolist()`` counts too, and
    an optimizer's step counter on the CPU does not (one read per step of ours, as there)."""
    x = torch.randn(8)
    cpu = torch.device("cpu")
    counts = bench["syncs"].counts
    assert counts(lambda: (x * 2).sum(), cpu)["reads"] == 0
    assert counts(lambda: (x.sum().item(), bool(x.max() > 0)), cpu)["reads"] == 2
    assert counts(lambda: x[:3].tolist(), cpu)["reads"] == 1
    launch = importlib.import_module("stiefel.benchmarks.launch")
    for name in ("rgd", "landing"):
        fn, opt = bench["syncs"].step_call(name, (32, 4), cpu)
        assert counts(fn, cpu, opt)["reads"] == launch.counts(opt)[1] == 1, name


def test_syncs_table_has_a_row_per_registered_map_and_optimizer():
    from stiefel import optimizers
    from stiefel.parametrizations import maps

    text = bench["syncs"].main(["--n", "8", "--stiefel", "16x4"])
    for name in maps():
        assert f"| map {name} |" in text
    for name in optimizers.available():
        assert f"| step {name} |" in text
    assert "| call | reads | D→H | H→D | sync | error |" in text
    quick = bench["syncs"].main(["--quick"])
    assert "maps: forward+backward on 16×16; steps: St(64, 8)" in quick


def test_gpu_run_writes_the_report_and_keeps_finished_steps(tmp_path, capsys):
    gpu = bench["gpu"]
    done = gpu.main(["--device", "cpu", "--quick", "--only", "cwy", "--out", str(tmp_path)])
    assert [d["rc"] for d in done] == [0]
    report = (tmp_path / "report.md").read_text()
    assert "## CWY against sequential Householder" in report and "| cwy | 0 |" in report
    # a step past its limit is stopped (children too) and recorded, not lost
    rc, text = gpu._run_process(
        [sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"], 2
    )
    assert rc == "timeout" and text.startswith("x") and "stopped after 2 s" in text
    for bad in (["--only", "nope"], ["--limit-s", "0"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            gpu.main(["--out", str(tmp_path), *bad])


@pytest.mark.slow
def test_gpu_run_shows_the_harness_roofline_section(tmp_path):
    """The roofline step runs the harness in its own process (the slow tier: a second
    process of the run, the harness's whole complexity section)."""
    done = bench["gpu"].main(
        ["--device", "cpu", "--quick", "--only", "roofline", "--out", str(tmp_path)]
    )
    assert [d["rc"] for d in done] == [0]
    report = (tmp_path / "report.md").read_text()
    # the harness's complexity.md, written in a scratch folder, is shown in the report
    assert "memory bandwidth" in report and "× roofline" in report


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cwy_and_syncs_on_cuda():
    """On a GPU: the CWY rows agree there too, and the profile sees the device's copies."""
    common = importlib.import_module("stiefel.benchmarks._maps_common")
    gen = torch.Generator().manual_seed(0)
    cwy = common.ours("cwy", (16, 16), 16, gen, "cuda")[0]()
    gen = torch.Generator().manual_seed(0)
    seq = common.ours("householder", (16, 16), 16, gen, "cuda", block=1)[0]()
    assert cwy.is_cuda and torch.allclose(cwy, seq, atol=800 * torch.finfo(torch.float32).eps)
    x = torch.randn(8, device="cuda")
    c = bench["syncs"].counts(lambda: x.sum().item(), torch.device("cuda"))
    assert c["reads"] == 1 and c["D→H"] == 1


# ------------------------------------------------------------------ benchmarks/gpu.sh
# The script runs from a copy in a scratch tree, with a PATH whose python3, pip and
# nvidia-smi are stand-ins that log each call: nothing is created in the checkout, and
# no virtualenv or install can happen even if the script tried (the log shows it did).
GPU_SH = ROOT / "benchmarks" / "gpu.sh"
GPU_LISTED = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"


def _stub(path: pathlib.Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _gpu_sh(tmp_path, *args, gpu=False, cuda_python=False, launch=False, env=None):
    """Run a copy of gpu.sh; return (rc, stdout, stderr, logged calls, files made in the tree)."""
    tree, bin_ = tmp_path / "tree", tmp_path / "bin"
    (tree / "benchmarks").mkdir(parents=True)
    bin_.mkdir()
    shutil.copy(GPU_SH, tree / "benchmarks" / "gpu.sh")
    if launch:
        (tree / "benchmarks" / "launch.py").write_text("")
    log = tmp_path / "calls.log"
    log.touch()
    record = f'echo "$(basename "$0") $*" >> "{log}"\n'
    # python3: installs and virtualenvs refused; the rest is the real interpreter, or (a
    # stand-in for a CUDA torch with stiefel installed) succeeds without running anything
    refuse = 'case "$*" in *"-m venv"* | *"-m pip"*) exit 1 ;; esac\n'
    run = "exit 0\n" if cuda_python else f'exec "{sys.executable}" "$@"\n'
    _stub(bin_ / "python3", record + refuse + run)
    _stub(bin_ / "pip", record + "exit 1\n")
    _stub(bin_ / "nvidia-smi", record + (f"echo '{GPU_LISTED}'\n" if gpu else "exit 9\n"))
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OUT")}
    environ.update(PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="")
    environ.update(env or {})
    out = subprocess.run(
        ["bash", str(tree / "benchmarks" / "gpu.sh"), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    made = sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    made = [p for p in made if p not in ("benchmarks", "benchmarks/gpu.sh", "benchmarks/launch.py")]
    calls = log.read_text().splitlines()
    return out.returncode, out.stdout, out.stderr, calls, made


def _installs(calls):
    return [c for c in calls if "-m venv" in c or "-m pip" in c or c.startswith("pip ")]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_gpu_sh_help_prints_the_usage_and_does_nothing(tmp_path, flag):
    rc, out, err, calls, made = _gpu_sh(tmp_path, flag, gpu=True)
    assert rc == 0, err
    assert out.startswith("usage: bash benchmarks/gpu.sh") and "--install" in out
    assert calls == [] and made == []  # no Python run, no folder made


@pytest.mark.parametrize(
    "args, env, bad",
    [
        (["--only", "cwy"], {}, "--only"),
        (["--install", "-o"], {}, "-o"),
        (["--", "--help"], {}, "--help"),
        ([], {"OUT": "-x"}, "-x"),
    ],
)
def test_gpu_sh_refuses_an_out_dir_that_starts_with_a_dash(tmp_path, args, env, bad):
    rc, out, err, calls, made = _gpu_sh(tmp_path, *args, gpu=True, cuda_python=True, env=env)
    assert rc == 2
    assert f"OUT_DIR '{bad}' starts with '-'" in err and "usage:" in err
    assert calls == [] and made == []


@pytest.mark.parametrize("install", [False, True])
def test_gpu_sh_without_cuda_says_so_and_exits_nonzero(tmp_path, install):
    """No GPU listed, torch sees none: exit 1 before any install or folder, with --install too."""
    args = ["--install", "out"] if install else ["out"]
    rc, out, err, calls, made = _gpu_sh(tmp_path, *args, gpu=False)
    assert rc == 1
    assert "no CUDA device on this machine" in err
    assert _installs(calls) == [] and made == []
    assert calls[0].startswith("python3 -c import torch")  # it asked torch, then nvidia-smi
    assert calls[1:] == ["nvidia-smi -L"]


def test_gpu_sh_installs_only_when_told(tmp_path):
    """A GPU is listed but python3's torch sees none: without --install the script stops and
    names the option; with it, it makes the virtualenv (the stand-in refuses; the script
    stops with a non-zero status)."""
    rc, _, err, calls, made = _gpu_sh(tmp_path / "plain", "out", gpu=True)
    assert rc == 1 and "--install" in err and "sees no CUDA device" in err
    assert _installs(calls) == [] and made == []
    rc, _, err, calls, made = _gpu_sh(tmp_path / "install", "--install", "out", gpu=True)
    assert rc != 0
    assert "python3 -m venv .venv-gpu" in calls and _installs(calls)
    assert "out" not in made


@pytest.mark.parametrize("launch", [False, True])
def test_gpu_sh_runs_the_gpu_report_then_launch_where_it_exists(tmp_path, launch):
    """With a CUDA Python in place (a stand-in) and no --install: no install, the report's
    folder made, benchmarks.gpu given the folder and the extra options, benchmarks.launch
    run only when benchmarks/launch.py exists."""
    rc, out, err, calls, made = _gpu_sh(
        tmp_path, "rep", "--only", "cwy", gpu=True, cuda_python=True, launch=launch
    )
    assert rc == 0, err
    assert _installs(calls) == []
    assert "python3 -c import stiefel" in calls
    assert "python3 -m benchmarks.gpu --device cuda --out rep --only cwy" in calls
    assert ("python3 -m benchmarks.launch --device cuda" in calls) == launch
    large = "python3 -m benchmarks.launch --device cuda --sets st4096x64,batch4096"
    assert (large in calls) == launch
    assert made == (["rep", "rep/launch.log"] if launch else ["rep"])
