"""Cost measurement, in one place: time, peak and saved bytes, the GEMM rate, the memory
bandwidth, roofline multiples.

Note [Fastest run for cost models]
On a shared machine other processes only ever slow a run down, so the fastest
of several runs is the closest to what the machine can reach (the advice of
Python's ``timeit``): the rates a roofline divides by (the GEMM rate, the memory
bandwidth) are the fastest runs. The times the complexity section reports and
fits, its experiment parts' (``experiments/``) included, are medians of blocks
on the trusted clock, flagged where they spread (Note [Trusted times]).

Note [Forward+backward FLOP convention]
A map is charged 3× its forward FLOPs for forward+backward: the backward of a
product C = AB is two products of the same size (∂A = ∂C·Bᴴ, ∂B = Aᴴ·∂C), so a
map built of products costs twice its forward again. Its bytes are charged the
same 3× (Note [Bytes model] in `stiefel.parametrizations.base`).

Note [Trusted times]
On a machine other jobs share, a wall time counts the waits for a core. Where
the work runs on one thread (one torch thread, on the CPU: the harness's
default) the thread CPU clock (``time.thread_time``) counts only this thread's
work, so `measure` reports the median of that clock, the wall clock beside it.
A measurement is flagged (pyperf's rule) when its repeats spread, MAD / median
> `SPREAD`, or its wall time exceeds its CPU time by > `CONTENTION` × (it waited
for a core); tables mark flagged cells, fits and roofline multiples refuse
them. Elsewhere (several threads, a GPU) the wall clock is the only one.

Note [Timed blocks]
A call of a millisecond is at the mercy of the clock's granularity, of one
context switch and of the caches another process left: one repeat is a block
of calls lasting at least `BLOCK_S` on the trusted clock (the count doubled
from one until it does, as ``timeit``'s autorange and ``torch.utils.benchmark``'s
``blocked_autorange``), its time per call. The calls compared with each other
(every map at one size, every step on one shape) are measured by
`measure_many` in rounds, one block of each per round in an order rotated by
one each round: a change of the machine's speed during the measurement, other
jobs starting or ending, falls on all of them alike and the ratios between
their medians keep; measured one after another, a slow spell would fall on
whichever ran then.

Note [Roofline]
Nothing runs faster than its FLOPs at the GEMM rate or its bytes at the memory
bandwidth: the roofline time is max(FLOPs / rate, bytes / bandwidth), its bound
the larger term, both rates measured in the run (`gemm_rate`, `stream_bandwidth`),
the bytes the classes' models (map ``bytes``, optimizer ``step_bytes``).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import optimizers, parametrizations

__all__ = [
    "timed", "run_times", "fastest_time", "gemm_rate", "stream_bandwidth", "peak_bytes",
    "saved_bytes", "fit_exponent", "roofline", "roofline_multiple", "map_flops", "map_bytes",
    "optimizer_steps", "GEOOPT_STEPS", "FWD_BWD_FACTOR", "machine", "measure", "measure_many",
    "flag", "one_thread", "SPREAD", "CONTENTION", "BLOCK_S",
]  # fmt: skip

#: geoopt's steps measured beside ours (the canonical ones form and solve an N×N system)
GEOOPT_STEPS = (
    "geoopt RiemannianSGD CanonicalStiefel",
    "geoopt RiemannianSGD EuclideanStiefel",
    "geoopt RiemannianAdam CanonicalStiefel",
)
#: forward+backward FLOPs and bytes of a map, in forward ones (Note [Forward+backward FLOP
#: convention])
FWD_BWD_FACTOR = 3.0


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _block(fn: Callable[[], object], calls: int = 1) -> tuple[float, float]:
    """(thread CPU, wall) seconds per call of ``calls`` calls of ``fn()`` (CUDA work included)."""
    _sync()
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.thread_time() - c0) / calls, (time.perf_counter() - w0) / calls


def timed(fn: Callable[[], object]) -> float:
    """Wall time of one call ``fn()`` in seconds (CUDA work included)."""
    return _block(fn)[1]


def _median_mad(times: list[float]) -> tuple[float, float]:
    med = statistics.median(times)
    return med, statistics.median(abs(t - med) for t in times)


#: MAD / median of a measurement's repeats above which it is flagged (Note [Trusted times])
SPREAD = 0.1
#: median wall / CPU time above which a one-thread measurement waited for a core
CONTENTION = 1.5
#: seconds a timed block of calls lasts at least on the trusted clock (Note [Timed blocks])
BLOCK_S = 0.02


def machine(workers: int = 1) -> dict:
    """The CPU model, cores, torch threads, ``workers`` and the 1-minute load average."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), cpu)
    except OSError:
        pass
    cores, threads, load = os.cpu_count(), torch.get_num_threads(), os.getloadavg()[0]
    return dict(cpu=cpu, cores=cores, threads=threads, workers=workers, load=round(load, 2))


