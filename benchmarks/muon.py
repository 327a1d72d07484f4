r"""Orthogonalization engines and one Muon step against the Muon family, side by side.

Run from a checkout: ``python -m benchmarks.muon`` (``--quick`` for tiny sizes,
``--device cuda``, ``--json PATH``). On the CPU it runs on one thread and times each
call by the CPU time of that thread (Note [Thread CPU time on a shared machine] in
``benchmarks._timing``; ``--clock wall`` for wall time); every time is the median of
``--rounds`` interleaved rounds (each round calls every candidate once).

(a) Engines, one N×M float32 matrix (default 1024×4096), five steps each: this
package's `msign` by Muon's quintic and by Polar Express, each with the direct and
the Gram engine (``engine=``; ``"auto"`` takes Gram here); torch.optim.Muon's
Newton–Schulz iteration; gram-newton-schulz's ``GramNewtonSchulz`` (pure torch, no
compile). Error: ‖Q − U Vᴴ‖₂ against a float64 SVD of the same matrix.

(b) One optimizer step on eight plain 2-D weights (`STEP_SETS`: two GPT-style blocks
of width 464, 5.17 M parameters, and a square-heavy mix, 5.24 M) with a fixed
gradient, momentum 0.95, Nesterov, no weight decay, five steps of Muon's quintic:
``stiefel.optimizers.create("manifold_muon", msign="newton_schulz", msign_steps=5)``
(its msign engine "auto", and "direct" patched in) against ``torch.optim.Muon``.

The anchors, and what was changed to run them in float32:

- torch.optim.Muon iterates in bfloat16 (``grad.bfloat16()`` in its
  ``_zeropower_via_newtonschulz``); `torch_newton_schulz_float32` below is that
  function with the cast replaced by a float32 copy, nothing else changed, and the
  step's "float32" row runs torch.optim.Muon with it patched in. Its shipped
  bfloat16 iteration is shown beside it, and the first lines of the output give the
  time of a bfloat16 product relative to a float32 one on the machine (issue 25
  reported 80× slower on its CPU; 0.17× on the AMX-BF16 Xeon of docs/results.md):
  either way the comparison of equal work is the float32 one, the dtype this package
  iterates in.
- gram-newton-schulz casts X to float16 before iterating (for its GPU kernels);
  `package_gram_float32` rebuilds its own pure-torch function with that dtype name
  bound to float32 (its code is unchanged); the shipped float16 path is shown too.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import types
from collections.abc import Callable, Iterator

import torch

import stiefel.optimizers.muon as muon_module
from stiefel import optimizers
from stiefel.comparisons import cost
from stiefel.manifolds.kernels import msign, msign_flops

from ._timing import (
    device_of,
    fmt_ratio,
    fmt_time,
    header,
    interleaved,
    ratio,
    table,
    target,
    targets_table,
    thread_timed,
    write_json,
)

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: part (b)'s weight sets, 8 matrices each: two GPT-style blocks of width 464 (fused
#: qkv, out, fc1, fc2: 5.17 M parameters) and a square-heavy mix (5.24 M)
STEP_SETS = {
    "two GPT blocks, d = 464": [(1392, 464), (464, 464), (1856, 464), (464, 1856)] * 2,
    "4 × 1024², 2 × 256×1024, 2 × 1024×256": [(1024, 1024)] * 4
    + [(256, 1024)] * 2
    + [(1024, 256)] * 2,
}


def torch_newton_schulz_float32(
    grad: torch.Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` (torch 2.13), in ``dtype``.

    Copied verbatim but for ``grad.bfloat16()``, which becomes a copy in ``dtype``
    (the bfloat16 cast made a copy too, which the in-place division relies on); with
    ``dtype=torch.bfloat16`` it is torch's function (tests/comparisons/test_bench_muon.py).
    """
    a, b, c = ns_coefficients
    ortho_grad = grad.to(dtype, copy=True)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def _torch_newton_schulz_shipped(grad: torch.Tensor) -> torch.Tensor:
    from torch.optim import _muon

    return _muon._zeropower_via_newtonschulz(grad, MUON_COEFFICIENTS, 5, _muon.EPS)


