r"""What a step over a whole model costs the host: ops, host reads and host time per step.

Run ``python -m benchmarks.launch`` (``--quick`` for a short run, ``--device cuda``
on a GPU). On a GPU a step over many parameters is bound by kernel launches and
host reads, not by FLOPs; both are counted here without a GPU, and neither
depends on the machine's load:

- ``ops``: ATen operations dispatched by one ``opt.step()`` (a
  `TorchDispatchMode` sees each one; on a GPU each is at least one launch);
- ``reads``: host reads of a tensor's value in that step (``.item()``,
  ``float(t)``, ``bool(t)``, ``torch.equal``, ``.tolist()``; on a GPU each one
  waits for every queued kernel, under ``torch.compile`` each one breaks the graph);
- ``host``: the CPU time of one step on the calling thread (one torch thread,
  the median of interleaved rounds), with the wall time beside it.

Parameter sets: 200 × St(8, 4), 200 × St(64, 16), and a transformer-like set of
48 matrices (12 blocks of 256×768, 256×256, 256×1024 and 1024×256, stepped as
tall points: St(768, 256), O(256), St(1024, 256) twice); on request (``--sets``)
one St(4096, 64) and 4096 × St(64, 16) as one parameter, where a step must cost
what it did before the buckets (``--before``), and ``transformer32``, the
transformer-like set's structure at 1/32 of its sizes (the same buckets; the operation
counts differ where a kernel's path depends on the size, as Euler's product for the
M×M solves up to M = 128 on a CPU, or the drift correction's period): on a CPU its
host time is the host side of the transformer-like step, without its arithmetic. Each optimizer
of this package (every Riemannian optimizer of the registry, ``rgd`` with the QR
retraction and ``manifold_muon`` with one inner step, `VARIANTS`), with
``foreach=True`` (what ``foreach=None`` does on a GPU; on the CPU it leaves
parameters over 65,536 entries unstacked, Note [One rule call per bucket]), steps
them beside torch's Adam (foreach and fused), torch's Muon, pogo-torch's POGO and
geoopt's RiemannianSGD / RiemannianAdam on the same points with the same fixed
gradients. ``flat`` is the ratio of a step's ops on the separate parameters to its
ops on the same matrices stacked, one parameter per distinct shape (1: the step
costs what the stacked matrices cost).

``--device cuda`` times every step on the GPU (synchronised wall time) and, for
the optimizers that take ``capturable=True``, one replay of the step captured
in a CUDA graph.

Example:

```text
python -m benchmarks.launch --quick
python -m benchmarks.launch --sets st64x16 --optimizers rgd,pogo
python -m benchmarks.launch --device cuda --json /tmp/launch_cuda.json
```
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from typing import Any

import geoopt
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stiefel import optimizers
from stiefel.manifolds import Orthogonal, Stiefel

from . import _before
from ._timing import (
    both_clocks,
    device_of,
    fmt_ratio,
    fmt_time,
    header,
    interleaved,
    table,
    write_json,
)
from ._timing import rounds as timing_rounds

#: the parameter sets: name → list of (count, N, M) blocks of tall points
SETS: dict[str, list[tuple[int, int, int]]] = {
    "st8x4": [(200, 8, 4)],
    "st64x16": [(200, 64, 16)],
    "transformer": [(12, 768, 256), (12, 256, 256), (12, 1024, 256), (12, 1024, 256)],
}
#: on request only (``--sets``): one large point and one large batch (a single stacked
#: parameter), the step on one large matrix, which the buckets must leave as fast; and
#: the transformer-like set's structure at 1/32 of its sizes, its host side (the same
#: buckets, where the arithmetic is negligible; the operations differ where a kernel's
#: path or its drift correction's period depends on the size)
LARGE_SETS: dict[str, list[tuple[int, int, int]]] = {
    "st4096x64": [(1, 4096, 64)],
    "batch4096": [(4096, 64, 16)],
    "transformer32": [(12, 24, 8), (12, 8, 8), (12, 32, 8), (12, 32, 8)],
}
#: the sets whose matrices are one parameter (a batch), not separate parameters
STACKED = {"batch4096"}
QUICK_SETS: dict[str, list[tuple[int, int, int]]] = {
    "st8x4": [(24, 8, 4)],
    "st64x16": [(24, 64, 16)],
    "transformer": [(2, 96, 32), (2, 32, 32), (2, 128, 32), (2, 128, 32)],
}
LR = 1e-3
#: the reads of a tensor's value on the host, as dispatched
READS = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}


class StepCounter(TorchDispatchMode):
    """Counts the ATen ops and the host reads of a tensor's value while active.

    A read of an optimizer's step counter is not counted: torch keeps ``state["step"]``
    on the CPU (unless ``capturable``), where reading it waits for no device.
    """

    def __init__(self, opt: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0
        self.opt = opt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if str(func) in READS and not self._counter(args[0]) or _to_host(func, args, kwargs or {}):
            self.reads += 1
        return func(*args, **(kwargs or {}))

    def _counter(self, t) -> bool:
        if self.opt is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return False
        return any(s.get("step") is t for s in self.opt.state.values())

    def __enter__(self):
        # ``tolist`` reads the whole tensor without a dispatched op: count it here
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t: torch.Tensor):
            counter.reads += 1
            return counter._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _to_host(func, args, kwargs) -> bool:
    """A copy from a CUDA tensor to the CPU (``.cpu()``, ``.to("cpu")``)."""
    if str(func) not in ("aten._to_copy.default", "aten.copy_.default") or not args:
        return False
    src = args[-1] if str(func) == "aten.copy_.default" else args[0]
    dst = args[0].device if str(func) == "aten.copy_.default" else kwargs.get("device")
    return (
        isinstance(src, torch.Tensor)
        and src.device.type == "cuda"
        and dst is not None
        and torch.device(dst).type == "cpu"
    )


def counts(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(ops, host reads) of one ``opt.step()``, after two warm-up steps."""
    opt.step()
    opt.step()
    with StepCounter(opt) as c:
        opt.step()
    return c.ops, c.reads


