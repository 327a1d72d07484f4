"""Tall steps correct every k-th step (Note [Tall steps correct every k-th step]).

The float64 Gram by chunks against the float64 product, the Gram a tall kernel
takes from its caller, and float32 drift of the tall QR and Cayley steps under
the optimizers' schedule against the same steps with a float32 Gram at every step.
"""

import pytest
import torch

from stiefel.manifolds import kernels
from stiefel.manifolds.kernels import frame, reduce


@pytest.mark.parametrize("shape", [(5, 4, 2), (5, 12, 3), (50, 4), (3, 20, 5)])
@pytest.mark.parametrize("cplx", [False, True])
def test_wide_gram_by_chunks_equals_the_float64_product(device, shape, cplx, monkeypatch):
    # chunks of 16 entries on the CPU: two whole matrices of the (5, 4, 2) batch at a
    # time, row blocks of the others; the whole X at once off the CPU
    monkeypatch.setattr(reduce, "WIDE_CHUNK", 16)
    gen = torch.Generator().manual_seed(0)
    low, wide = (torch.complex64, torch.complex128) if cplx else (torch.float32, torch.float64)
    x = torch.randn(shape, dtype=low, generator=gen)
    ref = x.to(wide).mH @ x.to(wide)
    got = reduce.wide_gram(x.to(device)).cpu()
    assert got.dtype == wide and got.shape == ref.shape
    n = shape[-2]
    assert float((got - ref).abs().max()) < 10 * n * torch.finfo(wide).eps * float(ref.abs().max())
    # under autograd: the whole product, differentiable
    xg = x.clone().requires_grad_()
    reduce.wide_gram(xg).real.sum().backward()
    assert torch.allclose(xg.grad, (x @ (torch.ones_like(ref.real) * 2).to(low)), atol=1e-4)


def test_tall_gram_takes_the_callers_gram():
    gen = torch.Generator().manual_seed(1)
    x = kernels.haar(30, 4, 2, dtype=torch.float64, generator=gen).to(torch.float32)
    assert torch.equal(frame.tall_gram(x, None), x.mT @ x)
    eye = frame.tall_gram(x, frame.UNCORRECTED)
    assert eye.shape == (2, 4, 4) and torch.equal(eye, torch.eye(4).expand(2, 4, 4))
    wide = frame.wide_gram(x)
    assert frame.tall_gram(x, wide).dtype == torch.float32
    assert torch.equal(frame.tall_gram(x, wide), wide.float())
    own = x.mT @ x
    assert frame.tall_gram(x, own) is own


def _drift(cplx, kind, schedule, n=64, m=16, batch=32, steps=400):
    """‖XᴴX − I‖_F (worst of the batch) after float32 steps towards points of St(n, m)."""
    gen = torch.Generator().manual_seed(5)
    high, low = (torch.complex128, torch.complex64) if cplx else (torch.float64, torch.float32)
    step = kernels.qr_gradient_step if kind == "qr" else kernels.cayley_gradient_step
    x = kernels.haar(n, m, batch, dtype=high, generator=gen).to(low)
    target = kernels.haar(n, m, batch, dtype=high, generator=gen).to(low)
    for k in range(steps):
        if schedule == "float32":
            xx = None  # the kernel's own Gram, in float32, at every step
        else:
            xx = frame.UNCORRECTED if k % frame.correction_period(m) else frame.wide_gram(x)
        x = step(x, 2 * (x - target), 1e-2, xx=xx)
    xw = x.to(high)
    return float(torch.linalg.matrix_norm(xw.mH @ xw - torch.eye(m, dtype=high)).max())


@pytest.mark.parametrize("cplx", [False, True])
@pytest.mark.parametrize("kind", ["qr", "cayley"])
def test_tall_float32_drift_with_the_scheduled_correction(cplx, kind):
    # measured (wide / float32-every-step): QR 0.59 (real), 0.72 (complex); Cayley 0.39,
    # 0.36; the scheduled drift 1.0 (QR) and 0.5 (Cayley) × √M·eps
    m, eps = 16, torch.finfo(torch.float32).eps
    scheduled, every = _drift(cplx, kind, "wide"), _drift(cplx, kind, "float32")
    assert scheduled < (0.9 if kind == "qr" else 0.6) * every, (scheduled, every)
    assert scheduled < (1.5 if kind == "qr" else 0.8) * m**0.5 * eps, scheduled
