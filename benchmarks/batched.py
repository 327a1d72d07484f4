r"""Many small orthogonal matrices (the regime POGO targets): step time and drift.

Run from a checkout: ``python -m benchmarks.batched`` (``--quick`` for a short run).
Two problems, float32: a batch of 4096 points on St(64, 16) and of 1024 on O(64).
For each optimizer (this package's ``rgd``, ``radam``, ``landing``, ``pogo``,
``manifold_muon`` through ``stiefel.optimizers.create``; pogo-torch's ``POGO``
and geoopt's ``RiemannianSGD`` as anchors, in the same run) it prints the time
of ``step()`` on a fixed gradient (the median over ``--rounds`` interleaved rounds,
in each of which every optimizer takes ``--timed`` steps in turn, of the mean of
a round's steps after its first), the ratio to pogo-torch's step with the
same kind of base (``SGD`` for the plain steps, ``VectorAdam`` for ``radam`` and
``pogo``'s adam base), and the orthogonality drift max ‖XᴴX − I‖_F (in float64) over the
batch after ``--steps`` steps of
the loss ‖X − T‖²_F towards a fixed random target T (gradient 2(X − T),
formed by hand so that only the optimizer is timed), run after the timing rounds.
An optimizer whose step takes longer than ``--slow-s`` seconds runs only the
steps of the rounds: the column "steps" gives the count its drift and loss were
measured after. ``--layout``
chooses how the points are stored: ``column`` (per matrix, as ``torch.linalg.qr``
returns them, the default of the earlier tables) or ``row`` (as a parameter
created by torch, or `Stiefel.random`, is). Timings on a shared machine are
noisy: compare ratios measured in the same run only.

Note [Page faults in a step's time]
The column "faults" is the median over the rounds of the minor page faults per
timed step: memory the allocator had given back to the OS and maps again, zeroed,
at first touch. glibc returns a freed block to the OS once the free memory at the
top of its heap exceeds a threshold that itself moves with the sizes freed, so
whether a step's temporaries fault depends on what the process allocated before
as much as on the step, and a batched step's temporaries are large enough for the
faults to be a visible part of its time. A row with many faults measures the
allocator's state beside the arithmetic; its ratio is not one of the step's
alone (docs/results.md, "Page faults in the batched table, and batches stepped
by rows", has the figures).
So by default (``--malloc keep``) the run first asks glibc, through ``mallopt``, to
keep freed memory in the process (no trimming; blocks up to 256 MiB from the heap,
not from their own mappings): after its first steps no row faults, whichever
library it is, and the ratios compare the steps. The limit is above every row's
largest temporary: geoopt's canonical ``Stiefel()`` forms an N×N matrix per point,
64 MiB on 4096 × St(64, 16), which a limit of 32 MiB left to fresh mappings at
every step. A glibc that refuses the limit gets 32 MiB, and the header says so.
``--malloc default`` measures with glibc's own settings, as a program that does
not tune them runs.

The row "geoopt rsgd (canonical Stiefel)" is geoopt's ``RiemannianSGD`` on
``geoopt.Stiefel()`` (its ``CanonicalStiefel``: the canonical metric's Cayley
retraction through the N×N matrix), geoopt's default Stiefel manifold.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time

import geoopt
import torch

from stiefel import optimizers
from stiefel.manifolds import Orthogonal, Stiefel

from ._timing import device_name, device_of, versions


def _haar(batch: int, n: int, m: int, seed: int, layout: str = "column") -> torch.Tensor:
    """Haar points, stored by columns (QR's Q, as LAPACK returns it) or by rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(batch, n, m, generator=gen))[0]
    return q.contiguous() if layout == "row" else q


def _candidates(lr: float, muon_inner: int):
    """(label, factory(x0) -> (param, optimizer), anchor): the anchor is the label of the
    pogo-torch row of the same kind of step, SGD (plain) or vector adam (adaptive)."""

    def ours(name, **hyper):
        def make(x0, man):
            p = geoopt.ManifoldParameter(x0.clone(), manifold=man)
            return p, optimizers.create(name, [p], **hyper)

        return make

    def pogo_torch(base):
        def make(x0, man):
            import pogo
            import pogo.base

            p = torch.nn.Parameter(x0.clone())
            opt = pogo.base.SGD() if base == "sgd" else pogo.base.VectorAdam()
            return p, pogo.POGO([p], opt, lr=lr, rows=False)

        return make

    def geoopt_rsgd(x0, man):  # geoopt.Stiefel() is its CanonicalStiefel
        p = geoopt.ManifoldParameter(x0.clone(), manifold=geoopt.Stiefel())
        return p, geoopt.optim.RiemannianSGD([p], lr=lr)

    # the pogo-torch rows first (the references of the ratio column), the slowest last
    sgd, adam = "pogo-torch (sgd)", "pogo-torch (vector adam)"
    return [
        (sgd, pogo_torch("sgd"), sgd),
        (adam, pogo_torch("adam"), adam),
        ("geoopt rsgd (canonical Stiefel)", geoopt_rsgd, sgd),
        ("rgd (cayley)", ours("rgd", lr=lr), sgd),
        ("rgd (qr)", ours("rgd", lr=lr, retraction="qr"), sgd),
        ("radam (cayley)", ours("radam", lr=lr), adam),
        ("landing", ours("landing", lr=lr), sgd),
        ("pogo (sgd)", ours("pogo", lr=lr, base="sgd"), sgd),
        ("pogo (adam)", ours("pogo", lr=lr, base="adam"), adam),
        (
            f"manifold_muon inner={muon_inner}",
            ours("manifold_muon", lr=lr, inner_steps=muon_inner),
            sgd,
        ),
        ("manifold_muon", ours("manifold_muon", lr=lr), sgd),
    ]


def chosen_problems(
    text: str, batch_st: int, batch_o: int, parser: argparse.ArgumentParser
) -> list[tuple[str, int, int, int]]:
    """(title, batch, N, M) of the problems ``--problems`` names (St, O, comma-separated)."""
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    if not wanted or set(wanted) - {"St", "O"}:
        parser.error(f"--problems={text!r}: allowed: St, O (comma-separated)")
    problems = [("St(64, 16)", batch_st, 64, 16), ("O(64)", batch_o, 64, 64)]
    return [p for p in problems if p[0].split("(")[0] in wanted]


def minor_faults() -> float:
    """The minor page faults this process has taken so far (Note [Page faults in a step's time]).

    NaN where the platform has no ``getrusage`` (Windows): the column then reads nan.
    """
    try:
        import resource
    except ImportError:
        return math.nan
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


#: mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the mmap threshold asked for: above every row's largest temporary, then the largest
#: that glibc's manual promises on 64-bit systems (Note [Page faults in a step's time])
KEEP_BLOCKS, KEEP_BLOCKS_FALLBACK = 256 << 20, 32 << 20


def keep_freed_memory() -> str:
    """Ask glibc's malloc to keep freed memory in this process; what was applied, in words.

    No trimming of the heap's top, and blocks up to `KEEP_BLOCKS` from the heap (up to
    `KEEP_BLOCKS_FALLBACK` where glibc refuses that; Note [Page faults in a step's time]).

    Returns:
        ``"keep (blocks up to … MiB from the heap)"`` when the settings took, otherwise
        which did not.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
        return "default (this C library has no mallopt)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    refused = []  # glibc's mallopt returns 1 on success
    if mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        refused.append("trim threshold")
    blocks = next(
        (b for b in (KEEP_BLOCKS, KEEP_BLOCKS_FALLBACK) if mallopt(_M_MMAP_THRESHOLD, b) == 1), None
    )
    if blocks is None:
        refused.append("mmap threshold")
    kept = "keep" if blocks is None else f"keep (blocks up to {blocks >> 20} MiB from the heap)"
    return kept if not refused else f"{kept}, except: mallopt refused the {', '.join(refused)}"


def _step(p, opt, target, clock=time.perf_counter) -> tuple[float, float]:
    """One step on the gradient 2(X − T), formed outside the timed interval; its time
    and its minor page faults."""
    with torch.no_grad():
        p.grad = 2 * (p.detach() - target)
    faults, t = minor_faults(), clock()
    opt.step()
    t = clock() - t
    return t, minor_faults() - faults


def _rounds(arms: list[dict], target, rounds: int, timed: int, clock) -> None:
    """Interleaved timing: in each round every arm takes ``timed`` steps in turn.

    A round's time of an arm is the mean of its steps after the first (the first
    warms what the other arms evicted), not their median: a square step of ``rgd``
    forms its wide XᴴX and corrects the drift at one step in `correction_period`(n)
    (the default 8 steps are whole cycles), which a median would leave out. The
    step time is the median of the rounds': rounds interleave the arms, so a change
    of the machine's speed during the run reaches every arm alike.
    """
    for _ in range(rounds):
        for arm in arms:
            steps = [_step(arm["p"], arm["opt"], target, clock) for _ in range(timed)]
            times, faults = zip(*steps, strict=True)
            kept = slice(1 if timed > 1 else 0, None)
            arm["rounds"].append(statistics.mean(times[kept]))
            arm["faults"].append(statistics.mean(faults[kept]))
            arm["steps"] += timed


def _finish(arm: dict, target, steps: int, slow_s: float) -> tuple[float, float]:
    """Run ``arm`` to ``steps`` steps (not if its step is slower than ``slow_s``); (drift, loss)."""
    if statistics.median(arm["rounds"]) <= slow_s:
        while arm["steps"] < steps:
            _step(arm["p"], arm["opt"], target)
            arm["steps"] += 1
    x = arm["p"].detach()
    return float(drift_per_matrix(x).max()), float(((x - target) ** 2).sum() / x.shape[0])


def drift_per_matrix(x: torch.Tensor) -> torch.Tensor:
    """‖XᴴX − I‖_F of each matrix of a batch, in float64: a float32 XᴴX would add its own
    rounding (~3e-7 on these shapes), the size of the differences compared."""
    xw = x.to(torch.promote_types(x.dtype, torch.float64))
    eye = torch.eye(x.shape[-1], dtype=xw.dtype, device=x.device)
    return torch.linalg.matrix_norm(xw.mH @ xw - eye)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, 20 steps")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps before the drift (1000; --quick: 20)"
    )
    parser.add_argument(
        "--timed", type=int, default=9, help="steps per arm and round (the first is dropped)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--muon-inner", type=int, default=2)
    parser.add_argument(
        "--slow-s",
        type=float,
        default=1.0,
        help="an optimizer whose step takes longer runs only the rounds' steps (see 'steps')",
    )
    parser.add_argument(
        "--problems",
        default="St,O",
        help="which problems: St (St(64, 16) batch), O (O(64) batch), comma-separated",
    )
    parser.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    parser.add_argument(
        "--layout",
        choices=("column", "row"),
        default="column",
        help="points stored per matrix by columns (torch.linalg.qr's Q) or by rows",
    )
    parser.add_argument(
        "--malloc",
        choices=("keep", "default"),
        default="keep",
        help="keep freed memory in the process (glibc mallopt; no row's time includes page "
        "faults after its first steps) or glibc's default settings",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or the CPU time of one thread (sets 1 thread; for a shared machine)",
    )
    args = parser.parse_args(argv)
    device = device_of(args.device, parser)
    clock = time.perf_counter
    if args.clock == "thread":  # Note [Thread CPU time on a shared machine] (benchmarks._timing)
        if device.type != "cpu":
            parser.error(f"--clock thread with --device {device}: allowed with --device cpu only")
        torch.set_num_threads(1)
        clock = time.thread_time
    elif device.type == "cuda":  # a step's time includes its kernels

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

    steps = args.steps if args.steps is not None else 20 if args.quick else 1000
    rounds = 2 if args.quick else args.rounds
    if min(args.timed, rounds, steps) < 1:
        parser.error(
            f"--timed={args.timed}, --rounds={rounds}, --steps={steps}: allowed: at least 1 each"
        )
    problems = chosen_problems(args.problems, *((64, 16) if args.quick else (4096, 1024)), parser)
    malloc = keep_freed_memory() if args.malloc == "keep" else "default"  # after every check
    print(
        f"torch {torch.__version__}, {device_name(device)}, {torch.get_num_threads()} threads, "
        f"float32, lr={args.lr}, {steps} steps (drift after them), step time = median of "
        f"{rounds} interleaved rounds of the mean of {max(args.timed - 1, 1)} steps "
        f"({args.clock} clock), points stored by {args.layout}s, malloc: {malloc}; "
        + versions("pogo-torch", "geoopt")
    )
    for title, batch, n, m in problems:
        man = Orthogonal(n) if n == m else Stiefel(n, m)
        x0, target = (_haar(batch, n, m, s, args.layout).to(device) for s in (0, 1))
        print(f"\n{title}, batch {batch}")
        print(
            f"{'optimizer':>32} {'step ms':>9} {'× pogo-torch':>13} {'faults':>8} "
            f"{'steps':>6} {'drift':>10} {'loss':>9}"
        )
        arms = []
        for label, make, anchor in _candidates(args.lr, args.muon_inner):
            p, opt = make(x0, man)
            arms.append(
                dict(label=label, anchor=anchor, p=p, opt=opt, rounds=[], faults=[], steps=0)
            )
        _rounds(arms, target, rounds, args.timed, clock)
        ref = {}
        for arm in arms:
            t = statistics.median(arm["rounds"])
            drift, loss = _finish(arm, target, steps, args.slow_s)
            ref.setdefault(arm["anchor"], t)  # an anchor's row comes before the rows it anchors
            print(
                f"{arm['label']:>32} {1e3 * t:>9.2f} {t / ref[arm['anchor']]:>13.2f} "
                f"{statistics.median(arm['faults']):>8.0f} {arm['steps']:>6} {drift:>10.2e} "
                f"{loss:>9.3f}",
                flush=True,
            )
            arm.clear()  # the arm's parameter and state are not needed any more


if __name__ == "__main__":
    main()