def package_gram_float32() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """gram-newton-schulz's pure-torch Gram iteration in float32 (None if not installed).

    Its default coefficients (Polar Express, safety 1.05) and restart ([2]); the
    function is the package's own ``_make_compiled_gram`` closure, rebuilt with the
    name ``torch.float16`` bound to ``torch.float32``.
    """
    try:
        from gram_newton_schulz import gram_newton_schulz as gns
    except ImportError:
        return None

    class _Float32Torch:
        float16 = torch.float32

        def __getattr__(self, name: str):
            return getattr(torch, name)

    make = gns._make_compiled_gram
    rebuilt = types.FunctionType(make.__code__, {**make.__globals__, "torch": _Float32Torch()})
    fn = rebuilt(gns._TORCH_BACKEND, gns.POLAR_EXPRESS_COEFFICIENTS, [2], 1e-7, None)
    return lambda x: fn(x.unsqueeze(0))[0]


def _package_shipped() -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        import gram_newton_schulz
    except ImportError:
        return None
    return gram_newton_schulz.GramNewtonSchulz(ns_use_kernels=False, compile_kwargs=None)


def _gemm_ratio(n: int, device: torch.device, clock) -> dict[str, float]:
    """Time of an n³ product in bfloat16 and float32 (median of 3)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a16, b16 = a.bfloat16(), b.bfloat16()
    t = interleaved({"float32": lambda: a @ b, "bfloat16": lambda: a16 @ b16}, 3, clock)
    return {**t, "bf16_over_f32": t["bfloat16"] / t["float32"]}


def engines(n: int, m: int, rounds: int, device: torch.device, clock) -> list[dict]:
    """Part (a): one float32 N×M matrix (rows as dicts: time, error vs the SVD)."""
    g = torch.randn(n, m, generator=torch.Generator().manual_seed(0)).to(device)
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    exact = u @ vh
    ours = {
        (meth, eng): functools.partial(msign, g, meth, 5, engine=eng)
        for meth in ("newton_schulz", "polar_express")
        for eng in ("direct", "gram")
    }
    fns = {
        "torch.optim.Muon NS-5 (float32)": lambda: torch_newton_schulz_float32(
            g, MUON_COEFFICIENTS, 5, 1e-7
        ),
        "torch.optim.Muon NS-5 (bfloat16, shipped)": lambda: _torch_newton_schulz_shipped(g),
        "ours newton_schulz-5, direct": ours["newton_schulz", "direct"],
        "ours newton_schulz-5, gram": ours["newton_schulz", "gram"],
        "ours polar_express-5, direct": ours["polar_express", "direct"],
        "ours polar_express-5, gram": ours["polar_express", "gram"],
    }
    flops = {
        f"ours {meth}-5, {eng}": msign_flops(n, m, meth, 5, engine=eng)
        for meth in ("newton_schulz", "polar_express")
        for eng in ("direct", "gram")
    }
    package = package_gram_float32()
    if package is not None:
        fns["gram-newton-schulz Gram PE-5 (float32)"] = lambda: package(g)
        fns["gram-newton-schulz Gram PE-5 (float16, shipped)"] = functools.partial(
            _package_shipped(), g
        )
    times = interleaved(fns, rounds, clock)
    anchor = torch_newton_schulz_float32(g, MUON_COEFFICIENTS, 5, 1e-7)
    rows = []
    for label, fn in fns.items():
        q = fn().double()
        rows.append(
            {
                "label": label,
                "seconds": times[label],
                "flops": flops.get(label),
                "error_vs_svd": float(torch.linalg.matrix_norm(q - exact, 2)),
                "max_diff_vs_torch_float32": float((q - anchor.double()).abs().max()),
            }
        )
    return rows


@contextlib.contextmanager
def _patched(module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _step_candidates(shapes, device) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(1)
    weights = [(torch.randn(s, generator=gen) / s[1] ** 0.5).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    hyper = dict(lr=0.02, momentum=0.95, nesterov=True)

    def params():
        ps = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        return ps

    from torch.optim import _muon

    t32 = torch.optim.Muon(params(), weight_decay=0.0, **hyper)
    tbf = torch.optim.Muon(params(), weight_decay=0.0, **hyper)
    ours = optimizers.create(
        "manifold_muon", params(), msign="newton_schulz", msign_steps=5, **hyper
    )
    direct = optimizers.create(
        "manifold_muon", params(), msign="newton_schulz", msign_steps=5, **hyper
    )

    def patched_step(opt, module, name, value):
        def step():
            with _patched(module, name, value):
                opt.step()

        return step

    return {
        "torch.optim.Muon (float32 iteration)": patched_step(
            t32, _muon, "_zeropower_via_newtonschulz", torch_newton_schulz_float32
        ),
        "torch.optim.Muon (bfloat16 iteration, shipped)": tbf.step,
        "manifold_muon newton_schulz-5 (engine auto)": ours.step,
        "manifold_muon newton_schulz-5 (engine direct)": patched_step(
            direct, muon_module, "msign", functools.partial(msign, engine="direct")
        ),
    }


def step(shapes, rounds: int, device: torch.device, clock) -> list[dict]:
    """Part (b): one step of each optimizer on the same weights and gradients."""
    times = interleaved(_step_candidates(shapes, device), rounds, clock)
    return [{"label": k, "seconds": v} for k, v in times.items()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds")
    parser.add_argument("--shape", default="1024x4096", help="N×M of part (a)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    device = device_of(args.device, parser)
    if device.type == "cpu":
        torch.set_num_threads(1)
    clock = thread_timed if (device.type == "cpu" and args.clock == "thread") else cost.timed
    n, m = (64, 256) if args.quick else tuple(int(v) for v in args.shape.lower().split("x"))
    sets = {k: [(a // 8, b // 8) for a, b in v] if args.quick else v for k, v in STEP_SETS.items()}
    rounds = 3 if args.quick else args.rounds
    clock_name = "thread CPU" if clock is thread_timed else "wall"
    print(
        header(
            "Orthogonalization engines against the Muon family",
            device,
            peers=("gram-newton-schulz",),
        )
    )
    print(f"median of {rounds} interleaved rounds, {clock_name} clock\n")

    gemm = _gemm_ratio(128 if args.quick else 1024, device, clock)
    print(
        f"a bfloat16 product takes {gemm['bf16_over_f32']:.3g}× the time of a float32 one "
        f"here ({fmt_time(gemm['bfloat16']).strip()} against "
        f"{fmt_time(gemm['float32']).strip()}; issue 25 reported 80× on its CPU). "
        "torch.optim.Muon iterates in bfloat16: the comparison of equal work is its "
        "iteration in float32, the dtype this package iterates in (the bfloat16 rows "
        "are for reference).\n"
    )

    rows = engines(n, m, rounds, device, clock)
    base = rows[0]["seconds"]
    print(f"(a) engines, one {n}×{m} float32 matrix, five steps")
    body = [
        [
            r["label"],
            fmt_time(r["seconds"]),
            fmt_ratio(ratio(base, r["seconds"])),
            "—" if r["flops"] is None else f"{r['flops'] / 1e9:.3g}",
            f"{r['error_vs_svd']:.3g}",
            f"{r['max_diff_vs_torch_float32']:.2g}",
        ]
        for r in rows
    ]
    heads = ["engine", "time", "speed-up vs torch f32", "GFLOP", "‖Q − UVᴴ‖₂", "max|Q − torch f32|"]
    print(table(heads, body))

    by = {r["label"]: r["seconds"] for r in rows}
    pkg = by.get("gram-newton-schulz Gram PE-5 (float32)")
    targets = [
        target(
            "our Gram PE-5 speed / gram-newton-schulz float32",
            ratio(pkg, by["ours polar_express-5, gram"]),
            ">=",
            1.0,
        )
    ]
    steps = {}
    for name, shapes in sets.items():
        srows = step(shapes, rounds, device, clock)
        sbase = srows[0]["seconds"]
        total = sum(a * b for a, b in shapes)
        print(
            f"\n(b) one step, {name}: {len(shapes)} plain matrices, {total / 1e6:.3g} M parameters"
        )
        body = [[r["label"], fmt_time(r["seconds"]), f"{r['seconds'] / sbase:.3f}"] for r in srows]
        print(table(["optimizer", "step", "× torch.optim.Muon (float32)"], body))
        ours = {r["label"]: r["seconds"] for r in srows}[
            "manifold_muon newton_schulz-5 (engine auto)"
        ]
        targets.append(
            target(f"manifold_muon step / torch f32 step, {name}", ours / sbase, "<=", 1.0)
        )
        steps[name] = {"parameters": total, "rows": srows}
    print("\n" + targets_table(targets))
    result = {
        "shape": [n, m],
        "rounds": rounds,
        "clock": clock_name,
        "device": str(device),
        "gemm": gemm,
        "engines": rows,
        "step": steps,
        "targets": targets,
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
