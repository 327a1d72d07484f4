"""Orthogonal fine-tuning: ``stiefel.rotate`` and ``accelerate`` against PEFT, one run.

A stack of frozen ``Linear(n, n)`` layers, T tokens, forward + backward
(the input requires grad, as in a model with adapters below), in float32
(``--dtype bfloat16`` for bf16 bases). Printed: median times, their ratios,
and the bytes autograd saves for backward (frozen weights excluded):

0. the registered PEFT method (``StiefelConfig``) against PEFT's HRA r = 8,
   OFT (blocks of 32) and BOFT (blocks of 32, 1 factor: PEFT's CPU path) on 4 Linear(2048,
   2048), timed interleaved (one step of each per round), ratios per round;
1. ``rotate(method="cwy", reflections=8)`` vs the frozen stack alone vs PEFT HRA r = 8;
2. OFT, b = 32 blocks: ``rotate(method="cayley", blocks=32)`` (exact Cayley) vs
   PEFT OFT (Cayley–Neumann), and ‖RᵀR − I‖_F of both maps as ‖A‖₂ grows;
3. BOFT, b = 4 blocks, 1 and 2 butterfly factors: ``rotate(method="cayley",
   blocks=4, butterfly=k)`` vs PEFT BOFT (which on CPU, without its CUDA
   extension, silently uses 1 factor);
4. ``accelerate(model)`` on a tiny Llama-style model with HRA/OFT/BOFT
   adapters: training-step time before/after and the losses.

Every section times its calls in interleaved rounds (``--repeats`` of them, the
median), on the thread CPU clock with one torch thread (the default) and on the
wall clock with more. Run from a checkout: ``python -m benchmarks.finetune
[--quick] [--sizes 1024 2048]``. Compare ratios within one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings
from collections.abc import Callable

import torch
from torch import nn

import stiefel
from stiefel.comparisons.cost import timed
from stiefel.integrations.peft import accelerate, cayley_neumann
from stiefel.integrations.peft.acceleration import _cayley, _skew

from ._timing import interleaved, rounds, thread_timed, versions


def saved_bytes(model: nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    del out
    return sum(seen.values())


def stack(n: int, layers: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(n, n) for _ in range(layers)]).to(dtype)
    return net.requires_grad_(False)


def peft_wrap(net: nn.Module, config) -> nn.Module:
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(net, config)


def fwd_bwd(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step():
        xx = x.detach().requires_grad_(True)
        model(xx).float().pow(2).mean().backward()

    return step


def mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB"


def _clock(fn: Callable[[], object]) -> float:
    # the thread's CPU time on one torch thread (Note [Thread CPU time on a shared
    # machine], benchmarks._timing), else the wall time
    return (thread_timed if torch.get_num_threads() == 1 else timed)(fn)


def medians(calls: list[Callable[[], object]], count: int) -> list[float]:
    """Median seconds of each call over ``count`` interleaved rounds (`_timing.rounds`)."""
    return list(interleaved(dict(enumerate(calls)), count, _clock).values())


def ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """Median over rounds of the per-round ratio slow/fast."""
    return statistics.median(a / b for a, b in zip(times[slow], times[fast], strict=True))


def section_method(n, tokens, layers, dtype, count):
    """The registered PEFT method "stiefel" against PEFT's HRA, OFT and BOFT, interleaved."""
    from peft import BOFTConfig, HRAConfig, OFTConfig

    from stiefel.integrations.peft import StiefelConfig

    block = 32
    names = [str(i) for i in range(layers)]
    print(
        f"\n## 0. The PEFT method 'stiefel' vs PEFT's own: {layers} frozen Linear({n}, {n}), "
        f"T = {tokens}, fwd+bwd, {count} interleaved rounds"
    )
    models = {
        "stiefel cwy L=8": StiefelConfig(method="cwy", reflections=8, target_modules=names),
        "PEFT HRA r=8": HRAConfig(r=8, target_modules=names),
        f"stiefel cayley blocks of {block}": StiefelConfig(
            method="cayley", blocks=n // block, target_modules=names
        ),
        f"PEFT OFT blocks of {block}": OFTConfig(r=0, oft_block_size=block, target_modules=names),
        # PEFT's BOFT builds one factor on a CPU whatever it is asked (no CUDA extension):
        # the same factors on both sides is one factor here
        f"stiefel cayley {block}, butterfly 1": StiefelConfig(
            method="cayley", blocks=n // block, butterfly=1, target_modules=names
        ),
        f"PEFT BOFT {block}, 1 factor": BOFTConfig(
            boft_block_size=block, boft_n_butterfly_factor=1, target_modules=names
        ),
    }
    x = torch.randn(tokens, n, dtype=dtype)
    wrapped = {name: peft_wrap(stack(n, layers, dtype), config) for name, config in models.items()}
    times = rounds({name: fwd_bwd(m, x) for name, m in wrapped.items()}, count, _clock)
    print("| adapter | median fwd+bwd | saved for backward |")
    print("|---|---|---|")
    saved = {}
    for name, m in wrapped.items():
        saved[name] = saved_bytes(m, lambda m=m: m(x.detach().requires_grad_(True)))
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.0f} ms | {mib(saved[name])} |")
    keys = list(models)
    measured = [
        ("PEFT HRA / stiefel cwy time, per-round median", ratio(times, keys[1], keys[0]), ">=", 8),
        (
            "stiefel exact OFT / PEFT OFT time, per-round median",
            ratio(times, keys[2], keys[3]),
            "<=",
            1,
        ),
        (
            "PEFT BOFT / stiefel butterfly time, per-round median",
            ratio(times, keys[5], keys[4]),
            ">=",
            5,
        ),
        ("stiefel cwy / PEFT HRA saved bytes", saved[keys[0]] / saved[keys[1]], "<=", 0.1),
    ]
    print("\n| comparison | measured | goal | |")
    print("|---|---|---|---|")
    for label, value, op, goal in measured:
        met = value >= goal if op == ">=" else value <= goal
        sign = "≥" if op == ">=" else "≤"
        print(f"| {label} | {value:.3g} | {sign} {goal:g} | {'met' if met else 'NOT met'} |")


