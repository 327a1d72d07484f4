"""benchmarks/dispatch.py (each dispatcher's chosen path against its reference) runs, tiny.

No timing assertions: the rows name the path each policy picks on the workload, and the
chosen path differs from the reference exactly where a time is reported.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from stiefel.benchmarks import dispatch as bench_dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dispatch_benchmark_quick(capsys):
    threads = torch.get_num_threads()
    try:
        rows = bench_dispatch.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert {r["dispatcher"] for r in rows} == {"skew_from_raw", "exp_map", "cayley_map"}
    for r in rows:
        timed = "forward path" in r
        assert timed == (r["path"] != r["reference"]), r
        if timed:
            assert r["forward path"] > 0 and r["fwd+bwd reference"] > 0
    assert any(r["dispatcher"] == "exp_map" and r["path"] == "pade" for r in rows)
    assert "| dispatcher | workload | path | reference |" in out
    with pytest.raises(SystemExit):
        bench_dispatch.main(["--sizes", "1,x"])
