r"""The plugin base class `RiemannianOptimizer`.

A Riemannian optimizer is a per-parameter update rule written against a
`Geometry`; the base class does the rest: param groups, hyper-parameter
checks, state_dict (with the parameter shapes, checked on load), closures,
skipping non-finite gradients, `repair_every` and the orthogonality telemetry.

Example:
    The rule of plain Riemannian SGD, as a plugin would write it:

    ```python
    import torch, geoopt
    from stiefel.manifolds import Stiefel
    from stiefel.optimizers import RiemannianOptimizer

    class Plain(RiemannianOptimizer):
        default_lr = 0.1

        def __init__(self, params, lr=0.1):
            super().__init__(params, dict(lr=lr, retraction="qr", repair_every=None))

        def update(self, geo, x, grad, state, group):
            return geo.descend(x, geo.rgrad(x, grad), group["lr"])

    st = Stiefel(10, 2)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = Plain([w])
    (w[0, 0] ** 2).backward()
    opt.step()
    assert st.check_point_on_manifold(w)
    ```
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import geoopt
import torch
from torch.distributed.tensor import DTensor

from ..manifolds import METRICS, RETRACTIONS
from ..manifolds import Stiefel as _OurStiefel
from ..manifolds._checks import choice as check_choice  # one check for the package
from ..manifolds.kernels import orthogonality_error
from ..manifolds.sharded import ShardedGeometry, any_rank
from .geometry import Geometry, _Binder, manifold_of

__all__ = ["RiemannianOptimizer", "check_number", "check_choice"]


def check_number(
    name: str, value: Any, *, low: float = 0.0, high: float = math.inf, closed_high=False
) -> float:
    """A finite real number in [low, high) (or [low, high]).

    Args:
        name: the hyper-parameter's name, for the message.
        value: the value given (a 1-element real tensor is accepted).
        low: the smallest allowed value.
        high: the upper bound.
        closed_high: whether `high` itself is allowed.

    Returns:
        The value as a float.

    Raises:
        TypeError: not a real number.
        ValueError: not finite or out of range (the message gives the range).
    """
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


_LOW_PRECISION = (torch.float16, torch.bfloat16)

#: param-group keys torch and its LR schedulers add besides the hyper-parameters
_GROUP_KEYS = frozenset({"params", "initial_lr", "param_names", "manifold"})


def _dtensor_optimizers() -> list[str]:
    """Registered optimizers whose rules run on DTensor manifold points (from the registry)."""
    from . import registry  # the registry imports this module

    names = []
    for name in registry.available():
        obj = registry.get(name)
        if isinstance(obj, type) and issubclass(obj, RiemannianOptimizer) and obj.dtensor_points:
            names.append(name)
    return names


def _check_dtype(opt, i: int, p: torch.Tensor, man) -> None:
    """A complex parameter on a real manifold (ours say which they are): TypeError."""
    cplx = getattr(man, "complex", None)
    if isinstance(cplx, bool) and p.is_complex() and not cplx:
        raise TypeError(
            f"parameter {i} of the new param group has dtype {p.dtype} but its manifold "
            f"{man!r} is real; {type(opt).__name__} cannot step a complex tensor on a real "
            "manifold: use a complex manifold (e.g. Stiefel(n, m, complex=True), Unitary(n)) "
            "or a real tensor"
        )


class RiemannianOptimizer(torch.optim.Optimizer):
    r"""Base of every built-in optimizer and the interface a plugin may implement.

    A subclass implements

    - `update(geo, x, grad, state, group) -> new x`: the rule for one
      parameter `x` (a detached view) with gradient `grad`, its `state` dict
      (`state["step"]`, a float tensor, already counts this step) and its
      `group`; `geo` supplies the manifold operations (Riemannian gradient,
      retraction `retr(x, -lr * d)` by the group's `retraction` option,
      transport, component inner product, ...) and is Euclidean for plain tensors;
    - optionally `check_group` to validate hyper-parameters (call super).

    Class attributes, read by `stiefel.optimizers.info` (the harness and the
    conformance tests use them; every one has a default):

    - `default_lr` (1e-3): the learning rate used when a caller names none;
    - `riemannian` (True): it steps manifold parameters on their manifold;
    - `feasible` (True): iterates are on the manifold to rounding (False for
      landing-like methods, which stay near it);
    - `step_flops(n, m, **hyper) -> float` (a classmethod, or None): FLOPs of
      one step on St(n, m);
    - `formula` (""): the serial complexity of a step, as text;
    - `paper_formula(**hyper) -> str` (a classmethod, or None): the FLOP count a
      paper gives for a step with these hyper-parameters;
    - `variants` (`({},)`): hyper-parameter sets the complexity section measures;
    - `accepts_off_manifold` (False): whether a manifold parameter off its
      manifold is accepted at construction;
    - `writes_state_in_place` (True): whether `update` may write into the
      tensors of `state` (`mul_`, `copy_`); False promises that it only
      replaces them (`state[key] = new`), which spares the copy of the state
      taken before each step (checked; a broken promise raises RuntimeError).

    A param group may hold only the keys of the constructor's `defaults` (and
    `params`, `initial_lr`, `param_names`): another key raises ValueError.
    A parameter whose dtype the manifold cannot hold (complex on a real
    manifold) raises TypeError. `state_dict()` records each parameter's shape,
    so `load_state_dict` of a state saved for other shapes raises ValueError
    naming the parameter.

    Constructor options (keyword-only, not hyper-parameters): `telemetry=True`
    records after each step the orthogonality error ‖XᴴX − I‖_F of every
    Stiefel-like parameter, as one tensor per step in `orthogonality_history`
    (order of `manifold_parameters`; no device synchronisation).

    A non-finite gradient skips that parameter's step (its point and state stay
    unchanged) and warns once per optimizer; so does a step whose result is not
    finite: the point, the moments, momentum buffers and step count are those
    from before the step. `repair_every=k` replaces the point
    by its nearest manifold point (polar factor) after every k-th step.

    Args:
        params: parameters or param groups.
        defaults: the hyper-parameters and their default values.
        telemetry: record the orthogonality error after every step.

    Raises:
        ValueError: a bad hyper-parameter, an unknown param-group key, a
            parameter off its manifold (unless `accepts_off_manifold`).
        TypeError: a hyper-parameter of the wrong type, a complex parameter on
            a real manifold.
    """

    default_lr: ClassVar[float] = 1e-3
    riemannian: ClassVar[bool] = True
    feasible: ClassVar[bool] = True
    step_flops: ClassVar[Callable[..., float] | None] = None
    formula: ClassVar[str] = ""
    paper_formula: ClassVar[Callable[..., str] | None] = None
    variants: ClassVar[tuple[dict, ...]] = ({},)
    accepts_off_manifold: ClassVar[bool] = False
    # whether `update` may write into the tensors of its state dict (Note [A skipped
    # step leaves the state as it was]); the built-in rules only replace them
    writes_state_in_place: ClassVar[bool] = True
    # whether the rule reaches the kernels only through its Geometry (or Geometry.apply),
    # so that DTensor manifold points run sharded (stiefel.manifolds.sharded)
    dtensor_points: ClassVar[bool] = True

    def __init__(self, params, defaults: dict, *, telemetry: bool = False):
        if not isinstance(telemetry, bool):
            raise TypeError(f"telemetry must be a bool, got {telemetry!r}")
        self._binders: list[list[_Binder]] = []
        self.check_group(dict(defaults), defaults=True)
        self.telemetry = telemetry
        self.orthogonality_history: list[torch.Tensor] = []
        self._warned_nonfinite = False
        # id(p) → the versions of p and its master after this optimizer wrote them
        # (Note [Points as the optimizer left them])
        self._written: dict[int, tuple] = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ plugin interface
    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        """Return the new value of parameter `x` (see the class docstring).

        Args:
            geo: the parameter's geometry under this group's options.
            x: the current point (a detached view; do not modify it in place).
            grad: its Euclidean gradient.
            state: the parameter's state dict (persisted in `state_dict`).
            group: the parameter's param group.

        Returns:
            The new point.
        """
        raise NotImplementedError

    def check_group(self, group: dict, defaults: bool = False) -> None:
        """Validate a param group's hyper-parameters.

        Args:
            group: the group (merged with the defaults).
            defaults: True when `group` is the constructor's defaults.

        Raises:
            ValueError: a value out of range, naming it and the allowed range.
            TypeError: a value of the wrong type.
        """
        if "lr" in group:
            check_number("lr", group["lr"])
        man = group.get("manifold")
        if man is not None and not isinstance(man, geoopt.Manifold):
            raise TypeError(
                f"manifold={man!r} is not allowed; allowed: None or a geoopt.Manifold "
                "(e.g. stiefel.Stiefel(n, m)), the manifold of the group's plain parameters"
            )
        if "metric" in group and group["metric"] is not None:
            check_choice("metric", group["metric"], METRICS)
        if "retraction" in group:
            check_choice("retraction", group["retraction"], RETRACTIONS)
        _check_repair(group.get("repair_every"))

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after checking its keys, values and parameters.

        Args:
            param_group: `{"params": ..., <hyper-parameter>: value, ...}`.

        Raises:
            ValueError: an unknown key, a bad value or a parameter off its manifold;
                the optimizer is left unchanged.
            TypeError: a parameter whose dtype its manifold cannot hold.
        """
        group = dict(param_group)
        if "stabilize" in group and "repair_every" in self.defaults:
            # geoopt's name for repair_every, also accepted per group
            stabilize = group.pop("stabilize")
            if group.get("repair_every") not in (None, stabilize):
                raise ValueError(
                    f"stabilize={stabilize!r} and repair_every={group['repair_every']!r} both "
                    "given in a param group; allowed: one of them (stabilize is geoopt's name)"
                )
            group["repair_every"] = stabilize
        unknown = sorted(set(group) - set(self.defaults) - _GROUP_KEYS)
        if unknown:
            allowed = sorted({*self.defaults, "params"})
            raise ValueError(
                f"param group key(s) {', '.join(map(repr, unknown))} not understood by "
                f"{type(self).__name__}; allowed: {', '.join(allowed)}"
            )
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        merged = {**self.defaults, **group}
        self.check_group(merged)
        binders = []
        for i, p in enumerate(params):
            # Note [Manifold from the param group]
            # A wrapper that replaces parameters (FSDP2's fully_shard makes every
            # parameter a plain DTensor Parameter) drops a ManifoldParameter's
            # ``manifold``; the group's ``manifold=`` names it for the group's plain
            # parameters. A parameter's own manifold wins.
            man = manifold_of(p)
            if man is None and not isinstance(merged.get("manifold"), geoopt.Euclidean):
                man = merged.get("manifold")
            if man is not None:
                _check_dtype(self, i, p, man)
            binder = _Binder(man, p)  # ValueError for an unsupported DTensor layout
            if binder.like is not None and man is not None and not self.dtensor_points:
                raise ValueError(
                    f"parameter {i} of the new param group is a DTensor "
                    f"(placements {tuple(binder.like.placements)}); {type(self).__name__} "
                    "calls kernels that do not run on shards. Optimizers that accept "
                    f"DTensor manifold points: {', '.join(_dtensor_optimizers())}"
                )
            if man is not None and not self.accepts_off_manifold:
                self._check_on_manifold(i, p, man, binder.bind(merged))
            binders.append(binder)
        group["params"] = params
        super().add_param_group(group)
        self._binders.append(binders)

    def _check_on_manifold(self, i: int, p: torch.Tensor, man, geo: Geometry) -> None:
        x = p.detach()
        if isinstance(geo, ShardedGeometry):  # from the Gram of the shards, no gather
            err = float(geo.error(x).to_local().max())
            bound = man.default_atol(x.dtype) if hasattr(man, "default_atol") else 1e-4
            ok, reason = err <= bound, f"‖XᴴX − I‖_F = {err:.3e} exceeds {bound:.3e}"
        else:
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with each group's parameter shapes (`param_shapes`).

        Returns:
            The state dict; `load_state_dict` checks the shapes against the
            parameters it is loaded into.
        """
        sd = super().state_dict()
        for saved, group in zip(sd["param_groups"], self.param_groups, strict=True):
            saved["param_shapes"] = [list(p.shape) for p in group["params"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict`, after checking it fits these parameters.

        Args:
            state_dict: a state dict of an optimizer of the same class.

        Raises:
            ValueError: a parameter's shape differs from the saved one (named by
                group, index and both shapes), or a state tensor cannot belong to
                its parameter; nothing is loaded then.
        """
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) == len(self.param_groups):
            for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
                shapes = saved.get("param_shapes")
                if shapes is None or len(shapes) != len(group["params"]):
                    continue  # torch's own check reports a different count
                for i, (shape, p) in enumerate(zip(shapes, group["params"], strict=True)):
                    if tuple(shape) != tuple(p.shape):
                        raise ValueError(
                            f"load_state_dict: parameter {i} of param group {g} has shape "
                            f"{tuple(p.shape)} but the state was saved for shape {tuple(shape)}; "
                            "load it into a model of the same shapes"
                        )
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [
            {k: v for k, v in saved.items() if k != "param_shapes"} for saved in saved_groups
        ]
        super().load_state_dict(state_dict)
        self._restore_master_dtypes(saved_groups, state_dict.get("state", {}))
        self._written.clear()  # loaded masters: test every point at its next step

    # ------------------------------------------------------------------ low precision
    # Note [float32 master copy of a low-precision parameter]
    # A float16/bfloat16 point cannot hold orthonormal columns to better than
    # ~√M·eps(bf16) ≈ 1e-2, and a step computed from such a point and written
    # back in bf16 loses the step itself when lr·‖d‖ is below the rounding of
    # the entries. So the optimizer steps a float32 master copy kept
    # in its state (`state["master"]`, saved in state_dict) and stores the
    # rounding of the master in the parameter. The moments live in the master's
    # dtype too. `_step_one` calls `_working` for the point and gradient it
    # hands to `update`, and `_store` to write the result.

    @staticmethod
    def _working(
        p: torch.Tensor, grad: torch.Tensor, state: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The point and gradient a rule works on: `p` itself, or its float32 master.

        Args:
            p: the parameter.
            grad: its gradient.
            state: its state dict (receives `"master"` for a float16/bfloat16
                manifold parameter on first use).

        Returns:
            `(x, grad)`: `(p.detach(), grad)` for other dtypes; the float32 master
            and the gradient in float32 for a float16/bfloat16 parameter.
        """
        if p.dtype not in _LOW_PRECISION:
            return p.detach(), grad
        master = state.get("master")
        if master is None:
            master = state["master"] = p.detach().to(torch.float32).clone()
        return master, grad.to(master.dtype)

    @staticmethod
    def _store(p: torch.Tensor, state: dict, new: torch.Tensor) -> None:
        """Write a step's result: into the master (and its rounding into `p`), or into `p`.

        Args:
            p: the parameter.
            state: its state dict.
            new: the new point, in the dtype `_working` returned.
        """
        master = state.get("master")
        if master is not None and p.dtype in _LOW_PRECISION:
            if new is not master:
                master.copy_(new)
            p.copy_(master)  # rounds to p's dtype
        else:
            p.copy_(new)

    def _restore_master_dtypes(self, saved_groups: list, saved_state: dict) -> None:
        """torch's load casts floating state to the parameter's dtype: undo it for masters.

        For a float16/bfloat16 parameter, torch's `load_state_dict` would turn the
        float32 master and moments into float16/bfloat16 (Note [float32 master copy
        of a low-precision parameter]); they are reloaded in their saved dtype.
        """
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=False):
            if p.dtype not in _LOW_PRECISION or i not in saved_state:
                continue
            for key, value in saved_state[i].items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device).clone()

    # ------------------------------------------------------------------ stepping
    @staticmethod
    @torch.compiler.disable
    def _nonfinite(
        grad: torch.Tensor, off: torch.Tensor | None = None, agree=None
    ) -> tuple[bool, bool]:
        """(grad has a non-finite entry, ``off`` is True), with one host synchronisation.

        Note [One reduction for the finiteness test]: the sum of finite entries is
        finite unless it overflows, so one reduction decides the common case. The
        answer steers Python control flow: it runs eagerly (a graph break under
        torch.compile) and costs one host synchronisation per parameter, shared
        with the off-manifold test (Note [Off-manifold points at a step]). For a
        sharded parameter ``grad`` is the local shard and ``agree`` ORs the flags
        over the ranks, so that every rank takes the same branch.
        """
        total = grad.sum()
        if off is None and agree is None:  # one scalar: its test on the host (6 ops fewer)
            bad = not math.isfinite(abs(total.item()))
            if bad:
                bad = not bool(torch.isfinite(grad).all())
            return bad, False
        flags = torch.isfinite(total).logical_not().reshape(1)
        if off is not None:
            flags = torch.cat((flags, off.reshape(1).to(flags.device)))
        if agree is not None:
            flags = agree(flags)
        bad, *rest = flags.tolist()
        if bad:
            exact = torch.isfinite(grad).all().logical_not().reshape(1)
            bad = bool((exact if agree is None else agree(exact)).item())
        return bool(bad), bool(rest and rest[0])

    @staticmethod
    @torch.compiler.disable
    def _finite(new: torch.Tensor) -> bool:
        """Whether every entry of a step's result is finite (Note [One reduction ...])."""
        if isinstance(new, DTensor):  # every rank must take the same decision
            return not RiemannianOptimizer._nonfinite(
                new.to_local(), agree=functools.partial(any_rank, mesh=new.device_mesh)
            )[0]
        return not RiemannianOptimizer._nonfinite(new)[0]

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
        state = self.state[p]
        # the point the rule steps: p, or the float32 master of a float16/bfloat16
        # p (Note [float32 master copy of a low-precision parameter])
        x, grad = self._working(p, grad, state)
        steps = state.get("step")
        off = None
        if not self.accepts_off_manifold:
            off = geo.off_manifold(
                x, None if steps is None else int(steps), self._unchanged(p, state)
            )
        if isinstance(grad, DTensor):  # local tests, one agreement (Note [Row-sharded kernels])
            agree = functools.partial(any_rank, mesh=grad.device_mesh)
            bad_grad, is_off = self._nonfinite(grad.to_local(), off, agree)
        else:
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
            self._store(p, state, geo.project(x))
            x, grad = self._working(p, grad, state)
            geo.off_manifold(x)  # the step reuses the Gram of the projected point
        # Note [A skipped step leaves the state as it was]
        saved = self._save_state(state)
        step = state.get("step")
        state["step"] = (torch.tensor(0.0) if step is None else step) + 1
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
        except BaseException:  # nothing left half-modified
            state.clear()
            state.update(saved[0])
            raise
        self._check_state_untouched(state, saved)
        if new is None or not self._finite(new):
            self._warn_once(
                "step",
                f"{type(self).__name__}: the step of {where} is not finite (huge gradient or "
                "learning rate); the parameter and its optimizer state keep their values",
            )
            state.clear()
            state.update(saved[0])
            return
        self._store(p, state, new)
        self._written[id(p)] = self._versions(p, state)

    # Note [Points as the optimizer left them]
    # A geometry may skip its off-manifold test (and the wide Gram of a square
    # point, Note [The drift correction every CHECK_EVERY-th square step]) when the
    # point is the one this optimizer wrote at its previous step. torch's version
    # counter of a tensor counts its in-place changes (load_state_dict's copy_, an
    # edit under no_grad, init_): ours were the last ones when the versions of p
    # (and of its master) are those recorded after the store. `.data` has a
    # counter of its own: a change through it is caught at the next scheduled
    # test. Nothing of this is saved: a loaded optimizer tests every point at its
    # next step (which points get corrected depends on the saved step count only,
    # so a resumed run repeats the original one bit for bit).
    @staticmethod
    def _versions(p: torch.Tensor, state: dict) -> tuple:
        master = state.get("master")
        return (getattr(p, "_version", None), None if master is None else master._version)

    def _unchanged(self, p: torch.Tensor, state: dict) -> bool:
        """Whether p (and its master) are as this optimizer's last step left them."""
        record = self._written.get(id(p))
        return record is not None and record[0] is not None and record == self._versions(p, state)

    # Note [A skipped step leaves the state as it was]
    # A step whose result is not finite is skipped, and skipped entirely: its
    # momentum, moments and step count must not be advanced either, or the next
    # steps would use a momentum holding the rejected gradient (or an infinite
    # moment) and a wrong bias correction. The point is known to be acceptable
    # only after the rule ran, so the state before the step is kept aside. A
    # rule that only replaces its state tensors (`state[key] = new tensor`, never
    # `state[key].mul_(...)`), as every built-in rule does and declares with
    # `writes_state_in_place = False`, needs a copy of the dict only (no tensor
    # copied); a rule that writes into them (the default for a plugin) gets its
    # state tensors cloned before each step. The promise is checked by the
    # tensors' version counters after every step (RuntimeError if broken).

    def _save_state(self, state: dict) -> tuple[dict, dict]:
        """The state before a step: (dict to restore, version counters of its tensors)."""
        if self.writes_state_in_place:
            copy = {
                key: (
                    value.clone()
                    if isinstance(value, torch.Tensor) and key != "master"
                    else value  # the master is written by `_store`, after acceptance
                )
                for key, value in state.items()
            }
            return copy, {}
        versions = {
            key: value._version for key, value in state.items() if isinstance(value, torch.Tensor)
        }
        return dict(state), versions

    def _check_state_untouched(self, state: dict, saved: tuple[dict, dict]) -> None:
        """A rule declaring `writes_state_in_place = False` kept its promise."""
        before, versions = saved
        for key, version in versions.items():
            if before[key]._version != version:
                raise RuntimeError(
                    f"{type(self).__name__}.update wrote into state[{key!r}] in place but the "
                    "class declares writes_state_in_place = False; replace the tensor "
                    "(state[key] = new) or set writes_state_in_place = True, so that a "
                    "skipped step can restore the state"
                )