def _points(blocks, device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for count, n, m in blocks:
        for _ in range(count):
            out.append(torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))[0])
    return [x.float().contiguous().to(device) for x in out]


def _manifold(n: int, m: int):
    return Orthogonal(n) if n == m else Stiefel(n, m)


def _ours(name: str, **hyper):
    def make(points, stacked):
        params = [
            geoopt.ManifoldParameter(x.clone(), manifold=_manifold(*x.shape[-2:])) for x in points
        ]
        return params, optimizers.create(name, params, lr=LR, foreach=True, **hyper)

    return make


def _plain(factory):
    def make(points, stacked):
        params = [torch.nn.Parameter(x.clone()) for x in points]
        return params, factory(params)

    return make


def _pogo_torch(points, stacked):
    import pogo
    import pogo.base

    # pogo-torch steps batches only ([*batch, p, q]): a single matrix is a batch of one
    params = [torch.nn.Parameter(x.clone() if stacked else x[None].clone()) for x in points]
    return params, pogo.POGO(params, pogo.base.SGD(), lr=LR, rows=False)


def _geoopt(cls):
    def make(points, stacked):
        params = [
            geoopt.ManifoldParameter(x.clone(), manifold=geoopt.EuclideanStiefel()) for x in points
        ]
        return params, cls(params, lr=LR)

    return make


def _earlier(package, name: str, **hyper):
    """The same optimizer of an earlier commit (`benchmarks._before`), on its own manifolds."""
    man = package.manifolds

    def make(points, stacked):
        params = [
            geoopt.ManifoldParameter(
                x.clone(), manifold=man.Orthogonal(n) if n == m else man.Stiefel(n, m)
            )
            for x in points
            for n, m in [x.shape[-2:]]
        ]
        return params, package.optimizers.create(name, params, lr=LR, **hyper)

    return make


#: our optimizers with other settings than their defaults: label → (name, hyperparameters)
VARIANTS = {
    "rgd (qr)": ("rgd", {"retraction": "qr"}),
    # what manifold_muon's default ten msign evaluations of its dual descent cost
    "manifold_muon (inner_steps=1)": ("manifold_muon", {"inner_steps": 1}),
}


def candidates(before=None) -> dict[str, Callable]:
    """label → factory(points, stacked) -> (params, optimizer); ours first, then the peers.

    ``before``: an earlier commit's package (`benchmarks._before.load`); each of our
    optimizers is then followed by the same one at that commit, labelled "(before)".
    """
    ours = {}
    for name in optimizers.available():
        cls = optimizers.get(name)
        if isinstance(cls, type) and issubclass(cls, optimizers.RiemannianOptimizer):
            ours[name] = _ours(name)
            if before is not None and name in before.optimizers.available():
                ours[f"{name} (before)"] = _earlier(before, name)
            for label, (base, hyper) in VARIANTS.items():
                if base == name:
                    ours[label] = _ours(name, **hyper)
                    if before is not None and name in before.optimizers.available():
                        ours[f"{label} (before)"] = _earlier(before, name, **hyper)
    peers = {
        "torch Adam foreach": _plain(lambda ps: torch.optim.Adam(ps, lr=LR, foreach=True)),
        "torch Adam fused": _plain(lambda ps: torch.optim.Adam(ps, lr=LR, fused=True)),
        "torch Muon": _plain(lambda ps: torch.optim.Muon(ps, lr=LR)),
        "pogo-torch": _pogo_torch,
        "geoopt RSGD (qr)": _geoopt(geoopt.optim.RiemannianSGD),
        "geoopt RAdam (qr)": _geoopt(geoopt.optim.RiemannianAdam),
    }
    return {**ours, **peers}


