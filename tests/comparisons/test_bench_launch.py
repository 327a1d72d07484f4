"""benchmarks.launch: the counter it is built on, and a quick run of the script."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import torch

from stiefel.benchmarks import _before, launch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_counter_sees_ops_and_every_kind_of_host_read():
    t = torch.randn(5)
    with launch.StepCounter() as c:
        u = t * 2 + 1  # two ops, no read
    assert (c.ops, c.reads) == (2, 0)
    with launch.StepCounter() as c:
        float(u.max())
        bool((u > 0).all())
        u.tolist()
        torch.equal(u, t)
    assert c.reads == 4


def test_quick_run_prints_ours_beside_the_peers():
    text = launch.main(
        ["--quick", "--sets", "st8x4", "--optimizers", "rgd,pogo,torch", "--rounds", "1"]
    )
    rows = {
        line.split("|")[2].strip(): line.split("|")
        for line in text.splitlines()
        if line.startswith("| st8x4")
    }
    assert {"rgd", "pogo", "torch Adam foreach"} <= set(rows)
    ops, reads, flat = int(rows["rgd"][3]), int(rows["rgd"][4]), float(rows["rgd"][5])
    assert ops > 0 and flat <= 1.5  # one rule call for the 24 matrices
    assert int(rows["pogo"][4]) == 1  # the step's one read of its flags
    assert reads < 24  # no read per parameter


#: the last commit before the buckets: every optimizer a loop over its parameters
PER_PARAMETER = (
    subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "log",
            "--format=%H",
            "--grep=one rule call per bucket of same-kind",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    + "~1"
)


def test_before_steps_an_earlier_commit_in_the_same_run():
    text = launch.main(
        ["--quick", "--sets", "st8x4", "--optimizers", "rgd", "--rounds", "1",
         "--before", PER_PARAMETER]
    )  # fmt: skip
    package = _before.load(PER_PARAMETER)
    assert f"commit {package.__commit__[:12]}" in text
    rows = {
        line.split("|")[2].strip(): [c.strip() for c in line.split("|")]
        for line in text.splitlines()
        if line.startswith("| st8x4")
    }
    now, old = rows["rgd"], rows["rgd (before)"]
    # the earlier commit's loop over 24 parameters: its ops grow with them, a read per parameter
    assert int(old[3]) > 5 * int(now[3]) and int(old[4]) >= 24 > int(now[4])
    assert not pathlib.Path(package.__file__).is_relative_to(ROOT)
    assert package.optimizers.create is not launch.optimizers.create


def test_the_earlier_rgd_and_todays_take_the_same_steps():
    # the per-parameter loop of the earlier commit is the reference of the bucketed step
    package = _before.load(PER_PARAMETER)
    points = launch._points([(6, 8, 4), (3, 5, 5)], torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(x.shape, generator=gen) for x in points] for _ in range(3)]
    finals = []
    for make in (launch._ours("rgd", momentum=0.9), launch._earlier(package, "rgd", momentum=0.9)):
        params, opt = make(points, False)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        finals.append(torch.stack([p.detach().flatten() for p in params[:6]]))
    assert float((finals[0] - points[0].flatten()).abs().max()) > 1e-4  # they moved
    assert float((finals[0] - finals[1]).abs().max()) <= 100 * torch.finfo(torch.float32).eps


def test_before_refuses_a_name_that_is_no_commit():
    with pytest.raises(SystemExit):
        launch.main(["--quick", "--sets", "st8x4", "--before", "no-such-ref"])