def one_thread(device="cpu") -> bool:
    """Whether work runs on the calling thread only (CPU, one torch thread)."""
    return torch.device(device).type == "cpu" and torch.get_num_threads() == 1


def flag(cpu: list[float], wall: list[float], thread: bool) -> str | None:
    """Why repeats of these times are not to be trusted (Note [Trusted times]), or None.

    Example:
        ```python
        from stiefel.comparisons.cost import flag

        assert flag([1.0, 1.0, 1.0], [1.1, 1.0, 1.2], thread=True) is None
        assert flag([1.0, 1.5, 2.0], [1.0, 1.5, 2.0], thread=True).startswith("spread")
        assert flag([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], thread=True).startswith("wall 2")
        ```
    """
    # a wait is said first: the CPU times of a call that mostly waited are tiny and
    # spread by noise, and "spread" would hide why
    waited = statistics.median(wall) / max(statistics.median(cpu), 1e-12)
    if thread and waited > CONTENTION:
        return f"wall {waited:.1f}× CPU (> {CONTENTION:g}×: waited for a core)"
    med, mad = _median_mad(cpu if thread else wall)
    if med > 0 and mad / med > SPREAD:
        return f"spread {mad / med:.2f} (MAD / median > {SPREAD:g})"
    return None


def _warm(fn: Callable[[], object], warmup: int) -> None:
    """``warmup`` untimed calls; one over a second ends the warm-up (such a call is not
    dominated by first-call allocations and caches)."""
    for _ in range(warmup):
        if timed(fn) > 1.0:
            break


def _block_calls(fn: Callable[[], object], thread: bool, min_s: float | None = None) -> int:
    """Calls per timed block (Note [Timed blocks]): doubled from one until a block lasts
    ``min_s`` (`BLOCK_S`) on the trusted clock, or 10 × that on the wall clock (a call
    that mostly waits)."""
    calls, min_s = 1, min_s or BLOCK_S
    while calls < 1 << 20:
        cpu, wall = _block(fn, calls)
        if (cpu if thread else wall) * calls >= min_s or wall * calls >= 10 * min_s:
            break
        calls *= 2
    return calls


def _rounds(fns: Mapping, calls: Mapping, repeats: int, budget_s: float) -> dict[Any, list]:
    """(CPU, wall) per call of a block of each of ``fns`` per round, rotated by one each
    round; after at least 3 rounds, none begins once ``budget_s`` × len(fns) s are spent."""
    names, times = list(fns), {k: [] for k in fns}
    start = time.perf_counter()
    for r in range(max(repeats, 1)):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(_block(fns[k], calls[k]))
        if r >= 2 and time.perf_counter() - start > budget_s * len(names):
            break
    return times


