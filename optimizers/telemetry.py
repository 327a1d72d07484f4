r"""Orthogonality telemetry for any optimizer (torch's and geoopt's included).

Example:
    ```python
    import torch, geoopt
    from stiefel.manifolds import Stiefel
    from stiefel.optimizers import orthogonality_errors

    st = Stiefel(20, 3)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = torch.optim.SGD([w, torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert orthogonality_errors(opt).shape == (1,)
    ```
"""

from __future__ import annotations

import torch

from ..manifolds.kernels import orthogonality_error
from .geometry import geometry_for

__all__ = ["orthogonality_errors", "record"]


def orthogonality_errors(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """‖XᴴX − I‖_F (max over a batch) of each Stiefel-like parameter of `optimizer`.

    For this package's optimizers, `telemetry=True` records the same values
    after every step without a call.

    Args:
        optimizer: any `torch.optim.Optimizer`.

    Returns:
        One float per Stiefel-like parameter, in param-group order (empty when
        there is none).
    """
    out = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if geometry_for(p, group).stiefel:
                    out.append(orthogonality_error(p.detach()).reshape(-1).max().float())
    if not out:
        return torch.zeros(0)
    return torch.stack([e.to(out[0].device) for e in out])


def record(opt) -> None:
    """Append ‖XᴴX − I‖_F of each Stiefel-like parameter to ``opt.orthogonality_history``.

    For this package's optimizers with ``telemetry=True``, after every step: one
    tensor per step, no device synchronisation.
    """
    errors = []
    for group, bindings in zip(opt.param_groups, opt._bindings, strict=True):
        for p, binding in zip(group["params"], bindings, strict=True):
            if binding.stiefel:
                x = p.detach().mT if binding.transposed else p.detach()
                errors.append(binding.bind(group).error(x).detach().reshape(-1).max())
    if errors:
        dev = errors[0].device
        opt.orthogonality_history.append(torch.stack([e.float().to(dev) for e in errors]))
