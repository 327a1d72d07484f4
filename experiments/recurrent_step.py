"""One recurrent step h ↦ Qh, batch 1, in the Householder paper's Table 2 layout.

The oRNN's operator form of every map that has one (`W.linear`, O(n·L) for
the reflection maps) against a dense sRNN step, forward and backward, beside
the paper's FLOP counts: oRNN(n, m) FP (4n − m + 2)m, BP (7n − 2m + 3)m;
sRNN(n) FP 2n² − n, BP 3n² − n. A part of the harness's complexity section:

```text
python -m stiefel.comparisons complexity --import experiments.recurrent_step
```
"""

from __future__ import annotations

import torch

from stiefel.comparisons.complexity import register_part
from stiefel.comparisons.cost import measure_many
from stiefel.comparisons.sections import flag_note, time_cell
from stiefel.comparisons.writers import md_table
from stiefel.manifolds import kernels
from stiefel.parametrizations import maps, orthogonalize

__all__ = ["recurrent_step_costs", "recurrent_table"]


def recurrent_step_costs(sizes: list[int], fraction: float, repeats: int) -> list[dict]:
    """One recurrent step h ↦ Qh (batch 1) forward and backward: oRNN operator form vs dense.

    The Householder paper's Table 2: oRNN(n, m) FP (4n − m + 2)m, BP (7n − 2m + 3)m;
    sRNN(n) FP 2n² − n, BP 3n² − n.
    """
    rows = []
    gen = torch.Generator().manual_seed(1)
    operators = [name for name, cls in maps().items() if cls.has_operator()]
    for n in sizes:
        L = max(1, int(round(fraction * n)))
        for method in operators:
            opts = {"reflections": L} if maps()[method].takes_reflections() else {}
            w = orthogonalize(kernels.haar(n, n, generator=gen), method=method, **opts)
            h = torch.randn(1, n, generator=gen, requires_grad=True)
            label = f"{method} operator (n, L={L})" if opts else f"{method} operator (n)"
            rows.append(_step_row(label, n, L if opts else n, w.linear, h, repeats))
        dense = torch.randn(n, n, generator=gen, requires_grad=True)
        h = torch.randn(1, n, generator=gen, requires_grad=True)
        rows.append(_step_row("sRNN dense", n, n, lambda x, d=dense: x @ d.T, h, repeats))
    return rows


def _step_row(label, n, L, fn, h, repeats) -> dict:
    def fwd():
        with torch.no_grad():
            fn(h)

    def fwd_bwd():
        fn(h).sum().backward()

    if label.startswith("sRNN"):
        fp, bp = 2 * n * n - n, 3 * n * n - n
    else:
        fp, bp = (4 * n - L + 2) * L, (7 * n - 2 * L + 3) * L
    # forward and forward+backward in interleaved rounds (Note [Timed blocks])
    t = measure_many({"f": fwd, "fb": fwd_bwd}, repeats)
    return {
        "model": label,
        "n": n,
        "L": L,
        "fp_flops": fp,
        "bp_flops": bp,
        "forward_s": t["f"]["s"],
        "forward_flag": t["f"]["flag"],
        "backward_s": max(t["fb"]["s"] - t["f"]["s"], 0.0),
        "backward_flag": t["fb"]["flag"],
    }


def recurrent_table(rows: list[dict], rate: float) -> list[str]:
    """The markdown part of `recurrent_step_costs`' rows."""
    return [
        "\n### One recurrent step, batch 1 (Householder paper Table 2 layout: L = n/8 "
        "reflections; --fractions sets the maps' L only)\n",
        "Times as in the table above (the backward is forward+backward less the forward, "
        "both in interleaved rounds).\n",
        md_table(
            ["model", "n", "FP flops", "BP flops", "FP [s]", "BP [s]"],
            [
                [r["model"], r["n"], r["fp_flops"], r["bp_flops"]]
                + [time_cell(r, "forward"), time_cell(r, "backward")]
                for r in rows
            ],
        ),
        *flag_note(
            [
                f"{r['model']} n={r['n']}"
                for r in rows
                if r.get("forward_flag") or r.get("backward_flag")
            ],  # fmt: skip
            then="shown as measured",
        ),
    ]


def _measure(opts: dict) -> list[dict]:
    return recurrent_step_costs(opts["sizes"], 1 / 8, opts["repeats"])


register_part("recurrent_steps", _measure, recurrent_table)
