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