def _stack(points: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same matrices, one stacked tensor per distinct shape."""
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for x in points:
        by_shape.setdefault(tuple(x.shape), []).append(x)
    return [torch.stack(xs) for xs in by_shape.values()]


def _stepper(make, points, grads, stacked=False):
    params, opt = make(points, stacked)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone().reshape(p.shape)
    return opt


def measure_set(
    name: str, blocks, device, rounds: int, only: list[str] | None, before=None
) -> list[dict]:
    """Ops, reads and host time per step of every candidate on one parameter set."""
    points = _points(blocks, device)
    if name in STACKED:
        points = _stack(points)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(x.shape, generator=gen).to(device) for x in points]
    stacked_points, stacked_grads = _stack(points), _stack(grads)
    rows, steps = [], {}
    for label, make in candidates(before).items():
        if only and label.split(" ")[0] not in only and label not in only:
            continue
        try:
            opt = _stepper(make, points, grads)
            ops, reads = counts(opt)
        except Exception as err:  # noqa: BLE001 - a peer that cannot step this set is reported
            rows.append({"set": name, "optimizer": label, "error": f"{type(err).__name__}: {err}"})
            continue
        flat = float("nan")  # a set that is one parameter has nothing to stack
        try:
            if len(points) > 1:
                stacked = _stepper(make, stacked_points, stacked_grads, stacked=True)
                flat = ops / counts(stacked)[0]
        except Exception:  # noqa: BLE001 - e.g. torch's Muon steps 2-D parameters only
            pass  # shown as "—", which the legend explains
        steps[label] = opt.step
        rows.append({"set": name, "optimizer": label, "ops": ops, "reads": reads, "flat": flat})
    # both clocks around the same calls: a step's thread time never exceeds its wall time
    times = timing_rounds(steps, rounds, _both(device))
    for row in rows:
        if row["optimizer"] in steps:
            pairs = times[row["optimizer"]]
            row["host_s"] = statistics.median(t for t, _ in pairs)
            row["wall_s"] = statistics.median(w for _, w in pairs)
    return rows


def _both(device):
    """`both_clocks` on ``device``: (thread CPU time, wall time) of one call."""
    return lambda fn: both_clocks(fn, device)


def _wall(device):
    """The wall time of `both_clocks` on ``device`` (synchronised on a GPU)."""
    return lambda fn: both_clocks(fn, device)[1]


def captured(name: str, blocks, device, rounds: int) -> list[dict]:
    """One replay of each capturable step in a CUDA graph, against its eager step."""
    points = _points(blocks, device)
    points = _stack(points) if name in STACKED else points
    grads = [torch.randn_like(x) for x in points]
    rows = []
    for label in candidates():
        ours, hyper = VARIANTS.get(label, (label, {}))
        if ours not in optimizers.available():  # a peer
            continue
        params = [
            geoopt.ManifoldParameter(x.clone(), manifold=_manifold(*x.shape[-2:])) for x in points
        ]
        try:
            opt = optimizers.create(ours, params, lr=LR, capturable=True, **hyper)
        except (TypeError, ValueError) as err:
            rows.append({"set": name, "optimizer": label, "error": str(err)})
            continue
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        t = interleaved({"eager": opt.step, "graph": graph.replay}, rounds, _wall(device))
        rows.append({"set": name, "optimizer": label, "eager_s": t["eager"], "graph_s": t["graph"]})
    return rows


#: what the columns of `results_table` count
LEGEND = """\
- ops/step: ATen operations one step dispatches (a GPU launches at least one kernel each)
- reads/step: reads of a tensor's value on the host (each a wait for a GPU's queue)
- flat: ops on the separate parameters ÷ ops on the same matrices stacked, one parameter
  per shape (—: the set is one parameter, or the optimizer cannot step the stack, as
  torch's Muon steps 2-D parameters only)
- host/step: the step's CPU time on its thread (the host side of a GPU step); wall/step:
  its wall time, of the same calls; each the median of {rounds} interleaved rounds
- host ÷ torch Adam foreach: host/step over that of torch's Adam (foreach) in the same
  run and set (—: on a GPU, where host/step is not taken: the host waits for the device)"""


def describe(blocks: list[tuple[int, int, int]], stacked: bool) -> str:
    """A parameter set in words: its matrices (equal shapes counted together) and how many
    parameters hold them."""
    counts: dict[tuple[int, int], int] = {}
    for count, n, m in blocks:
        counts[n, m] = counts.get((n, m), 0) + count
    parts = " + ".join(
        f"{count} × {'O' if n == m else 'St'}({n}{'' if n == m else f', {m}'})"
        for (n, m), count in counts.items()
    )
    total = sum(count for count, _, _ in blocks)
    holders = "one parameter" if stacked or total == 1 else f"{total} parameters"
    return f"{parts} ({holders})"


def results_table(rows: list[dict[str, Any]], anchor: str = "torch Adam foreach") -> str:
    """The markdown table of `measure_set`'s rows, host time also as a ratio to ``anchor``."""
    base = {r["set"]: r.get("host_s") for r in rows if r["optimizer"] == anchor}
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["set"], r["optimizer"], "—", "—", "—", "—", "—", r["error"][:60]])
            continue
        host = r.get("host_s")
        body.append([
            r["set"], r["optimizer"], str(r["ops"]), str(r["reads"]),
            "—" if math.isnan(r["flat"]) else f"{r['flat']:.2f}",
            fmt_time(host), fmt_time(r.get("wall_s")),
            fmt_ratio(None if host is None or not base.get(r["set"]) else host / base[r["set"]]),
        ])  # fmt: skip
    cols = ["set", "optimizer", "ops/step", "reads/step", "flat", "host/step", "wall/step"]
    return table([*cols, f"host ÷ {anchor}"], body)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sets, few rounds")
    parser.add_argument(
        "--sets",
        default=None,
        help=f"comma-separated, of {', '.join(SETS)} (the default: all three) and "
        f"{', '.join(LARGE_SETS)} (one St(4096, 64); 4096 × St(64, 16) as one parameter; "
        "the transformer-like set at 1/32 of its sizes)",
    )
    parser.add_argument("--optimizers", default=None, help="comma-separated labels to keep")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda[:k]: time the GPU too"
    )
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument(
        "--before",
        default=None,
        metavar="REF",
        help="also step our optimizers as of commit REF of this checkout, in the same rounds",
    )
    args = parser.parse_args(argv)
    device = device_of(args.device, parser)
    sets = QUICK_SETS if args.quick else SETS
    chosen = list(sets) if args.sets is None else args.sets.split(",")
    sets = {**sets, **LARGE_SETS}
    unknown = sorted(set(chosen) - set(sets))
    if unknown:
        parser.error(f"--sets {','.join(unknown)}: unknown; allowed: {', '.join(sets)}")
    only = None if args.optimizers is None else args.optimizers.split(",")
    rounds = args.rounds or (3 if args.quick else 15)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host time of one thread (Note [Thread CPU time ...])
    before = None
    if args.before is not None:
        try:
            before = _before.load(args.before)
        except ValueError as err:
            parser.error(str(err))
    rows = []
    for name in chosen:
        rows += measure_set(name, sets[name], device, rounds, only, before)
    out = [
        header(
            "Ops, host reads and host time per optimizer step",
            device,
            peers=("pogo-torch", "geoopt"),
        ),
        "",
    ]
    out += [f"- {name}: {describe(sets[name], name in STACKED)}" for name in chosen]
    if args.quick:
        out.append("- --quick: smaller sets than the full ones of the same names")
    if before is not None:
        out.append(f"- (before): commit {before.__commit__[:12]}, stepped in the same rounds")
    out += ["", results_table(rows).rstrip("\n"), "", LEGEND.format(rounds=rounds)]
    graph_rows = []
    if device.type == "cuda":
        for name in chosen:
            graph_rows += captured(name, sets[name], device, rounds)
        body = [
            [r["set"], r["optimizer"], fmt_time(r.get("eager_s")), fmt_time(r.get("graph_s")),
             fmt_ratio(r["eager_s"] / r["graph_s"]) if "graph_s" in r else r.get("error", "")[:60]]
            for r in graph_rows
        ]  # fmt: skip
        out += ["", table(["set", "optimizer", "eager", "captured", "speed-up"], body)]
    text = "\n".join(out)
    print(text)
    if args.json:
        write_json(args.json, {"rows": rows, "captured": graph_rows})
    return text


if __name__ == "__main__":
    main()
