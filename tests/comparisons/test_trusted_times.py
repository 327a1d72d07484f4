"""Times that can be trusted on a busy machine: the thread CPU clock beside the wall clock,
flags from the spread of repeats (median ± MAD) and from waiting for a core, tables, fits and
figures that refuse flagged points, and the machine each section ran on."""

import itertools
import json
import math
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


class _Clock:
    """Fake clocks for `cost`: the thread CPU clock counts the work done, the wall clock
    the work times ``wait`` (a share of a core) and the calls' own waits."""

    def __init__(self):
        self.cpu = self.wall = 0.0
        self.speed = lambda wall: 1.0  # the machine's slowdown at a wall time

    def thread_time(self) -> float:
        return self.cpu

    def perf_counter(self) -> float:
        return self.wall

    def call(self, cpu: float, wait: float = 1.0):
        """A function whose calls cost ``cpu`` s of work (× the slowdown), ``wait`` × that wall."""

        def fn():
            work = cpu * self.speed(self.wall)
            self.cpu += work
            self.wall += work * wait

        return fn


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(cost, "time", c)
    monkeypatch.setattr(cost, "one_thread", lambda device="cpu": True)
    return c


def _doubled(cost_s: float, min_s: float) -> int:  # the first power of 2 with k·cost >= min_s
    return 2 ** math.ceil(math.log2(min_s / cost_s) - 1e-12)


def test_a_block_doubles_its_calls_until_it_lasts_on_the_trusted_clock(clock):
    for c in (3e-4, 1e-3, 0.05):
        assert cost._block_calls(clock.call(c), thread=True) == max(_doubled(c, cost.BLOCK_S), 1)
    # a call that mostly waits: 1 µs of work in 1 ms of wall time stops at 10 × BLOCK_S wall
    assert cost._block_calls(clock.call(1e-6, wait=1000.0), True) == _doubled(1e-3, 0.2)
    assert cost._block_calls(clock.call(1e-6, wait=1000.0), False) == _doubled(1e-3, 0.02)


def test_measure_times_blocks_per_call_so_an_uneven_call_does_not_spread(clock):
    costs = itertools.cycle([1e-3, 3e-3])  # one call 1 ms, the next 3 ms
    uneven = lambda: clock.call(next(costs))()  # noqa: E731
    singles = cost.run_times(uneven, repeats=8, warmup=0)
    assert cost.flag(singles, singles, thread=True).startswith("spread 0.50")  # single calls
    t = cost.measure(uneven, repeats=5, warmup=0)
    calls = _doubled(2e-3, cost.BLOCK_S)
    assert t["calls"] == calls and t["flag"] is None and t["mad_s"] == pytest.approx(0, abs=1e-12)
    assert t["s"] == t["cpu_s"] == t["wall_s"] == pytest.approx(2e-3, rel=1e-9)


def test_measure_flags_a_wait_and_a_spread_of_the_cpu_times(clock, monkeypatch):
    waited = cost.measure(clock.call(1e-3, wait=3.0), repeats=5)
    assert waited["s"] == pytest.approx(1e-3) and waited["wall_s"] == pytest.approx(3e-3)
    assert waited["flag"] == "wall 3.0× CPU (> 1.5×: waited for a core)"
    monkeypatch.setattr(cost, "BLOCK_S", 1e-9)  # one call per block
    sizes = iter([1e-3, 4e-3] * 10)
    uneven = cost.measure(lambda: clock.call(next(sizes))(), repeats=6, warmup=0)
    # the wall clock follows the CPU clock (no wait): the CPU times' spread flags it
    assert uneven["calls"] == 1 and uneven["cpu_s"] == uneven["wall_s"]
    assert uneven["flag"] == "spread 0.60 (MAD / median > 0.1)"  # median 2.5, MAD 1.5


def test_measure_on_the_real_clocks_reports_the_work_per_call():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steady = cost.measure(lambda: _busy(0.002), repeats=3)
    finally:
        torch.set_num_threads(threads)
    assert steady["s"] == steady["cpu_s"] == pytest.approx(0.002, rel=0.25)  # the work only
    assert steady["calls"] in (8, 16)  # 2 ms calls: 8 or 16 to a block of BLOCK_S = 20 ms


def test_interleaved_rounds_keep_the_ratio_when_the_machine_slows(clock):
    """The machine slows down linearly (3× over the measurement, another job starting):
    timed one after the other, b (twice a's work) seems 3.4× a, unflagged; interleaved, 2.1×."""
    a, b, rounds = clock.call(1e-3), clock.call(2e-3), 9
    span = 2 * rounds * 2 * cost.BLOCK_S  # the wall time of the rounds, about
    clock.speed = lambda wall: 1.0 + 2.0 * min(wall / span, 1.0)
    order = []
    block = cost._block
    cost_block = lambda fn, calls: order.append(fn) or block(fn, calls)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost, "_block", cost_block)
        together = cost.measure_many({"a": a, "b": b}, repeats=rounds, warmup=0)
    rounds_order = order[-2 * rounds :]  # each round's blocks, rotated by one a round
    assert rounds_order == [a, b, b, a] * (rounds // 2) + [a, b]
    assert together["b"]["s"] / together["a"]["s"] == pytest.approx(2.0, rel=0.1)
    clock.wall = clock.cpu = 0.0
    apart = cost.measure(a, rounds, warmup=0)["s"], cost.measure(b, rounds, warmup=0)["s"]
    assert apart[1] / apart[0] > 3.0  # the slower machine fell on b only


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
    (line,) = sections.flag_note(why)
    assert "† flagged" in line and "refused by the fits" in line and "n = 1024" in line
    assert (
        sections.time_cell(rows[1], "t").endswith(" †")
        and sections.time_cell(rows[0], "t") == rows[0]["t_s"]
    )


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
