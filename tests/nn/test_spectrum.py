"""singular_values and lipschitz_bound against the dense Jacobian's SVD (float64)."""

import math

import pytest
import torch
from torch import nn

from stiefel.nn import (
    OrthoConv2d,
    OrthoConvTranspose2d,
    OrthogonalConv2d,
    lipschitz_bound,
    singular_values,
)

DT = torch.float64


def jacobian_singular_values(layer, shape):
    """The reference: torch.func.jacrev of the layer at 0 (its linear part), float64 SVD."""
    x = torch.zeros(1, *shape, dtype=DT)
    jac = torch.func.jacrev(layer)(x)  # (1, out…, 1, in…)
    return torch.linalg.svdvals(jac.detach().reshape(-1, math.prod(shape)))


def _layers():
    torch.manual_seed(0)
    circ = dict(padding=1, padding_mode="circular", dtype=DT)
    return {
        "Conv2d circular": (nn.Conv2d(3, 5, 3, **circ), (3, 6, 6), "fft"),
        "Conv2d circular stride 2": (nn.Conv2d(4, 3, 3, stride=2, **circ), (4, 6, 6), "fft"),
        "Conv2d zeros": (nn.Conv2d(3, 4, 3, padding=1, dtype=DT), (3, 5, 5), "dense"),
        "OrthoConv2d": (OrthoConv2d(4, 6, 3, dtype=DT), (4, 6, 6), "fft"),
        "OrthoConv2d stride 2": (OrthoConv2d(4, 6, 3, stride=2, dtype=DT), (4, 8, 8), "fft"),
        "OrthoConv2d zeros": (
            OrthoConv2d(4, 4, 3, padding_mode="zeros", dtype=DT),
            (4, 5, 5),
            "dense",
        ),
        "OrthoConvTranspose2d stride 2": (
            OrthoConvTranspose2d(8, 4, 3, stride=2, dtype=DT),
            (8, 4, 4),
            "fft",
        ),
        "OrthogonalConv2d": (OrthogonalConv2d(4, 3, dtype=DT), (4, 6, 6), "fft"),
        "Conv1d circular": (
            nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular", dtype=DT),
            (2, 7),
            "fft",
        ),
        "Linear": (nn.Linear(5, 3, dtype=DT), (5,), "dense"),
    }


LAYERS = _layers()


@pytest.mark.parametrize("name", list(LAYERS))
def test_singular_values_are_the_dense_jacobians(name):
    layer, shape, path = LAYERS[name]
    ref = jacobian_singular_values(layer, shape)
    sv = singular_values(layer, shape)
    assert sv.shape == ref.shape
    tol = 100 * math.prod(shape) * torch.finfo(DT).eps
    assert (sv - ref).abs().max() <= tol * float(ref[0])
    if path == "fft":  # the FFT path served it (the dense one gives the same values)
        assert torch.allclose(singular_values(layer, shape, method="fft"), ref, atol=tol)
    else:
        with pytest.raises(ValueError, match="does not commute with circular shifts"):
            singular_values(layer, shape, method="fft")
    assert (singular_values(layer, shape, method="dense") - ref).abs().max() <= tol


def test_orthogonal_layers_have_unit_singular_values():
    for name in ("OrthoConv2d", "OrthoConv2d stride 2", "OrthoConvTranspose2d stride 2"):
        layer, shape, _ = LAYERS[name]
        sv = singular_values(layer, shape)
        assert (sv - 1).abs().max() <= 100 * torch.finfo(DT).eps, name


@pytest.mark.parametrize("name", ["Conv2d circular", "Conv2d zeros", "OrthoConv2d zeros"])
def test_power_iteration_reaches_the_largest_singular_value_from_below(name):
    layer, shape, _ = LAYERS[name]
    top = float(jacobian_singular_values(layer, shape)[0])
    g = torch.Generator().manual_seed(0)
    est = lipschitz_bound(layer, shape, iterations=500, rtol=0, generator=g)
    assert (1 - 1e-4) * top <= est <= top * (1 + 100 * torch.finfo(DT).eps)


def test_large_non_circular_layers_and_bad_arguments_are_refused():
    conv = nn.Conv2d(8, 8, 3, padding=1)
    with pytest.raises(ValueError, match="4096"):
        singular_values(conv, (8, 32, 32))
    with pytest.raises(ValueError, match="input_shape=8; allowed"):
        singular_values(conv, 8)
    with pytest.raises(ValueError, match="method='svd'; allowed: auto, fft, dense"):
        singular_values(conv, (8, 4, 4), method="svd")
    with pytest.raises(ValueError, match="iterations=0; allowed"):
        lipschitz_bound(conv, (8, 4, 4), iterations=0)
