"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float = 20.0):
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs (after ``warmup``).

    Stops early once ``budget_s`` seconds have been spent (at least 3 runs),
    so that a slow anchor (an N×N solve) cannot stall the whole benchmark.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:8.2f} ms"
    return f"{seconds:8.2f} s "


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
