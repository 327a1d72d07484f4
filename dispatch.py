r"""Which path each kernel operation takes, and a switch to the plain formulas.

Several operations have a faster path beside their plain formula (for a
device, a size, or under a tracer). Each chooses in one dispatcher;
`dispatchers()` lists them with their paths (the first is the reference) and
where each other path wins. `policy(reference=True)` makes every operation
take its reference path, e.g. to check a result or to rule a fast path out
while debugging.

Example:
    ```python
    import torch
    import stiefel
    from stiefel import dispatch

    a = torch.randn(5, 5, dtype=torch.float64)
    a, base = a - a.mT, torch.eye(5, dtype=torch.float64)
    q = stiefel.parametrizations.kernels.exp_map(a, base)
    with dispatch.policy(reference=True):
        q_ref = stiefel.parametrizations.kernels.exp_map(a, base)
    assert torch.allclose(q, q_ref)
    assert all(len(d.paths) >= 2 for d in dispatch.dispatchers().values())
    ```
"""

from __future__ import annotations

from ._core.dispatch import DISPATCHERS, Dispatcher, policy, reference_forced

__all__ = ["policy", "dispatchers", "reference_forced", "Dispatcher"]


def dispatchers() -> dict[str, Dispatcher]:
    """Every kernel dispatcher by operation name (importing the kernels first)."""
    from . import manifolds, parametrizations  # noqa: F401  (their dispatchers register)

    return dict(DISPATCHERS)
