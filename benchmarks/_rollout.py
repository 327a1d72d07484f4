"""RNN rollouts of the map benchmark: operator forms against an unconstrained RNN.

Every row is timed in the same interleaved rounds (`_timing.rounds`: each round calls
every row once, in an order that changes from round to round), on the wall clock and
on the calling thread's CPU clock of the same calls; the table gives each clock's
median over the rounds and the median over the rounds of each row's time over the
unconstrained RNN's in that round. Timed one after another instead, the first row ran
in a different state of the machine (its load, its caches) than the rows after it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stiefel.parametrizations import orthogonalize

from ._maps_common import _progress, _randomize, _row
from ._timing import Timing, both_clocks, fmt_ratio, fmt_time, rounds, table


def _rollout_fn(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], params, xs, n):
    """Forward + backward of an RNN h_t = step(h_{t−1}, x_t) from h_0 = 0; loss = sum(h_T)."""

    def run() -> object:
        for p in params:
            p.grad = None
        h = xs.new_zeros(1, n)
        for x in xs:
            h = step(h, x)
        h.sum().backward()
        return None

    return run


def rollout(
    steps: int, n: int, repeats: int, budget: float, gen, verbose: bool = False, device="cpu"
) -> list[dict[str, Any]]:
    """RNN rollouts (T = ``steps``, batch 1, L = n/8), forward + backward, on ``device``.

    Timed in ``repeats`` interleaved rounds (at least one); ``budget`` is not used (every
    row runs in every round), it is kept for the callers' signature.
    """
    L = max(1, n // 8)
    xs = torch.randn(steps, 1, n, generator=gen).to(device)
    free = nn.Parameter((torch.randn(n, n, generator=gen) / math.sqrt(n)).to(device))
    cases: list[tuple[str, Callable[[], object]]] = [
        (
            "unconstrained (tanh(h Wᵀ + x))",
            _rollout_fn(lambda h, x: torch.tanh(F.linear(h, free) + x), [free], xs, n),
        )
    ]
    for method in ("cwy", "householder"):
        w = orthogonalize(
            torch.randn(n, n, generator=gen),
            method=method,
            reflections=L,
            init="random",
            generator=gen,
        )
        _randomize(w, 1.0, gen)
        w = w.to(device)
        cases.append((f"{method} step = W.operator() once per rollout", _operator(w, xs, n)))
        cases.append(
            (
                f"{method} W.linear(h) at every step (factors recomputed)",
                _rollout_fn(
                    lambda h, x, w=w: torch.tanh(w.linear(h) + x), list(w.parameters()), xs, n
                ),
            )
        )
        if method == "cwy":
            cases.append((f"{method} Q = W() once per rollout", _materialized(w, xs, n)))
    _progress(verbose, f"rollout: {len(cases)} rows in {max(repeats, 1)} interleaved rounds")
    times = rounds(dict(cases), max(repeats, 1), lambda fn: both_clocks(fn, device))
    base = times[cases[0][0]]
    rows = []
    for name, _ in cases:
        thread, wall = ([t[i] for t in times[name]] for i in (0, 1))
        t = Timing(statistics.median(wall), len(wall))
        per_round = {
            clock: statistics.median(a[i] / b[i] for a, b in zip(times[name], base, strict=True))
            for i, clock in enumerate(("thread", "wall"))
        }
        rows.append(
            _row("rollout", name, "ours", None, t, n=n, L=L, T=steps)
            | {
                "thread_s": statistics.median(thread),
                "wall_ratio": per_round["wall"],
                "thread_ratio": per_round["thread"],
                "rounds": len(wall),
            }
        )
    return rows


def _materialized(w: nn.Module, xs: torch.Tensor, n: int) -> Callable[[], object]:
    params = list(w.parameters())

    def run() -> object:
        for p in params:
            p.grad = None
        q = w()
        h = xs.new_zeros(1, n)
        for x in xs:
            h = torch.tanh(F.linear(h, q) + x)
        h.sum().backward()
        return None

    return run


def _operator(w: nn.Module, xs: torch.Tensor, n: int) -> Callable[[], object]:
    """``step = W.operator()`` once per rollout (Note [Factors once per rollout]).

    For ``cwy`` the factors U and S are computed once; each step then costs
    two n×L products and one L×L triangular solve (§3.1 of the CWY paper).
    """
    params = list(w.parameters())

    def run() -> object:
        for p in params:
            p.grad = None
        step = w.operator()
        h = xs.new_zeros(1, n)
        for x in xs:
            h = torch.tanh(step(h) + x)
        h.sum().backward()
        return None

    return run


def rollout_table(rows: list[dict[str, Any]]) -> str:
    body = [
        [r["name"], fmt_time(r["fwd_bwd_s"]), fmt_time(r["thread_s"])]
        + [fmt_ratio(r["wall_ratio"]), fmt_ratio(r["thread_ratio"])]
        for r in rows
    ]
    r0 = rows[0]
    title = f"RNN rollout, T = {r0['T']}, n = {r0['n']}, batch 1, L = {r0['L']}, forward + backward"
    title += f"; every row in each of {r0['rounds']} interleaved rounds, medians"
    heads = ["model", "fwd+bwd wall", "fwd+bwd thread CPU", "wall / unconstrained"]
    heads += ["thread / unconstrained"]
    note = (
        "thread CPU: the calling thread's CPU time of the same calls (all of a call's work "
        "with one torch thread; — on a GPU); ratios: the median over the rounds of the "
        "row's time over the unconstrained RNN's in the same round"
    )
    return f"{title}\n{table(heads, body)}\n{note}"
