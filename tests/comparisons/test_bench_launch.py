"""benchmarks.launch: the counter it is built on, and a quick run of the script."""

from __future__ import annotations

import pathlib

import torch

from stiefel.benchmarks import launch

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
