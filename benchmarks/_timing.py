"""Timing and table helpers of the benchmark scripts (not installed: run from a checkout).

The timed loop is the harness's (`stiefel.comparisons.cost`); the
benchmarks, which compare libraries measured side by side, report its median
(`median_time`) or adapt the number of runs to the cost of the first call
(`measure`). Tables and JSON go through `stiefel.comparisons.writers`.

Example:
    ```text
    t = measure(lambda: sum(range(100)), repeats=5, budget_s=0.1)
    assert t.seconds > 0 and 1 <= t.runs <= 5
    ```
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import math
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from stiefel.comparisons import cost as timing
from stiefel.comparisons.config import parse_shape
from stiefel.comparisons.writers import md_table, write_json

__all__ = [
    "Timing",
    "median_time",
    "measure",
    "interleaved",
    "rounds",
    "schedule",
    "thread_timed",
    "both_clocks",
    "fmt_time",
    "fmt_ratio",
    "table",
    "header",
    "versions",
    "rounds_line",
    "fmt_sig",
    "write_json",
    "parse_shape",
    "ratio",
    "target",
    "targets_table",
    "device_of",
    "device_name",
]


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float = 20.0):
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs (after ``warmup``).

    Stops early once ``budget_s`` seconds have been spent (at least 3 runs),
    so that a slow anchor (an N×N solve) cannot stall the whole benchmark; a
    warm-up call taking over a second ends the warm-up (such a call is not
    dominated by first-call allocations and caches).
    """
    return statistics.median(timing.run_times(fn, repeats, warmup, budget_s))


@dataclasses.dataclass
class Timing:
    """A measurement: the median time of ``runs`` timed calls (``cold``: the first call only)."""

    seconds: float
    runs: int
    cold: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "runs": self.runs, "cold": self.cold}


def measure(
    fn: Callable[[], object],
    repeats: int,
    budget_s: float = 3.0,
    warmup: int = 1,
    cold_s: float = 0.5,
    clock: str | None = None,
) -> Timing:
    """Median wall time of ``fn()`` with a number of runs adapted to its cost.

    The first call is timed. If it alone took at least max(``budget_s``,
    ``cold_s``), it is the measurement (``cold=True``, one run: an anchor taking
    tens of seconds is not repeated). Otherwise it counts as warm-up (with
    ``warmup − 1`` more calls), and up to ``repeats`` timed calls follow,
    stopping once ``budget_s`` seconds have been spent on them (at least one).
    ``clock="thread"`` times the timed calls by `thread_timed` (CPU work on one thread).
    """
    clocked = timing.timed if clock is None else thread_timed
    first = clocked(fn)
    if first >= max(budget_s, cold_s):
        return Timing(first, 1, cold=True)
    for _ in range(max(warmup - 1, 0)):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(max(repeats, 1)):
        times.append(clocked(fn))
        if time.perf_counter() - start > budget_s:
            break
    return Timing(statistics.median(times), len(times))


def rounds(
    fns: dict[Any, Callable[[], object]], count: int, clock: Callable = timing.timed
) -> dict[Any, list[float]]:
    """The time of each ``fn`` in each of ``count`` rounds, each calling every one once in turn.

    One warm-up call each first. Interleaving puts a change of the machine's speed
    during the run into every ``fn``'s times alike; ``clock`` times one call (CUDA
    synchronised by default, `thread_timed` for the CPU time of one thread). The
    order changes from round to round (`schedule`), so that no ``fn`` always runs
    first or after the same neighbour: a call that follows another one's pass over
    other data finds its own evicted from the caches, worth several per cent of a
    step on a large matrix, and a rotation alone keeps each ``fn``'s predecessor.
    Round ``r``'s times of two ``fn`` share the load of that round: their ratio is
    the one to take where the load changes.
    """
    for fn in fns.values():
        fn()
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for key in schedule(list(fns), count):
        times[key].append(clock(fns[key]))
    return times


def schedule(keys: list, count: int) -> list:
    """The calls of ``count`` `rounds`: every key once per round, the keys in reverse in
    odd rounds (each key follows each of its two neighbours) and rotated by one every
    second round (each key comes first in turn)."""
    order = []
    for r in range(count):
        base = keys[::-1] if r % 2 else keys
        shift = (r // 2) % len(keys)
        order += base[shift:] + base[:shift]
    return order


def interleaved(
    fns: dict[Any, Callable[[], object]], count: int, clock: Callable = timing.timed
) -> dict[Any, float]:
    """Median time of each ``fn`` over ``count`` interleaved `rounds`."""
    return {k: statistics.median(v) for k, v in rounds(fns, count, clock).items()}


def device_of(text: str | None, parser: argparse.ArgumentParser | None = None) -> torch.device:
    """The ``--device`` of a benchmark: ``cpu`` (default) or a CUDA device that exists.

    With ``parser``, a bad value ends the program through ``parser.error`` (usage
    and message on stderr, exit status 2), as argparse does for its own options.
    A CUDA device with an index becomes the current one: the timed loop
    (`stiefel.comparisons.cost.timed`) synchronises the current device.

    Raises:
        ValueError: an unknown device, or CUDA on a machine without it (no ``parser``).
    """
    try:
        return _device(text)
    except ValueError as err:
        if parser is None:
            raise
        parser.error(str(err))


def _device(text: str | None) -> torch.device:
    try:
        device = torch.device(text or "cpu")
    except RuntimeError as err:
        raise ValueError(f"--device {text!r}: not a device; allowed: cpu, cuda, cuda:<k>") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}; allowed: cpu, cuda, cuda:<k>")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text!r}: this machine has no CUDA device; allowed: cpu")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def both_clocks(fn: Callable[[], object], device: torch.device | None = None) -> tuple:
    """(thread CPU time, wall time) of one call ``fn()``, in seconds.

    The CPU interval lies inside the wall one (each clock read costs about a
    microsecond), so the CPU time of a call never exceeds its wall time. On a CUDA
    ``device`` the wall time is synchronised before and after, and the CPU time is NaN
    (the host waits on the device there: not the step's host work).
    """
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    w0 = time.perf_counter()
    t0 = time.thread_time()
    fn()
    cpu = time.thread_time() - t0
    if cuda:
        torch.cuda.synchronize(device)
    return (float("nan") if cuda else cpu), time.perf_counter() - w0


