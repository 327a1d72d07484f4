"""expm with the adjoint-Fréchet backward: gradcheck, equality with torch's autograd."""

from __future__ import annotations

import pytest
import torch

from stiefel.parametrizations._expm import expm


def _skew(shape, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, dtype=torch.float64, generator=gen)
    if dtype.is_complex:
        a = a + 1j * torch.randn(*shape, dtype=torch.float64, generator=gen)
    a = (scale * a).to(dtype)
    return 0.5 * (a - a.mH)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(5, 5), (2, 4, 4)])
def test_gradcheck(dtype, shape):
    a = _skew(shape, dtype, 1.0, 0).requires_grad_()
    assert torch.autograd.gradcheck(expm, (a,))
    b = 0.3 * _skew(shape, dtype, 1.0, 1) + 0.2 * torch.eye(shape[-1], dtype=dtype)
    assert torch.autograd.gradcheck(expm, (b.requires_grad_(),))  # not skew: general A


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("scale", [0.01, 1.0, 20.0, 200.0])  # 0 to 7 squarings
def test_equals_torch_matrix_exp_and_its_autograd(dtype, scale):
    a = _skew((3, 12, 12), dtype, scale, 2).requires_grad_()
    y, ref = expm(a), torch.linalg.matrix_exp(a)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g = g.to(dtype)
    (ga,) = torch.autograd.grad(y, a, g)
    (gb,) = torch.autograd.grad(ref, a, g)
    assert (y - ref).abs().max() < 1e-10 * max(1.0, scale)
    assert (ga - gb).abs().max() < 1e-10 * gb.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_forward_of_skew_is_orthogonal(dtype):
    n = 64
    q = expm(_skew((n, n), dtype, 3.0, 4))
    eye = torch.eye(n, dtype=dtype)
    err = torch.linalg.matrix_norm(q.mH @ q - eye)
    eps = torch.finfo(q.real.dtype).eps
    assert err < 10 * n * eps


def test_no_grad_path_and_errors():
    a = _skew((4, 4), torch.float64, 1.0, 5)
    assert torch.allclose(expm(a), torch.linalg.matrix_exp(a), atol=1e-14)
    with pytest.raises(ValueError, match="square"):
        expm(torch.zeros(3, 4))