def measure_many(
    fns: Mapping[Any, Callable[[], object]], repeats: int, device="cpu", warmup: int = 2,
    budget_s: float = 20.0,
) -> dict[Any, dict]:  # fmt: skip
    """`measure` of each of ``fns``, interleaved (Note [Timed blocks]): ``repeats`` rounds
    of one block of each.

    Example:
        ```python
        from stiefel.comparisons.cost import measure_many

        t = measure_many({"a": lambda: sum(range(1000)), "b": lambda: sum(range(4000))}, 3)
        assert t["a"]["s"] < t["b"]["s"] and t["a"]["calls"] >= t["b"]["calls"]
        ```
    """
    thread, out, calls = one_thread(device), {}, {}
    for k, fn in fns.items():
        _warm(fn, warmup)
        calls[k] = _block_calls(fn, thread)
    for k, pairs in _rounds(fns, calls, repeats, budget_s).items():
        cpu, wall = [c for c, _ in pairs], [w for _, w in pairs]
        med, mad = _median_mad(cpu if thread else wall)
        out[k] = dict(s=med, cpu_s=statistics.median(cpu), wall_s=statistics.median(wall))
        out[k] |= dict(mad_s=mad, fastest_s=min(cpu if thread else wall), calls=calls[k])
        out[k]["flag"] = flag(cpu, wall, thread)
    return out


def measure(
    fn: Callable[[], object], repeats: int, device="cpu", warmup: int = 2, budget_s: float = 20.0
) -> dict:
    """Times of ``fn()`` per call on the trusted clock (Note [Trusted times]) over ``repeats``
    blocks of calls (Note [Timed blocks]): ``s`` the median, ``cpu_s``/``wall_s`` the clocks'
    medians, ``mad_s``, ``fastest_s``, ``flag`` and ``calls`` (per block)."""
    return measure_many({0: fn}, repeats, device, warmup, budget_s)[0]


def run_times(
    fn: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float = 20.0
) -> list[float]:
    """Wall times of up to ``repeats`` single calls of ``fn()`` after ``warmup`` untimed
    ones (`_warm`); none begins after 3 once ``budget_s`` seconds are spent, so that a slow
    anchor cannot stall a whole measurement."""
    _warm(fn, warmup)
    return [w for _, w in _rounds({0: fn}, {0: 1}, repeats, budget_s)[0]]


def fastest_time(
    fn: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float = 20.0
) -> float:
    """Fastest wall time of ``fn()`` over ``repeats`` runs (Note [Fastest run for cost models]).

    Example:
        ```python
        from stiefel.comparisons.cost import fastest_time

        assert fastest_time(lambda: sum(range(100)), repeats=3) > 0
        ```
    """
    return min(run_times(fn, repeats, warmup, budget_s))


def gemm_rate(n: int = 1024, dtype=torch.float32, device="cpu", repeats: int = 25) -> float:
    """Measured FLOP/s of an n×n GEMM (n >= 512): the roofline the FLOP models are divided by.

    The fastest of ``repeats`` runs (Note [Fastest run for cost models]): a
    roofline is the rate the machine reaches; a product smaller than 512×512
    measures call overhead, not the rate.
    """
    n = max(int(n), 512)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / measure(lambda: a @ b, repeats, device, warmup=1)["fastest_s"]


def stream_bandwidth(device="cpu", mib: int = 256, repeats: int = 10) -> float:
    """Measured bytes/s of the STREAM triad a = b + ½c on float32 arrays of ``mib`` MiB each.

    3 arrays of traffic, as STREAM counts (not a CPU's write-allocate read of a); the
    fastest of ``repeats`` runs. 256 MiB is several times a server's last-level cache.
    """
    n = max(int(mib), 1) * 2**20 // 4
    b, c = torch.ones(n, device=device), torch.ones(n, device=device)
    a = torch.empty_like(b)
    triad = lambda: torch.add(b, c, alpha=0.5, out=a)  # noqa: E731
    return 3 * 4 * n / measure(triad, repeats, device, warmup=1)["fastest_s"]


