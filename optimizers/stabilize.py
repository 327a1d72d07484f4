r"""Re-projection of a param group's points onto their manifolds (geoopt's ``stabilize``).

`Stabilize` is the part of `RiemannianOptimizer` that projects points on request:
``stabilize()`` and ``stabilize_group(group)`` (geoopt's names, parameters without a
gradient included), and the projection a step makes every ``repair_every``-th step
(`RiemannianOptimizer._repair` decides when; a traced or capturable step projects
where a flag says so, reading nothing).

Example:
    ```python
    import geoopt, torch
    from stiefel import optimizers
    from stiefel.manifolds import Stiefel

    st = Stiefel(6, 2)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = optimizers.create("rgd", [w], lr=0.1)
    with torch.no_grad():
        w.add_(1e-3)  # an edit the optimizer did not make
    opt.stabilize()
    assert float(st.orthogonality_error(w.detach())) < 1e-12
    ```
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import engine, master

__all__ = ["Stabilize"]


class Stabilize:
    """Projection of param groups' manifold points (a mixin of `RiemannianOptimizer`)."""

    param_groups: list[dict]
    _bindings: list[list]
    state: dict

    @torch.no_grad()
    def stabilize_group(self, group: dict) -> None:
        """Project every manifold parameter of `group` onto its manifold (geoopt's name).

        Parameters without a gradient included, as geoopt's ``stabilize_group``.
        """
        self._project_group(group, lambda geo, x: geo.project(x))

    def _stabilize_where(self, group: dict, due: torch.Tensor) -> None:
        """`stabilize_group` where the bool tensor ``due`` says so (a traced step)."""
        self._project_group(group, lambda geo, x: engine.project_where(due, geo, x))

    def _project_group(self, group: dict, project: Callable) -> None:
        index = next(g for g, other in enumerate(self.param_groups) if other is group)
        bindings = self._bindings[index]
        for p, binding in zip(group["params"], bindings, strict=True):
            geo = binding.bind(group)
            if not geo.riemannian:
                continue
            state = self.state[p]
            x = binding.orient(master.point(p, state))
            master.store(p, state, binding.orient(project(geo, x)))

    def stabilize(self) -> None:
        """Project every manifold parameter onto its manifold now (geoopt's ``stabilize``)."""
        for group in self.param_groups:
            self.stabilize_group(group)
