r"""The plugin base class :class:`RiemannianOptimizer`.

A Riemannian optimizer is a per-parameter update rule written against a
:class:`~stiefel.optimizers.geometry.Geometry`; the base class does the rest:
param groups, hyper-parameter checks, state_dict, closures, skipping
non-finite gradients, ``repair_every`` and the orthogonality telemetry.

Example (the rule of plain Riemannian SGD)::

    >>> import torch, geoopt
    >>> from stiefel.manifolds import Stiefel
    >>> from stiefel.optimizers import RiemannianOptimizer
    >>> class Plain(RiemannianOptimizer):
    ...     def __init__(self, params, lr):
    ...         super().__init__(params, dict(lr=lr, retraction="qr", repair_every=None))
    ...     def update(self, geo, x, grad, state, group):
    ...         return geo.descend(x, geo.rgrad(x, grad), group["lr"])
    >>> w = geoopt.ManifoldParameter(Stiefel(10, 2).random(dtype=torch.float64),
    ...                              manifold=Stiefel(10, 2))
    >>> opt = Plain([w], lr=0.1)
    >>> (w[0, 0] ** 2).backward(); opt.step()
    >>> bool(Stiefel(10, 2).check_point_on_manifold(w))
    True
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import geoopt
import torch

from ..manifolds import METRICS, RETRACTIONS
from ..manifolds import Stiefel as _OurStiefel
from ..manifolds._checks import choice as check_choice  # one check for the package
from ..manifolds.kernels import orthogonality_error
from .geometry import Geometry, _Binder, manifold_of

__all__ = ["RiemannianOptimizer", "check_number", "check_choice"]


def check_number(
    name: str, value: Any, *, low: float = 0.0, high: float = math.inf, closed_high=False
) -> float:
    """A finite real number in [low, high) (or [low, high]); else ValueError/TypeError."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    ok = low <= value <= high if closed_high else low <= value < high
    if not (math.isfinite(value) and ok):
        bracket = "]" if closed_high else ")"
        raise ValueError(f"{name}={value!r} is out of range; allowed: [{low}, {high}{bracket}")
    return float(value)


def _check_repair(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"repair_every={value!r} is not allowed; allowed: None or an int >= 1")


def _distance(man, x: torch.Tensor) -> str:
    """How far ``x`` is from ``man``, for an error message."""
    if isinstance(man, geoopt.Stiefel):
        return f"‖XᴴX − I‖_F = {float(orthogonality_error(x).max()):.3e}"
    try:
        dist = float(torch.linalg.vector_norm(x - man.projx(x)))
    except Exception:  # noqa: BLE001 - a manifold without projx: the reason must do
        return "distance unknown (the manifold has no projx)"
    return f"‖x − projx(x)‖ = {dist:.3e}"


