"""Every optimizer reaches the analytic optimum of Procrustes and Brockett on St, St(ℂ), O(n)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from _optim_problems import PROBLEMS, SPACES, manifold_param, start_point

from stiefel import optimizers

# name, hyper-parameters, steps, lr decay (start, factor) or None,
# tolerance on the optimum, tolerance on ‖XᴴX − I‖_F (float64)
CONFIGS = [
    ("rgd", dict(lr=0.1, momentum=0.5), 300, None, 1e-9, 1e-13),
    ("rgd", dict(lr=0.1, metric="canonical", retraction="qr"), 400, None, 1e-9, 1e-13),
    ("rgd", dict(lr=0.1, momentum=0.8, retraction="polar"), 300, None, 1e-9, 1e-13),
    ("radam", dict(lr=0.05, betas=(0.9, 0.99)), 800, (500, 0.97), 1e-7, 1e-13),
    # landing approaches the manifold asymptotically (no retraction)
    ("landing", dict(lr=0.1), 400, None, 1e-6, 1e-8),
]


def _id(c):
    return c[0] + "-" + "-".join(f"{k}={v}" for k, v in c[1].items() if k != "lr")


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("space", SPACES, ids=[s[0] for s in SPACES])
@pytest.mark.parametrize("config", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_reaches_analytic_optimum(config, space, problem):
    name, hyper, steps, decay, tol, orth_tol = config
    _, n, m, cplx = space
    # zlib.crc32, not hash(): str hashes change with PYTHONHASHSEED on every run
    rng = np.random.default_rng(zlib.crc32(f"{problem}/{space[0]}".encode()))
    loss, error, target = PROBLEMS[problem](rng, n, m, cplx)
    w = manifold_param(start_point(rng, n, m, cplx, target))
    start_error = error(w.detach().numpy())
    opt = optimizers.create(name, [w], **hyper)
    sched = None
    if decay:
        t0, f = decay
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 if t < t0 else f ** (t - t0))
    for _ in range(steps):
        opt.zero_grad()
        loss(w).backward()
        opt.step()
        if sched:
            sched.step()
    x = w.detach()
    assert start_error > 0.1
    assert error(x.numpy()) < tol
    assert float(w.manifold.orthogonality_error(x)) < orth_tol
