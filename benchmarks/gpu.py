"""What a GPU machine should run, in one call: the CUDA tests, the GPU benchmarks, one report.

Run ``bash benchmarks/gpu.sh`` on a GPU machine whose Python imports a CUDA torch and
the project (``bash benchmarks/gpu.sh --install`` on a bare one: it makes a virtualenv
with pip's CUDA torch where needed and installs the project, then runs this; without
``--install`` it installs nothing), or ``python -m benchmarks.gpu --out DIR`` where the
project is installed. Each step runs in its own process under a time limit, in this order:

1. ``tests``: every test case marked ``cuda`` (``pytest -m cuda``);
2. ``cwy``: CWY against sequential Householder (the CWY paper's Table 4 claim);
3. ``batched``: 4096 × St(64, 16) and 1024 × O(64) against pogo-torch, with drift;
   ``skew_cayley``: the square Cayley step's product series against the batched solve;
   ``woodbury``: the Woodbury Cayley system by block elimination against the LU;
   ``right_solve``: the QR step's A·R⁻¹ by the M×M inverse against the solve
   (Note [Right triangular solves]: whether its rule N ≥ 8M holds on the device);
   ``cayley_solve``: the Cayley map's solve without pivoting against the pivoted LU
   (Note [Unpivoted LU by device type]);
   ``expm``: the exponential's Padé forward and adjoint-Fréchet backward against
   ``torch.linalg.matrix_exp`` at four norms (Note [Padé degree by the dtype's unit
   roundoff], Note [The Padé solve of a skew-Hermitian A by device type]);
4. ``precision``: bfloat16 against float32;
5. ``optimizers``: the Riemannian steps against geoopt's;
6. ``layers``: the orthogonal convolutions against ``nn.Conv2d``, eager and compiled;
7. ``maps``: the maps against torch's and geotorch's;
8. ``syncs``: host synchronisations per map call and optimizer step;
9. ``muon``: the msign engines and one step against ``torch.optim.Muon``;
10. ``roofline``: the harness's complexity section (``configs/gpu_roofline.toml``):
    every map and step against max(FLOPs / GEMM rate, bytes / bandwidth);
11. ``compiled_batched``: the ``rgd``, ``radam`` and ``pogo`` steps on 4096 ×
    St(64, 16) compiled against eager (whether fusing a step's small kernels removes
    the fixed cost that dominates a batched step on a GPU);
12. ``compiled``: every map and step compiled (Inductor, fullgraph=True) against eager
    (last: Inductor's compiles take what time is left).

``DIR/report.md`` names the device (model, memory, driver, torch and CUDA
versions) and holds every step's command, time, exit status and output; it is
rewritten after each step, so a step that hangs or a limit that runs out never
loses the finished ones. ``DIR/tests.log`` keeps the whole pytest output.
The whole run fits in ``--limit-s`` seconds (default 460: under 8 minutes with
the set-up); a step gets the smaller of its own limit and what is left.

Example:

```text
python -m benchmarks.gpu --device cuda --out /tmp/gpu
python -m benchmarks.gpu --device cpu --quick --only cwy,syncs --out /tmp/gpu-cpu
```
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from ._timing import device_name, device_of


@dataclasses.dataclass(frozen=True)
class Step:
    """One process of the run: ``python -m`` ``argv``, then ``full`` or (with --quick) ``quick``."""

    name: str
    title: str
    argv: tuple[str, ...]
    limit_s: float
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)
    takes_device: bool = True
    report: str | None = None  # a file the step writes under its --out, shown in the report


STEPS = [
    Step(
        "tests",
        "CUDA test cases (pytest -m cuda)",
        ("pytest", "-m", "cuda", "-p", "no:cacheprovider", "-rfE", "--maxfail=40"),
        150,
        quick=(),
        takes_device=False,
    ),
    Step("cwy", "CWY against sequential Householder", ("benchmarks.cwy",), 100),
    Step("batched", "Batched regime against pogo-torch", ("benchmarks.batched",), 75),
    Step(
        "skew_cayley",
        "Cayley of a small skew matrix: Euler's product against the solve",
        ("benchmarks.skew_cayley",),
        30,
    ),
    Step(
        "woodbury",
        "Woodbury Cayley system: block elimination against the LU",
        ("benchmarks.woodbury",),
        25,
    ),
    Step(
        "right_solve",
        "The QR step's A·R⁻¹: the M×M inverse and a product against the triangular solve",
        ("benchmarks.right_solve",),
        20,
    ),
    Step(
        "cayley_solve",
        "The Cayley map's solve (I + A)X = B: without pivoting against the pivoted LU",
        ("benchmarks.cayley_solve",),
        30,
    ),
    Step(
        "expm",
        "The exponential by ‖A‖₁: our Padé and adjoint-Fréchet backward against torch's",
        ("benchmarks.expm",),
        30,
    ),
    Step("precision", "bfloat16 against float32", ("benchmarks.precision",), 30),
    Step(
        "optimizers",
        "Riemannian steps against geoopt",
        ("benchmarks.optimizers",),
        45,
        full=("--budget", "0.3"),
    ),
    Step(
        "layers",
        "Orthogonal convolutions against nn.Conv2d",
        ("benchmarks.layers", "--skip-norms", "--clock", "wall", "--compiled"),
        40,
    ),
    Step(
        "maps",
        "Maps against torch and geotorch",
        ("benchmarks.maps",),
        45,
        full=("--sizes", "256,1024", "--budget", "0.5"),
    ),
    Step(
        "syncs",
        "Host synchronisations per call",
        ("benchmarks.syncs",),
        30,
        quick=("--n", "32", "--stiefel", "64x8"),
    ),
    Step(
        "muon",
        "Orthogonalization engines against the Muon family",
        ("benchmarks.muon", "--clock", "wall"),
        60,
    ),
    Step(
        "roofline",
        "Every map and step against its roofline (harness complexity section)",
        ("stiefel.comparisons", "complexity", "--overwrite"),
        120,
        full=("--config", "configs/gpu_roofline.toml"),
        quick=("--sizes", "32", "--fractions", "1.0", "--shapes", "64x8", "--repeats", "2"),
        report="complexity.md",
    ),
    Step(
        "compiled_batched",
        "Compiled steps on a batch of small matrices (4096 × St(64, 16)) against eager",
        ("benchmarks.compiled", "--skip-maps"),
        150,
        full=("--batch", "4096", "--shape", "64x16", "--optimizers", "rgd,radam,pogo"),
        quick=("--quick", "--batch", "3", "--optimizers", "rgd"),
    ),
    Step(
        "compiled",
        "Compiled (Inductor, fullgraph=True) against eager",
        ("benchmarks.compiled",),
        150,
        full=("--budget", "0.3"),
    ),
]
NAMES = [s.name for s in STEPS]


def command(step: Step, device: torch.device, quick: bool, scratch: pathlib.Path) -> list[str]:
    """The full command line of ``step`` (one that writes files gets ``--out scratch/<name>``)."""
    argv = [sys.executable, "-m", *step.argv]
    if step.report is not None:
        argv += ["--out", str(scratch / step.name)]
    if step.name == "tests" and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", "8"]
    if step.name == "tests" and importlib.util.find_spec("pytest_timeout") is not None:
        argv += ["--timeout", "90"]
    if step.takes_device:
        argv += ["--device", str(device)]
    argv += list(step.quick if quick else step.full)
    return argv


def machine(device: torch.device) -> str:
    """The device in words: model, memory, driver, torch and CUDA versions."""
    parts = [f"device: {device_name(device)}", f"torch {torch.__version__}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts.append(f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
        parts.append(f"CUDA {torch.version.cuda}")
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=30)
            parts.append(f"driver {out.stdout.strip() or '?'}")
    return ", ".join(parts)


def _fenced(text: str, lines: int = 400) -> str:
    kept = text.rstrip().splitlines()
    if len(kept) > lines:
        kept = [f"[… {len(kept) - lines} earlier lines in the log …]"] + kept[-lines:]
    return "```text\n" + "\n".join(kept) + "\n```"


def _run_process(argv: list[str], limit_s: float) -> tuple[int | str, str]:
    """(exit status or "timeout", stdout + stderr) of ``argv`` stopped after ``limit_s``.

    The process leads its own session, so a stop ends its children too (pytest's
    workers would otherwise hold the output pipe open and the wait would hang).
    """
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        text, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return "timeout", (text or "") + f"\n[stopped after {limit_s:.0f} s]"


def run(
    steps: list[Step], device: torch.device, quick: bool, out: pathlib.Path, limit_s: float
) -> list[dict]:
    """Run ``steps`` in order, rewriting ``out/report.md`` after each; returns one dict per step."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="stiefel-gpu-"))
    start = time.monotonic()
    head = [
        "# GPU run",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine(device)}",
        f"command: {' '.join(sys.argv)}",
        "",
    ]
    done: list[dict] = []
    for step in steps:
        left = limit_s - (time.monotonic() - start)
        argv = command(step, device, quick, scratch)
        if left < 5:
            done.append(
                {"step": step, "argv": argv, "rc": None, "s": 0.0, "out": "not run: no time"}
            )
            continue
        t0 = time.monotonic()
        print(f"[gpu] {step.name}: {' '.join(argv)}", flush=True)
        rc, text = _run_process(argv, min(step.limit_s, left))
        written = scratch / step.name / (step.report or "")
        if step.report is not None and written.is_file():
            text = written.read_text() + "\n\n" + text
        if step.name == "tests":
            (out / "tests.log").write_text(text)
        done.append({"step": step, "argv": argv, "rc": rc, "s": time.monotonic() - t0, "out": text})
        write_report(out / "report.md", head, done)
    write_report(out / "report.md", head, done)
    return done


