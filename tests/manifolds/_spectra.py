"""Test matrices with a prescribed spectrum, shared by the msign tests."""

import torch


def spectrum(n: int, m: int, kappa: float, dtype, batch=()) -> torch.Tensor:
    """U diag(σ) Vᴴ, n×m, with σ log-spaced over [1/κ, 1] (seeded by the shape)."""
    gen = torch.Generator().manual_seed(n * 100 + m)
    k = min(n, m)
    u = torch.linalg.qr(torch.randn(*batch, n, k, dtype=dtype, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(*batch, m, k, dtype=dtype, generator=gen))[0]
    s = torch.logspace(-torch.log10(torch.tensor(kappa)).item(), 0, k, dtype=torch.float64)
    return (u * s.to(dtype)) @ v.mH