class _HeldBytes(TorchDispatchMode):
    """Counts the bytes of the storages torch ops create, until each is freed.

    An op's output whose storage is one of its inputs' (a view, an in-place
    op) allocates nothing; a new storage is counted from the op's return until
    its finalizer runs (torch keeps a storage's Python object as long as the
    storage lives, so the finalizer runs when the memory is released).
    """

    def __init__(self) -> None:
        super().__init__()
        self.held = self.peak = 0
        self.live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.held -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = tree_flatten((args, kwargs))[0]
        inputs = {id(t.untyped_storage()) for t in flat if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, size = id(st), st.nbytes()
            if key in inputs or key in self.live or not size:
                continue
            self.live[key] = size
            self.held += size
            self.peak = max(self.peak, self.held)
            weakref.finalize(st, self._free, key)
        return out


def peak_bytes(fn, device="cpu") -> int:
    """Peak of the bytes that torch ops allocate during ``fn()`` and still hold.

    CUDA: the caching allocator's peak statistic above what was allocated
    before. CPU, which keeps no such statistic: every op's new output storages
    are counted from their creation until they are freed (kernel-internal
    workspaces, e.g. LAPACK's, are not seen).

    Example:
        ```python
        import torch
        from stiefel.comparisons.cost import peak_bytes

        a = torch.randn(256, 256)
        assert peak_bytes(lambda: a @ a) == 256 * 256 * 4  # the 256 KiB result
        ```
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    with _HeldBytes() as mode:
        fn()
    return mode.peak


def saved_bytes(fn) -> int:
    """Bytes autograd saves for the backward of ``fn()`` (the activation memory)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def fit_exponent(sizes: list[float], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(size).

    Example:
        ```python
        from stiefel.comparisons.cost import fit_exponent

        assert round(fit_exponent([1, 2, 4], [3.0, 24.0, 192.0]), 6) == 3.0
        ```
    """
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, 1e-12)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def roofline(
    flops: float, rate: float, nbytes: float | None = None, bandwidth: float = math.nan
) -> tuple[float, str]:
    """Roofline time max(flops / rate, nbytes / bandwidth) and its bound (Note [Roofline]).

    Without ``nbytes`` the FLOP term alone; NaN (bound "–") when a model it
    divides is missing (NaN or <= 0).

    Example:
        ```python
        from stiefel.comparisons.cost import roofline

        assert roofline(1e9, 1e10, 4e8, 1e9) == (0.4, "bytes")  # 0.1 s of FLOPs, 0.4 s of bytes
        assert roofline(1e9, 1e10) == (0.1, "flops")
        ```
    """
    times = {"flops": flops / rate} | ({} if nbytes is None else {"bytes": nbytes / bandwidth})
    if not all(math.isfinite(t) and t > 0 for t in times.values()):
        return math.nan, "–"
    bound = max(times, key=times.__getitem__)
    return times[bound], bound


def roofline_multiple(seconds: float, flops: float, rate: float, *bytes_at: float) -> float:
    """``seconds / roofline(flops, rate, *bytes_at)``; without ``(nbytes, bandwidth)`` the
    multiple of the FLOP model at the GEMM rate. Above 1 time goes to lower-rate kernels,
    Python loops, host syncs; below 1 a model over-counts (or operands stayed in cache)."""
    return seconds / roofline(flops, rate, *bytes_at)[0]


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)


def map_flops(method: str, n: int, m: int, reflections: int | None = None) -> float:
    """Forward FLOPs the registered map class ``method`` declares (NaN: no model)."""
    return _number(parametrizations.maps()[method].flops(n, m, reflections))


def map_bytes(method: str, n: int, m: int, reflections: int | None, itemsize: int) -> float:
    """Forward bytes the registered map class ``method`` declares (Note [Bytes model])."""
    return _number(parametrizations.maps()[method].bytes(n, m, reflections, itemsize))


def _step_label(name: str, variant: dict) -> str:
    if not variant:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in sorted(variant.items()))})"


def optimizer_steps() -> dict[str, tuple[optimizers.OptimizerInfo, dict]]:
    """Every registered Riemannian optimizer × its declared variants, by label.

    Example:
        ```python
        from stiefel.comparisons.cost import optimizer_steps

        info, variant = optimizer_steps()["rgd(metric=canonical,retraction=qr)"]
        assert info.name == "rgd" and variant == {"metric": "canonical", "retraction": "qr"}
        ```
    """
    infos = [optimizers.info(name) for name in optimizers.available()]
    return {_step_label(i.name, v): (i, dict(v)) for i in infos if i.riemannian for v in i.variants}