def section_hra(sizes, tokens, layers, dtype, repeats):
    from peft import HRAConfig

    print("\n## 1. HRA r = 8: rotate(cwy, reflections=8) vs frozen stack vs PEFT HRA")
    print(
        "| n | frozen | rotate cwy | PEFT HRA | cwy/frozen | PEFT/cwy | saved cwy | saved PEFT "
        "| PEFT/cwy bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    names = [str(i) for i in range(layers)]
    for n in sizes:
        x = torch.randn(tokens, n, dtype=dtype)
        frozen = stack(n, layers, dtype)
        ours = stack(n, layers, dtype)
        for layer in ours:
            stiefel.rotate(layer, "cwy", reflections=8)
        with torch.no_grad():
            for p in ours.parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn_like(p))
        hra = peft_wrap(stack(n, layers, dtype), HRAConfig(r=8, target_modules=names))
        t = medians([fwd_bwd(m, x) for m in (frozen, ours, hra)], repeats)
        b = [
            saved_bytes(m, lambda m=m, x=x: m(x.detach().requires_grad_(True))) for m in (ours, hra)
        ]
        print(
            f"| {n} | {t[0] * 1e3:.1f} ms | {t[1] * 1e3:.1f} ms | {t[2] * 1e3:.1f} ms | "
            f"{t[1] / t[0]:.2f}× | {t[2] / t[1]:.2f}× | {mib(b[0])} | {mib(b[1])} | "
            f"{b[1] / max(b[0], 1):.2f}× |"
        )


