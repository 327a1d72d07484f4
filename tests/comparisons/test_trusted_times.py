"""Times that can be trusted on a busy machine: the thread CPU clock beside the wall clock,
flags from the spread of repeats (median ± MAD) and from waiting for a core, tables, fits and
figures that refuse flagged points, and the machine each section ran on."""

import json
import os
import time

import numpy as np
import pytest
import torch

from stiefel.comparisons import cli, cost, plots, sections


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_flag_against_median_and_mad_by_hand():
    cpu = [1.0, 1.05, 0.97, 1.4, 1.0]
    med = float(np.median(cpu))
    mad = float(np.median(np.abs(np.array(cpu) - med)))
    assert cost.flag(cpu, cpu, thread=True) is None and mad / med <= cost.SPREAD
    spread = [1.0, 1.5, 2.0, 1.2, 0.6]
    med, mad = np.median(spread), np.median(np.abs(np.array(spread) - np.median(spread)))
    assert cost.flag(spread, spread, thread=True) == f"spread {mad / med:.2f} (MAD / median > 0.1)"
    assert cost.flag([1.0] * 3, [1.6] * 3, thread=True).startswith("wall 1.6× CPU")
    assert cost.flag([1.0] * 3, [1.6] * 3, thread=False) is None  # no CPU clock to compare


def test_measure_sees_a_wait_and_a_spread_on_the_thread_clock():
    torch.set_num_threads(1)
    waited = cost.measure(lambda: time.sleep(0.005), repeats=5)  # waits, does no work
    assert waited["wall_s"] >= 0.005 > 3 * waited["cpu_s"] and "waited for a core" in waited["flag"]
    sizes = iter([0.001, 0.004] * 10)
    uneven = cost.measure(lambda: _busy(next(sizes)), repeats=6, warmup=0)
    assert uneven["flag"].startswith("spread") and uneven["s"] == pytest.approx(0.0025, rel=0.3)
    steady = cost.measure(lambda: _busy(0.002), repeats=5)
    assert steady["s"] == pytest.approx(0.002, rel=0.25)  # the CPU clock: the work only
    assert steady["s"] == steady["cpu_s"]


def test_fits_refuse_a_flagged_point_and_say_why():
    rows = [dict(label="m", n=n, t_s=1e-9 * n**3, flops=2.0 * n**3) for n in (512, 1024, 2048)]
    why: list[str] = []
    (fit,) = sections._fits(rows, "n", ("t_s",), 512, why)
    ref = np.polyfit(np.log([512, 1024, 2048]), np.log([r["t_s"] for r in rows]), 1)[0]
    assert fit == pytest.approx(ref, rel=1e-12) and why == []
    rows[1]["t_flag"] = "spread 0.3 (MAD / median > 0.1)"
    fit, model = sections._fits(rows, "n", ("t_s", "flops"), 512, why)
    assert fit == "refused" and model == pytest.approx(3.0)
    assert why == ["m t at n = 1024: spread 0.3 (MAD / median > 0.1)"]
    (line,) = sections._flagged(why)
    assert "† flagged" in line and "refused by the fits" in line and "n = 1024" in line
    assert sections._t(rows[1], "t").endswith(" †") and sections._t(rows[0], "t") == rows[0]["t_s"]


def test_figure_draws_flagged_points_hollow_with_their_mad():
    rows = [
        dict(label="a", n=n, fb_s=1e-3 * n, fb_mad_s=1e-4 * n, fb_flag="x" if n == 64 else None)
        for n in (32, 64, 128)
    ]
    fig = plots.complexity_figure(rows, "n", "fb_s", "label", "t")
    ax = fig.axes[0]
    (bars,) = ax.containers  # one errorbar: the flagged point
    marker = bars.lines[0]
    assert list(marker.get_xdata()) == [64] and list(marker.get_ydata()) == [0.064]
    assert marker.get_markerfacecolor() == "white"
    (seg,) = bars.lines[2][0].get_segments()
    assert seg[:, 1] == pytest.approx([0.064 - 0.0064, 0.064 + 0.0064])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "a (slope 1.00)" in labels and any("flagged" in t for t in labels)


def test_manifest_and_report_say_what_the_section_ran_on(tmp_path, monkeypatch, capsys):
    threads = torch.get_num_threads()
    load = [float(os.cpu_count() + 5)]
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    argv = ["drift", "--out", str(tmp_path), "--tasks", "procrustes", "--strategies", "cwy+adam"]
    cli.main([*argv, "--n", "4", "--m", "2", "--steps", "2", "--seeds", "1", "--jobs", "1"])
    assert torch.get_num_threads() == threads  # restored after the run
    out = capsys.readouterr().out
    assert f"load average {load[0]:g} is above the {os.cpu_count()} cores" in out
    m = json.loads((tmp_path / "manifest.json").read_text())["sections"]["drift"]["machine"]
    assert m["cores"] == os.cpu_count() and m["threads"] == 1 and m["workers"] == 1
    assert m["load"] == load[0] and m["load_end"] == load[0] and m["cpu"]
    report = (tmp_path / "report.md").read_text()
    assert f"*Machine*: {m['cpu']}, {os.cpu_count()} cores, 1 torch thread(s) per worker" in report
    assert "(above the cores: times that waited for a core are flagged †)" in report
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["value"] for r in rows if r["metric"] == "threads"} == {1}
    assert any(r["metric"] == "cpu_time" for r in rows)


def test_the_default_is_a_worker_per_core(tmp_path):
    from stiefel.comparisons import config

    assert config.resolve("drift", {})["jobs"] == os.cpu_count()
    assert config.resolve("drift", {"jobs": 1})["jobs"] == 1
