"""benchmarks/muon.py (engines and one step against the Muon family) runs end to end, tiny.

No timing assertions: the outputs are checked against the anchors the benchmark runs
(torch.optim.Muon's iteration, a float64 SVD), and the patches it applies are undone.
"""

from __future__ import annotations

import importlib
import json
import math
import pathlib

import pytest
import torch

from stiefel.benchmarks import muon as bench_muon

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_muon_benchmark_quick(tmp_path, capsys):
    from torch.optim import _muon

    import stiefel.optimizers.muon as muon_module
    from stiefel.manifolds.kernels import msign

    threads = torch.get_num_threads()
    out = tmp_path / "muon.json"
    try:
        bench_muon.main(["--quick", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "bfloat16 product takes" in text and "(a) engines" in text
    data = json.loads(out.read_text())
    rows = {r["label"]: r for r in data["engines"]}
    assert all(r["seconds"] > 0 and math.isfinite(r["error_vs_svd"]) for r in rows.values())
    # our Muon quintic equals torch.optim.Muon's iteration (run in float32) to rounding
    for engine in ("direct", "gram"):
        assert rows[f"ours newton_schulz-5, {engine}"]["max_diff_vs_torch_float32"] < 1e-4
    # both engines reach the same distance from U Vᴴ (the same polynomials)
    for method in ("newton_schulz", "polar_express"):
        d, g = (rows[f"ours {method}-5, {e}"]["error_vs_svd"] for e in ("direct", "gram"))
        assert abs(d - g) < 1e-4
    assert (
        rows["ours polar_express-5, gram"]["flops"] < rows["ours polar_express-5, direct"]["flops"]
    )
    if importlib.util.find_spec("gram_newton_schulz") is not None:
        assert "gram-newton-schulz Gram PE-5 (float32)" in rows
    assert len(data["step"]) == 2
    for entry in data["step"].values():
        labels = [r["label"] for r in entry["rows"]]
        assert labels[0] == "torch.optim.Muon (float32 iteration)" and len(labels) == 4
        assert all(r["seconds"] > 0 for r in entry["rows"])
    assert len(data["targets"]) == 3
    # every target is judged, except the package's when gram-newton-schulz is not installed
    have_package = importlib.util.find_spec("gram_newton_schulz") is not None
    for t in data["targets"]:
        judged = have_package or "gram-newton-schulz" not in t["target"]
        assert t["met"] in ((True, False) if judged else (None,)), t
    # the anchors' patches are undone
    assert _muon._zeropower_via_newtonschulz is not bench_muon.torch_newton_schulz_float32
    assert muon_module.msign is msign


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_torch_newton_schulz_copy_equals_torch_in_bfloat16(shape):
    # the float32 anchor is torch's function but for the dtype: run both in bfloat16
    from torch.optim import _muon

    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    coefficients = bench_muon.MUON_COEFFICIENTS
    theirs = _muon._zeropower_via_newtonschulz(g, coefficients, 5, _muon.EPS)
    ours = bench_muon.torch_newton_schulz_float32(g, coefficients, 5, _muon.EPS, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
