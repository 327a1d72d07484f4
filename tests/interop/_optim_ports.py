"""Problems shared by the optimizer ports (geoopt's test_rsgd.py / test_adam.py)."""

from __future__ import annotations

import geoopt
import torch
from _interop_cases import dtype_of, manifold, random_point, same_component


def procrustes_start(case: str, seed: int = 0):
    """(X0 as a ManifoldParameter, X*): geoopt's problem min ‖X − X*‖² with X* on the
    manifold (in X0's component on O(n), which a descent path cannot leave)."""
    man = manifold(case)
    target = random_point(case, seed + 1)
    x0 = same_component(random_point(case, seed), target)
    return geoopt.ManifoldParameter(x0, manifold=man), target


def penalised_loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """geoopt's loss: ‖X − X*‖² + 100‖XᴴX − I‖² (the penalty punishes leaving the manifold)."""
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    return (x - target).abs().pow(2).sum() + 100 * (x.mH @ x - eye).abs().pow(2).sum()


def run_to_target(opt, x, target, steps: int, tol: float = 1e-5) -> int:
    """Step until ‖X − X*‖ < tol (at most ``steps``); returns the steps taken."""

    def closure():
        opt.zero_grad()
        loss = penalised_loss(x, target)
        loss.backward()
        return loss.item()

    for i in range(steps):
        if float((x.detach() - target).norm()) < tol:
            return i
        opt.step(closure)
    return steps


def euclidean_grad(case: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, dtype=dtype_of(case), generator=g)


def momentum_reference(man, x, grads, lr, mu, dampening=0.0, nesterov=False):
    """Riemannian heavy ball written with the manifold's public operations, torch's SGD
    conventions (first buffer = ξ, later B ← μτ(B) + (1 − dampening)ξ, Nesterov direction
    ξ + μB) and geoopt's transport of B by ``retr_transp`` along the step."""
    buf = None
    for g in grads:
        xi = man.egrad2rgrad(x, g)
        buf = xi.clone() if buf is None else mu * buf + (1 - dampening) * xi
        d = xi + mu * buf if nesterov else buf
        x, buf = man.retr_transp(x, -lr * d, buf)
    return x
