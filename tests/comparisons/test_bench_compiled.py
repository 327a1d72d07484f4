"""benchmarks/compiled.py runs end to end on tiny sizes (no timing assertions).

``aot_eager`` instead of Inductor: Inductor's C++ code generation takes minutes on a
CPU runner; the graphs, the fullgraph check and the comparison with eager are the
same. The compiled results of this package's maps and steps equal the eager ones to
rounding (the difference column), geoopt's steps do not (DESIGN.md, Clarification
on torch.compile).
"""

import json
import pathlib

import pytest

from stiefel.benchmarks import compiled

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "compiled.json"
    argv = ["--quick", "--backend", "aot_eager", "--repeats", "1", "--json", str(out)]
    argv += ["--maps", "cwy,exp,cayley", "--optimizers", "rgd,landing"]
    text = compiled.main(argv)
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["kind"], r["name"]) for r in rows] == [
        ("map fwd+bwd", "cwy"),
        ("map fwd+bwd", "exp"),
        ("map fwd+bwd", "cayley"),
        ("step", "rgd"),
        ("step", "landing"),
    ]
    for r in rows:
        assert r["eager_s"] > 0 and r["compiled_s"] > 0
        assert r["ratio"] == pytest.approx(r["compiled_s"] / r["eager_s"])
        assert r["max_abs_diff"] <= 10 * 8 * 1.2e-7  # 10·n·eps(float32), n = 8
        assert r["name"] in text
    assert data["config"]["backend"] == "aot_eager"


def test_bad_device_is_refused(capsys):
    with pytest.raises(SystemExit):
        compiled.main(["--quick", "--device", "tpu"])
    assert "--device 'tpu'" in capsys.readouterr().err


@pytest.mark.slow
def test_batched_steps_are_compiled_to_the_eager_result(tmp_path):
    # --batch B steps B matrices at once; the compiled point after two steps equals
    # the eager one to rounding, for every matrix of the batch
    out = tmp_path / "batched.json"
    argv = ["--quick", "--backend", "aot_eager", "--repeats", "1", "--skip-maps"]
    argv += ["--optimizers", "rgd,radam", "--batch", "3", "--json", str(out)]
    compiled.main(argv)
    data = json.loads(out.read_text())
    assert data["config"]["batch"] == 3
    rows = data["results"]
    assert [r["size"] for r in rows] == ["3 × St(32, 4)"] * 2
    for r in rows:
        assert r["max_abs_diff"] <= 10 * 32 * 1.2e-7  # 10·N·eps(float32)


def test_bad_batch_is_refused(capsys):
    with pytest.raises(SystemExit):
        compiled.main(["--quick", "--batch", "0"])
    assert "--batch 0" in capsys.readouterr().err


def test_mode_needs_inductor(capsys):
    with pytest.raises(SystemExit):
        compiled.main(["--quick", "--backend", "aot_eager", "--mode", "reduce-overhead"])
    assert "--mode reduce-overhead" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compiled.main(["--quick", "--mode", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