class RiemannianOptimizer(torch.optim.Optimizer):
    r"""Base of every built-in optimizer and the interface a plugin may implement.

    A subclass implements

    - :meth:`update` ``(geo, x, grad, state, group) -> new x``: the rule for one
      parameter ``x`` (a detached view) with gradient ``grad``, its ``state``
      dict (``state["step"]``, a float tensor, already counts this step) and its
      ``group``; ``geo`` supplies the manifold operations (Riemannian gradient,
      retraction ``retr(x, -lr * d)`` by the group's ``retraction`` option,
      transport, component inner product, ...) and is Euclidean for plain tensors;
    - optionally :meth:`check_group` to validate hyper-parameters (call super).

    Class attribute ``accepts_off_manifold`` (default False) decides whether a
    manifold parameter off its manifold is refused at construction.

    Constructor options (keyword-only, not hyper-parameters): ``telemetry=True``
    records after each step the orthogonality error ‖XᴴX − I‖_F of every
    Stiefel-like parameter, as one tensor per step in :attr:`orthogonality_history`
    (order of :meth:`manifold_parameters`; no device synchronisation).

    A non-finite gradient skips that parameter's step (its point and state stay
    unchanged) and warns once per optimizer. ``repair_every=k`` replaces the point
    by its nearest manifold point (polar factor) after every k-th step.
    """

    accepts_off_manifold: ClassVar[bool] = False

    def __init__(self, params, defaults: dict, *, telemetry: bool = False):
        if not isinstance(telemetry, bool):
            raise TypeError(f"telemetry must be a bool, got {telemetry!r}")
        self._binders: list[list[_Binder]] = []
        self.check_group(dict(defaults), defaults=True)
        self.telemetry = telemetry
        self.orthogonality_history: list[torch.Tensor] = []
        self._warned_nonfinite = False
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ plugin interface
    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        """Return the new value of parameter ``x`` (see the class docstring)."""
        raise NotImplementedError

    def check_group(self, group: dict, defaults: bool = False) -> None:
        """Validate a param group's hyper-parameters (ValueError/TypeError naming them)."""
        if "lr" in group:
            check_number("lr", group["lr"])
        if "metric" in group and group["metric"] is not None:
            check_choice("metric", group["metric"], METRICS)
        if "retraction" in group:
            check_choice("retraction", group["retraction"], RETRACTIONS)
        _check_repair(group.get("repair_every"))

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        merged = {**self.defaults, **group}
        self.check_group(merged)
        binders = []
        for i, p in enumerate(params):
            man = manifold_of(p)
            if man is not None and not self.accepts_off_manifold:
                self._check_on_manifold(i, p, man)
            binders.append(_Binder(man))
        group["params"] = params
        super().add_param_group(group)
        self._binders.append(binders)

    def _check_on_manifold(self, i: int, p: torch.Tensor, man) -> None:
        x = p.detach()
        ok, reason = man.check_point_on_manifold(x, explain=True)
        if not ok and not isinstance(man, _OurStiefel):  # ours give ‖XᴴX − I‖_F already
            reason = f"{reason}; {_distance(man, x)}"
        if not ok:
            raise ValueError(
                f"parameter {i} of the new param group is not on its manifold {man!r}: {reason}. "
                f"{type(self).__name__} needs points on the manifold (project with "
                f"manifold.projx, or use 'landing', which accepts points off it)"
            )

    def manifold_parameters(self) -> list[torch.Tensor]:
        """Parameters whose geometry is Stiefel-like, in param-group order."""
        return [
            p
            for group, binders in zip(self.param_groups, self._binders, strict=True)
            for p, b in zip(group["params"], binders, strict=True)
            if b.bind(group).stiefel
        ]

    # ------------------------------------------------------------------ stepping
    @staticmethod
    @torch.compiler.disable
    def _nonfinite(grad: torch.Tensor, off: torch.Tensor | None = None) -> tuple[bool, bool]:
        """(grad has a non-finite entry, ``off`` is True), with one host synchronisation.

        Note [One reduction for the finiteness test]: the sum of finite entries is
        finite unless it overflows, so one reduction decides the common case. The
        answer steers Python control flow: it runs eagerly (a graph break under
        torch.compile) and costs one host synchronisation per parameter, shared
        with the off-manifold test (Note [Off-manifold points at a step]).
        """
        flags = torch.isfinite(grad.sum()).logical_not().reshape(1)
        if off is not None:
            flags = torch.cat((flags, off.reshape(1).to(flags.device)))
        bad, *rest = flags.tolist()
        if bad:
            bad = not bool(torch.isfinite(grad).all())
        return bool(bad), bool(rest and rest[0])

    @staticmethod
    @torch.compiler.disable
    def _finite(new: torch.Tensor) -> bool:
        return bool(torch.isfinite(new).all())

    def _warn_once(self, key: str, message: str) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            warnings.warn(f"{message} (warned once per optimizer)", RuntimeWarning, stacklevel=4)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step for every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        errors = []
        with torch.no_grad():
            for group, binders in zip(self.param_groups, self._binders, strict=True):
                k = group.get("repair_every")
                for i, (p, binder) in enumerate(zip(group["params"], binders, strict=True)):
                    geo = binder.bind(group)
                    if p.grad is not None:
                        self._step_one(i, p, geo, group, k)
                    if self.telemetry and geo.stiefel:
                        errors.append(geo.error(p).detach().reshape(-1).max())
        if self.telemetry and errors:
            dev = errors[0].device
            self.orthogonality_history.append(torch.stack([e.float().to(dev) for e in errors]))
        return loss

    def _step_one(self, i: int, p: torch.Tensor, geo: Geometry, group: dict, k) -> None:
        """Step one parameter; never writes a non-finite value (Note [Safe step])."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        where = f"a parameter (index {i} of its group, shape {tuple(p.shape)})"
        x = p.detach()
        off = None if self.accepts_off_manifold else geo.off_manifold(x)
        bad_grad, is_off = self._nonfinite(grad, off)
        if bad_grad:
            self._warned_nonfinite = True
            self._warn_once(
                "grad",
                f"{type(self).__name__}: {where} has a non-finite gradient; its step is skipped",
            )
            return
        if is_off:
            # Note [Off-manifold points at a step] in stiefel.manifolds.geometry
            err = float(geo.error(x).max())
            self._warn_once(
                "off",
                f"{type(self).__name__}: {where} is off its manifold (‖XᴴX − I‖_F = {err:.3e}, "
                "e.g. after load_state_dict or an in-place edit); it is projected back "
                "(polar factor) before the step",
            )
            p.copy_(geo.project(x))
            x = p.detach()
            geo.off_manifold(x)  # the step reuses the Gram of the projected point
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        # Note [Safe step]: the kernels are overflow-safe (Note [Overflow-safe step]),
        # but a rule's own arithmetic (e.g. a momentum that overflowed) or a singular
        # limit can still produce inf/NaN (or make LAPACK refuse its input): the old
        # point is kept, never overwritten.
        try:
            new = self.update(geo, x, grad, state, group)
            if k is not None and int(state["step"]) % k == 0:
                new = geo.project(new)
        except torch.linalg.LinAlgError:
            new = None
        if new is None or not self._finite(new):
            self._warn_once(
                "step",
                f"{type(self).__name__}: the step of {where} is not finite (huge gradient or "
                "learning rate); the parameter keeps its value",
            )
            return
        p.copy_(new)
