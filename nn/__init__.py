r"""Layers built on the maps: orthogonal/unitary recurrent cells, modReLU, ConvNERU,
the FFT orthogonal convolution, the explicit-kernel orthogonal convolutions
(BCOP/AOC from exact maps), the real embedding of U(n) in O(2n), and the
operator norms of layers (`singular_values`, `lipschitz_bound`).

Example:
    ```python
    import torch
    from stiefel.nn import OrthogonalConv2d

    y = OrthogonalConv2d(3, 3)(torch.randn(1, 3, 6, 6))
    assert y.shape == (1, 3, 6, 6)
    ```
"""

from .conv import OrthogonalConv2d
from .convneru import ConvNERUCell
from .embedding import complex_from_real, real_embedding
from .modrelu import ModReLU
from .orthoconv import OrthoConv2d, OrthoConvTranspose2d
from .recurrent import OrthogonalRNN, OrthogonalRNNCell, henaff_init
from .spectrum import lipschitz_bound, singular_values

__all__ = [
    "ModReLU",
    "OrthogonalRNNCell",
    "OrthogonalRNN",
    "henaff_init",
    "ConvNERUCell",
    "OrthogonalConv2d",
    "OrthoConv2d",
    "OrthoConvTranspose2d",
    "real_embedding",
    "complex_from_real",
    "singular_values",
    "lipschitz_bound",
]
