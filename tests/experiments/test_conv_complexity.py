"""Complexity rows of the convolution layers: every layer measured, FLOP models as documented."""

import math

from experiments.conv_complexity import conv_costs, conv_table
from stiefel.comparisons.cost import map_flops


def test_conv_rows_and_flop_models():
    rows = conv_costs(1, plan=[(4, 3)])
    assert [r["layer"] for r in rows] == [
        "nn.Conv2d",
        "conv_kernel=True (tcwy)",
        "OrthogonalConv2d (cayley)",
    ]
    b, c, k, n = 8, 4, 3, 32
    direct = 2 * b * c * c * k * k * n * n
    assert rows[0]["flops"] == direct
    assert rows[1]["flops"] == direct + map_flops("tcwy", c * k * k, c, c)
    freqs = n * (n // 2 + 1)
    fft = 5 * b * c * n * n * math.log2(n * n)
    assert math.isclose(rows[2]["flops"], fft + freqs * (32 / 3 * c**3 + 8 * b * c * c))
    assert all(r["forward_backward_s"] > 0 for r in rows)
    text = "\n".join(conv_table(rows, 1e10))
    assert text.count("| 4 | 3 |") == 3


def test_layer_times_are_medians_of_interleaved_blocks_flagged_where_they_spread(monkeypatch):
    # the report says "median of blocks on the trusted clock, † where flagged"; the layers
    # were timed by their fastest single run, with no flag
    import experiments.conv_complexity as cc
    import experiments.recurrent_step as rs

    seen = []

    def fake(fns, repeats, device="cpu", **_):
        seen.append(list(fns))
        return {k: dict(s=0.5 + i, flag="spread" if i == 1 else None) for i, k in enumerate(fns)}

    monkeypatch.setattr(cc, "measure_many", fake)
    rows = cc.conv_costs(3, plan=[(4, 3)])
    assert seen == [[r["layer"] for r in rows]]  # one interleaved measurement per (c, k)
    assert [r["forward_backward_s"] for r in rows] == [0.5, 1.5, 2.5]
    text = "\n".join(cc.conv_table(rows, 1e10))
    assert "| 1.5 † |" in text and "conv_kernel=True (tcwy) c=4 k=3" in text
    monkeypatch.setattr(rs, "measure_many", fake)
    (row, *_) = rs.recurrent_step_costs([8], 1 / 8, 3)
    assert (row["forward_s"], row["backward_s"]) == (0.5, 1.0)  # fwd+bwd less fwd
    assert "† flagged" in "\n".join(rs.recurrent_table([row], 1e10))