def section_oft(sizes, tokens, layers, dtype, repeats):
    from peft import OFTConfig

    print("\n## 2. OFT, b = 32 blocks: rotate(cayley, blocks=32) (exact) vs PEFT OFT (Neumann)")
    print("| n | rotate exact Cayley | PEFT OFT | ours/PEFT |")
    print("|---|---|---|---|")
    names = [str(i) for i in range(layers)]
    for n in sizes:
        x = torch.randn(tokens, n, dtype=dtype)
        ours = stack(n, layers, dtype)
        for layer in ours:
            stiefel.rotate(layer, "cayley", blocks=32)
        oft = peft_wrap(
            stack(n, layers, dtype), OFTConfig(r=32, oft_block_size=0, target_modules=names)
        )
        t = medians([fwd_bwd(m, x) for m in (ours, oft)], repeats)
        print(f"| {n} | {t[0] * 1e3:.1f} ms | {t[1] * 1e3:.1f} ms | {t[0] / t[1]:.2f}× |")
    s = 32
    print(f"\n‖RᵀR − I‖_F of one {s}×{s} block, float32, A skew with growing ‖A‖₂:")
    print("| ‖A‖₂ | PEFT Cayley–Neumann (5 terms) | exact Cayley |")
    print("|---|---|---|")
    g = torch.Generator().manual_seed(0)
    vec = torch.randn(1, s * (s - 1) // 2, generator=g)
    for target in (0.1, 0.3, 0.5, 1.0, 1.5, 3.0):
        a = _skew(vec, s)
        a = a * (target / torch.linalg.matrix_norm(a, ord=2))
        eye = torch.eye(s)
        errs = [
            torch.linalg.matrix_norm(r.mT @ r - eye).item()
            for r in (cayley_neumann(a, 5), _cayley(a))
        ]
        print(f"| {target:.2f} | {errs[0]:.2e} | {errs[1]:.2e} |")


def section_boft(sizes, tokens, layers, dtype, repeats):
    from peft import BOFTConfig

    print("\n## 3. BOFT, b = 4 blocks: rotate(cayley, blocks=4, butterfly=k) vs PEFT BOFT")
    print("| n | factors | rotate | PEFT BOFT | PEFT/ours |")
    print("|---|---|---|---|---|")
    names = [str(i) for i in range(layers)]
    for n in sizes:
        x = torch.randn(tokens, n, dtype=dtype)
        for k in (1, 2):
            ours = stack(n, layers, dtype)
            for layer in ours:
                stiefel.rotate(layer, "cayley", blocks=4, butterfly=k)
            boft = peft_wrap(
                stack(n, layers, dtype),
                BOFTConfig(
                    boft_block_size=0,
                    boft_block_num=4,
                    boft_n_butterfly_factor=k,
                    target_modules=names,
                ),
            )
            t = medians([fwd_bwd(m, x) for m in (ours, boft)], repeats)
            print(f"| {n} | {k} | {t[0] * 1e3:.1f} ms | {t[1] * 1e3:.1f} ms | {t[1] / t[0]:.1f}× |")


def section_accelerate(tokens, repeats, hidden):
    import transformers
    from peft import BOFTConfig, HRAConfig, OFTConfig

    print(f"\n## 4. accelerate(model): tiny Llama (hidden {hidden}, 2 layers), one training step")
    print("| adapter | PEFT step | accelerated step | speed-up | loss PEFT | loss accelerated |")
    print("|---|---|---|---|---|---|")
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=tokens,
    )
    targets = ["q_proj", "v_proj"]
    configs = {
        "HRA r=8": HRAConfig(r=8, target_modules=targets, init_weights=False),
        "OFT b=32": OFTConfig(r=32, oft_block_size=0, target_modules=targets, init_weights=False),
        "BOFT b=4": BOFTConfig(
            boft_block_size=0, boft_block_num=4, target_modules=targets, init_weights=False
        ),
    }
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    for name, config in configs.items():
        torch.manual_seed(0)
        model = peft_wrap(transformers.LlamaForCausalLM(cfg), config)
        fast = accelerate(copy.deepcopy(model))

        def step(m):
            def run():
                m.zero_grad()
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                return loss.item()

            return run

        losses = [step(m)() for m in (model, fast)]
        t = medians([step(m) for m in (model, fast)], repeats)
        print(
            f"| {name} | {t[0] * 1e3:.1f} ms | {t[1] * 1e3:.1f} ms | {t[0] / t[1]:.2f}× | "
            f"{losses[0]:.10f} | {losses[1]:.10f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sections", nargs="+", default=["method", "hra", "oft", "boft", "accelerate"]
    )
    parser.add_argument("--method-size", type=int, default=2048, help="n of section 0")
    parser.add_argument("--method-layers", type=int, default=4, help="layers of section 0")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less noise)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = args.sizes or ([128, 256] if args.quick else [1024, 2048, 4096])
    tokens = 64 if args.quick and args.tokens == 512 else args.tokens
    dtype = getattr(torch, args.dtype)
    print(
        f"# Orthogonal fine-tuning benchmark: {args.layers} frozen Linear(n, n), T = {tokens}, "
        f"fwd+bwd, {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"thread(s), {'thread CPU' if torch.get_num_threads() == 1 else 'wall'} clock, "
        f"interleaved rounds; {versions('peft', 'transformers')}"
    )
    print("(shared machine: timings are noisy; compare the ratios within this run)")
    if "method" in args.sections:
        n = 256 if args.quick else args.method_size
        section_method(n, tokens, args.method_layers, dtype, args.repeats)
    if "hra" in args.sections:
        section_hra(sizes, tokens, args.layers, dtype, args.repeats)
    if "oft" in args.sections:
        section_oft(sizes, tokens, args.layers, dtype, args.repeats)
    if "boft" in args.sections:
        section_boft(sizes, tokens, args.layers, dtype, args.repeats)
    if "accelerate" in args.sections:
        section_accelerate(tokens, args.repeats, 64 if args.quick else 256)


if __name__ == "__main__":
    main()