def thread_timed(fn: Callable[[], object]) -> float:
    """CPU time of one call ``fn()`` on the calling thread, in seconds.

    Note [Thread CPU time on a shared machine]
    On a machine shared with other jobs the wall time of a step includes the
    time the scheduler gives to them (measured: 2–10× the step's own time at a
    load of 7 on 2 cores). With one intra-op thread (``torch.set_num_threads(1)``)
    every operation runs on the calling thread, and its CPU time counts only the
    step's own work (cache effects of the other jobs remain). Used by the
    ``--clock thread`` option of the CPU benchmarks; meaningless with more threads.
    """
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def fmt_time(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:8.2f} ms"
    return f"{seconds:8.2f} s "


def fmt_ratio(ratio: float | None) -> str:
    """A speed ratio: 3 significant digits (2 below 0.1), '—' when undefined."""
    if ratio is None or not math.isfinite(ratio):
        return "—"
    if ratio >= 100:
        return f"{ratio:.0f}x"
    if ratio >= 10:
        return f"{ratio:.1f}x"
    if ratio >= 0.1 or ratio <= 0:
        return f"{ratio:.2f}x"
    return f"{fmt_sig(ratio)}x"


def fmt_sig(x: float | None, digits: int = 2) -> str:
    """``x`` with at least ``digits`` significant digits, no exponent ('—' when undefined).

    Example:
        ```text
        fmt_sig(0.0912) == "0.091"; fmt_sig(1.234) == "1.2"; fmt_sig(123.4) == "123"
        ```
    """
    if x is None or not math.isfinite(x):
        return "—"
    if x == 0:
        return "0"
    decimals = max(digits - 1 - math.floor(math.log10(abs(x))), 0)
    return f"{x:.{decimals}f}"


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (`stiefel.comparisons.writers.md_table`) whose cells may hold ``|``.

    A ``|`` inside a header or a text cell (``max |Δ|``) is escaped as ``\\|``:
    unescaped, markdown reads it as a column border.
    """
    return md_table([_escaped(h) for h in headers], [[_escaped(c) for c in r] for r in rows])


def _escaped(cell: Any) -> Any:
    return cell.replace("|", "\\|") if isinstance(cell, str) else cell


def device_name(device: torch.device | str | None = None) -> str:
    """The device in words: the GPU's model on CUDA, the CPU's model otherwise."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def header(
    title: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    peers: tuple[str, ...] = (),
) -> str:
    """A title line with the torch version, the device (`device_name`), thread count and dtype.

    ``peers``: the distributions of the libraries compared against (``"geoopt"``,
    ``"pogo-torch"``, ...), whose versions (`versions`) end the line.
    """
    dev = device_name(device)
    name = str(dtype).removeprefix("torch.")
    n = torch.get_num_threads()
    line = f"{title} — torch {torch.__version__}, {dev}, {n} thread{'s' * (n != 1)}, {name}"
    return f"{line}; {versions(*peers)}" if peers else line


def rounds_line(count: int, device: torch.device | str | None = None) -> str:
    """What an `interleaved` table holds: the median of ``count`` rounds on the wall clock."""
    cuda = torch.device(device or "cpu").type == "cuda"
    sync = ", synchronised before and after each call" if cuda else ""
    return f"median of {count} interleaved rounds (one call each per round), wall clock{sync}"


def versions(*dists: str) -> str:
    """The installed version of each distribution, as ``"peft 0.22.0, geoopt 0.5.1"``.

    A peer's speed and memory change from one release to the next: a figure compared
    against it holds for the version named beside it. One not installed reads
    ``"<name> not installed"``.
    """
    out = []
    for d in dists:
        try:
            out.append(f"{d} {importlib.metadata.version(d)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{d} not installed")
    return ", ".join(out)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    return None if a is None or b is None or b <= 0 else a / b


def target(label: str, measured: float | None, op: str, goal: float) -> dict[str, Any]:
    """One target row: ``measured op goal`` judged (``met`` is None when not measured)."""
    met = None if measured is None else (measured >= goal if op == ">=" else measured <= goal)
    return {"target": label, "measured": measured, "op": op, "goal": goal, "met": met}


def targets_table(rows: list[dict[str, Any]]) -> str:
    """The targets as a markdown table: goal, measured value, met / NOT met."""
    body = []
    for r in rows:
        v = r["measured"]
        met = "n/a" if r["met"] is None else ("met" if r["met"] else "NOT met")
        body.append([r["target"], f"{r['op']} {r['goal']}", "—" if v is None else f"{v:.3g}", met])
    return table(["target", "goal", "measured", ""], body)