def write_report(path: pathlib.Path, head: list[str], done: list[dict]) -> None:
    summary = ["| step | exit | seconds |", "|---|---|---|"]
    summary += [f"| {d['step'].name} | {d['rc']} | {d['s']:.0f} |" for d in done]
    body = []
    for d in done:
        body += [
            f"## {d['step'].title}",
            "",
            f"`{' '.join(d['argv'][1:])}`",
            "",
            _fenced(d["out"]),
            "",
        ]
    path.write_text("\n".join(head + summary + [""] + body))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:<k> or cpu")
    p.add_argument("--out", type=pathlib.Path, required=True, help="folder of the report")
    p.add_argument("--quick", action="store_true", help="the benchmarks' --quick sizes")
    p.add_argument("--only", default=None, help=f"comma-separated steps among {','.join(NAMES)}")
    p.add_argument("--limit-s", type=float, default=460.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    device = device_of(args.device, p)
    wanted = NAMES if args.only is None else [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in NAMES]
    if unknown or not wanted:
        p.error(f"--only {args.only!r}: allowed: {', '.join(NAMES)} (comma-separated)")
    if args.limit_s <= 0:
        p.error(f"--limit-s {args.limit_s}: allowed: a positive number of seconds")
    steps = [s for s in STEPS if s.name in wanted]
    done = run(steps, device, args.quick, args.out, args.limit_s)
    print(f"[gpu] report: {args.out / 'report.md'}", flush=True)
    return done


if __name__ == "__main__":
    main()
