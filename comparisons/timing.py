"""The harness's one timing policy: the fastest of a few timed calls.

Note [Fastest run for cost models]
On a shared machine other processes only ever slow a run down, so the fastest
of several runs is the closest to the cost of the computation itself (the
advice of Python's ``timeit``). The complexity section fits exponents to these
times and divides FLOP models by a GEMM rate measured the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["timed", "run_times", "fastest_time"]


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Wall time of one call ``fn()`` in seconds (CUDA work included)."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def run_times(
    fn: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float = 20.0
) -> list[float]:
    """Times of up to ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones.

    Stops early once ``budget_s`` seconds have been spent (after at least 3
    runs), so that a slow anchor cannot stall a whole measurement; a warm-up
    call over a second ends the warm-up (such a call is not dominated by
    first-call allocations and caches).
    """
    for _ in range(warmup):
        if timed(fn) > 1.0:
            break
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(max(repeats, 1)):
        times.append(timed(fn))
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return times


def fastest_time(
    fn: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float = 20.0
) -> float:
    """Fastest wall time of ``fn()`` over ``repeats`` runs (Note [Fastest run for cost models]).

    Example:
        ```python
        from stiefel.comparisons.timing import fastest_time

        assert fastest_time(lambda: sum(range(100)), repeats=3) > 0
        ```
    """
    return min(run_times(fn, repeats, warmup, budget_s))
