r"""The plugin base class `RiemannianOptimizer`.

A Riemannian optimizer is a per-parameter update rule written against a
`Geometry`; the base class does the rest, each part in a module of its own:
param groups and their checks (here, with `stiefel._core.checks`), the
binding of parameters to their manifold's geometry (`.geometry`), the float32
master of a low-precision parameter and the record of who wrote a point last
(`.master`), the transactional safe step (`.transaction`), and the terms
several rules share (`.terms`: weight decay, momentum, stabilize).

Class attributes, read by `stiefel.optimizers.info` (the harness and the
conformance tests use them; every one has a default): `default_lr` (1e-3),
`riemannian` (True), `feasible` (True; False for landing-like methods, which
stay near the manifold), `step_flops(n, m, **hyper)` (or None), `formula`,
`paper_formula(**hyper)` (or None), `variants` (`({},)`). Behaviour:

- `accepts_off_manifold` (False): a manifold parameter off its manifold is
  accepted at construction;
- `off_manifold_bound` (0.5): at `step()`, a point further than this from the
  manifold (‖XᴴX − I‖_F; past 1 also a rank-deficient one) is projected back
  with a warning (Note [Off-manifold points at a step]);
- `writes_state_in_place` (True): False promises that `update` only replaces
  its state tensors (Note [A skipped step leaves the state as it was]).

A param group may hold only the keys of the constructor's `defaults` (and
`params`, `initial_lr`, `param_names`, `manifold`, and geoopt's `stabilize`
where there is a `repair_every`). `retraction=` is checked against the
parameter's `manifold.retractions`. `state_dict()` records each parameter's
shape, checked by `load_state_dict`.

A step is a transaction (Note [Safe step]): a non-finite gradient or result
skips that parameter's step (point and state unchanged, one warning per
optimizer), and a rule that raises leaves every parameter and state as they
were. `repair_every=k` (geoopt's `stabilize=k`) re-projects every manifold
parameter of the group after every k-th step; `stabilize()` does it now.
`telemetry=True` (keyword-only) records ‖XᴴX − I‖_F of every Stiefel-like
parameter after each step in `orthogonality_history`.

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

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import geoopt
import torch

from .._core import checks
from ..manifolds import METRICS
from ..manifolds.geometry import OFF_MANIFOLD
from ..manifolds.kernels import RETRACTIONS
from . import buckets, engine, master, skips, telemetry, terms
from . import state as saved_state
from .geometry import Binding, Geometry, bind_parameter, check_kind, manifold_of

__all__ = ["RiemannianOptimizer", "check_number", "check_choice"]

#: the package's checks, under the names plugins import from here
check_number = checks.number
check_choice = checks.choice

#: param-group keys torch and its LR schedulers add besides the hyper-parameters
_GROUP_KEYS = frozenset({"params", "initial_lr", "param_names", "manifold"})
#: the keys of how a group is stepped (torch's names), beside each rule's hyper-parameters
_STEP_KEYS = ("foreach", "capturable")


class RiemannianOptimizer(torch.optim.Optimizer):
    r"""Base of every built-in optimizer and the interface a plugin may implement.

    A subclass implements

    - `update(geo, x, grad, state, group) -> new x`: the rule for one
      parameter `x` (a detached view; with ``foreach`` a stack of parameters of the
      same kind, Note [One rule call per bucket]) with gradient `grad`, its
      `state` dict (`state["step"]`, a float tensor broadcasting against `x`'s
      matrices, already counts this step) and its `group`; `geo` supplies the
      manifold operations (Riemannian gradient, retraction `retr(x, -lr * d)` by
      the group's `retraction` option, transport, component inner product, ...)
      and is Euclidean for plain tensors;
    - optionally `check_group` to validate hyper-parameters (call super), and
      `check_parameter` / `implied_manifold` (see their docstrings).

    Class attributes and behaviour: see the module docstring.

    Args:
        params: parameters or param groups.
        defaults: the hyper-parameters and their default values.
        telemetry: record the orthogonality error after every step.
        foreach: step parameters of the same kind as one batch (torch's name; None:
            where it pays, Note [One rule call per bucket]; True: wherever they can
            be); False steps each parameter alone, with the same result to rounding.
        capturable: read nothing on the host during a step (Note [One host read per
            step]), so that ``opt.step()`` can be captured in a CUDA graph; every
            parameter on one CUDA device.

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
    off_manifold_bound: ClassVar[float] = OFF_MANIFOLD
    writes_state_in_place: ClassVar[bool] = True
    # whether the rule's Euclidean form (plain tensors) is elementwise, so that plain
    # tensors of one shape may be stacked into one call (Note [One rule call per bucket])
    buckets_plain: ClassVar[bool] = False
    # whether the rule reaches the kernels only through its Geometry (or Geometry.apply),
    # so that DTensor manifold points run sharded (stiefel.manifolds.sharded)
    dtensor_points: ClassVar[bool] = True

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        telemetry: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
    ):
        self._bindings: list[list[Binding]] = []
        self._held: dict[tuple, dict] = {}  # the state views of each bucket (`buckets`)
        self.telemetry = checks.flag("telemetry", telemetry)
        self.orthogonality_history: list[torch.Tensor] = []
        # per parameter: (its name, skips for a non-finite gradient, all skips) of traced
        # steps, read by report_skipped
        self._flags_unread: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
        defaults = {**defaults, "foreach": foreach, "capturable": capturable}
        if any(key in defaults for key in terms.REPAIR_KEYS):
            period = terms.repair_period(defaults)
            defaults.update(dict.fromkeys(terms.REPAIR_KEYS, period))
        self.check_group(dict(defaults), defaults=True)
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
        """Validate a param group's hyper-parameters (ValueError/TypeError naming them).

        Args:
            group: the group (merged with the defaults).
            defaults: True when `group` is the constructor's defaults.
        """
        if "lr" in group:
            checks.number("lr", group["lr"])
        if group.get("foreach") not in (None, True, False):
            raise TypeError(
                f"foreach={group['foreach']!r} is not allowed; allowed: None, True, False"
            )
        checks.flag("capturable", group.get("capturable", False))
        man = group.get("manifold")
        if man is not None and not isinstance(man, geoopt.Manifold):
            raise TypeError(
                f"manifold={man!r} is not allowed; allowed: None or a geoopt.Manifold "
                "(e.g. stiefel.Stiefel(n, m)), the manifold of the group's plain parameters"
            )
        if group.get("metric") is not None:
            checks.choice("metric", group["metric"], METRICS)
        if "retraction" in group and not isinstance(group["retraction"], str):
            checks.choice("retraction", group["retraction"], RETRACTIONS)
        terms.repair_period(group)

    def check_parameter(self, i: int, p: torch.Tensor, geo: Geometry, group: dict) -> None:
        """Refuse parameter `i` of a new group before anything is added (default: accept).

        Args:
            i: its index in the group.
            p: the parameter.
            geo: its geometry under the group's options.
            group: the group, merged with the defaults.
        """

    def implied_manifold(self, p: torch.Tensor) -> tuple[geoopt.Manifold, bool] | None:
        """The manifold this optimizer gives a plain parameter, and whether it is transposed.

        Default None: plain parameters get the Euclidean update.
        """
        return None

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
        unknown = sorted(set(group) - set(self.defaults) - _GROUP_KEYS)
        if unknown:
            allowed = sorted({*self.defaults, "params"})
            raise ValueError(
                f"param group key(s) {', '.join(map(repr, unknown))} not understood by "
                f"{type(self).__name__}; allowed: {', '.join(allowed)}"
            )
        if any(key in group for key in terms.REPAIR_KEYS):  # geoopt's name, kept beside ours
            group.update(dict.fromkeys(terms.REPAIR_KEYS, terms.repair_period(group)))
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        merged = {**self.defaults, **group}
        self.check_group(merged)
        if merged["capturable"]:
            _check_capturable([*(p for g in self.param_groups for p in g["params"]), *params])
        bindings = [bind_parameter(self, i, p, merged) for i, p in enumerate(params)]
        if "retraction" in merged and all(b.retractions is None for b in bindings):
            checks.choice("retraction", merged["retraction"], RETRACTIONS)
        group["params"] = params
        super().add_param_group(group)
        self._bindings.append(bindings)

    @classmethod
    def dtensor_rules(cls) -> list[str]:
        """The registered optimizers whose rules step DTensor manifold points."""
        from . import registry  # at the call: the registry imports this module

        return [
            name
            for name in registry.available()
            if isinstance(obj := registry.get(name), type)
            and issubclass(obj, RiemannianOptimizer)
            and obj.dtensor_points
        ]

    def manifold_parameters(self) -> list[torch.Tensor]:
        """Parameters whose geometry is Stiefel-like, in param-group order."""
        return [
            p
            for group, bindings in zip(self.param_groups, self._bindings, strict=True)
            for p, b in zip(group["params"], bindings, strict=True)
            if b.stiefel
        ]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with each group's parameter shapes (`param_shapes`)."""
        return saved_state.pack(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict` (or by an older version) after checking shapes.

        Raises:
            ValueError: a parameter's shape differs from the saved one (named by
                group, index and both shapes); nothing is loaded then.
        """
        super().load_state_dict(saved_state.unpack(self, state_dict))
        saved_state.after_load(self, state_dict)

    # ------------------------------------------------------------------ stepping
    def _warn_once(self, key: str, message: str) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            warnings.warn(
                f"{message} (warned once per optimizer)", RuntimeWarning, stacklevel=_caller()
            )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step for every parameter with a gradient; returns ``closure()``'s loss.

        bind → bucket → rule → commit: each group's parameters are bound to their
        manifolds, grouped into buckets (Note [One rule call per bucket]), the rule is
        called once per bucket on a copy of the state (Note [The rule works on a copy
        of the state]), and the results are written after one host read of all flags
        (none when traced or capturable, Note [One host read per step]).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        traced = torch.compiler.is_compiling()
        with torch.no_grad():
            if not traced:
                self.report_skipped()  # flags a quiet step left
            computed = []
            for index, group in enumerate(self.param_groups):
                quiet = traced or bool(group["capturable"])
                self._bind_marked(group, self._bindings[index])  # bind
                for bucket in self._buckets(index, group, quiet):  # bucket
                    computed.append(self._rule(bucket, group, quiet))  # rule
            loud = [c for c in computed if not c.quiet]
            engine.select(self, [c for c in computed if c not in loud])  # commit
            while loud:  # buckets whose tested points were off: again, from their projections
                again = engine.commit(self, loud)
                loud = [single for c in again for single in self._again(c)]
                computed += loud
            self._repair(computed)
            if self.telemetry:
                telemetry.record(self)
        return loss

    def _rule(self, bucket: buckets.Bucket, group: dict, quiet: bool) -> engine.Computed:
        """`engine.compute`; a rule's RuntimeError names the parameters and their state."""
        try:
            return engine.compute(self, bucket, group, quiet)
        except RuntimeError as err:
            shapes = "; ".join(
                f"{bucket.where(k)}: "
                + (", ".join(
                    f"{key} {tuple(v.shape)}" for key in buckets.rule_keys(self.state[p])
                    if isinstance(v := self.state[p][key], torch.Tensor)
                ) or "no state")
                for k, p in enumerate(bucket.params)
            )  # fmt: skip
            raise RuntimeError(
                f"{type(self).__name__}: the step of {shapes} failed: {err} (a state of "
                "another shape, e.g. from a state_dict edited by hand, is a common cause)"
            ) from err

    def _buckets(self, index: int, group: dict, quiet: bool) -> list[buckets.Bucket]:
        """The buckets of a group's parameters that have a gradient (`buckets.plan`).

        A bucket of the same parameters as at an earlier step gets the state views that
        step left (``self._held``, one entry per set of parameters ever stepped together,
        kept in place: a traced step guards on this dict), so that its state is not
        stacked again.
        """
        # a traced step is one program already: the compiler fuses what a bucket would
        foreach = False if torch.compiler.is_compiling() else group["foreach"]
        found = buckets.plan(
            group["params"], self._bindings[index], self.state, foreach, self.buckets_plain, quiet
        )
        for bucket in found:
            if not bucket.single:
                key = tuple(map(id, bucket.params))
                bucket.views = self._held.setdefault(key, {})
        return found

    def _again(self, c: engine.Computed) -> list[engine.Computed]:
        """A bucket whose tested point was off, projected and computed parameter by parameter.

        Note [Off-manifold points at a step]: the rare path, with a host read per
        parameter (its distance, for the warning).
        """
        geo = c.bucket.binding.bind(c.group)
        out = []
        for k, p in enumerate(c.bucket.params):
            single = buckets.Bucket([p], [c.bucket.indices[k]], c.bucket.binding, c.bucket.count)
            state = self.state[p]
            x = single.binding.orient(master.point(p, state))
            # a bucket of one was found off; in a larger one, which parameter is asked
            if c.bucket.single or bool(geo.off_manifold(x, bound=self.off_manifold_bound)):
                err = geo.error(x)
                self._warn_once(
                    "off",
                    f"{type(self).__name__}: {single.where()} is off its manifold (‖XᴴX − I‖_F "
                    f"= {float(err.max()):.3e}, e.g. after load_state_dict or an in-place edit); "
                    "it is projected back (polar factor) before the step",
                )
                master.store(p, state, single.binding.orient(geo.project(x)))
            out.append(engine.compute(self, single, c.group, False, tested=True))
        return out

    def _repair(self, computed: list[engine.Computed]) -> None:
        """``repair_every=k``: re-project a group after an accepted k-th step of any parameter."""
        for group in self.param_groups:
            k = terms.repair_period(group)
            mine = [c for c in computed if c.group is group]
            if k is None or not mine:
                continue
            if mine[0].quiet:
                due = torch.stack([
                    (c.ok.reshape(-1) & _due(c.work[buckets.STEP], k).to(c.ok.device)).any()
                    for c in mine
                ]).any()  # fmt: skip
                self._stabilize_where(group, due)
            elif any(count % k == 0 for c in mine for count in c.accepted):
                self.stabilize_group(group)

    def report_skipped(self) -> int:
        """Warn about the steps skipped by quiet (compiled, capturable) steps since the last call.

        An eager `step` warns at once; a step traced by ``torch.compile`` or made
        ``capturable`` counts its skips per parameter instead (Note [One host read
        per step]), read here with one host read (the next eager `step` calls this too).

        Returns:
            The number of parameter steps skipped since the last report.
        """
        return skips.report(self)

    def _bind_marked(self, group: dict, bindings: list[Binding]) -> None:
        """Bind again a parameter bound as Euclidean that carries a manifold now.

        Machinery that rebuilt it (``fully_shard``, ``to_empty``, ...) had dropped its
        manifold when this optimizer was built from a bare parameter list; the forward
        pre-hook of its module marked it again before this step (Note [The manifold
        lives on the module] in `stiefel.manifolds.binding`). A bound parameter whose
        dtype kind is no longer its manifold's (``module.to(torch.complex64)``) is
        refused before anything is written (TypeError).
        """
        for i, p in enumerate(group["params"]):
            if bindings[i].manifold is None and manifold_of(p) is not None:
                bindings[i] = bind_parameter(self, i, p, group)
            elif bindings[i].manifold is not None and p.grad is not None:
                where = f"parameter {i} of its group (shape {tuple(p.shape)})"
                check_kind(where, p, bindings[i].manifold, type(self).__name__)

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


#: the folders whose frames a warning skips: this package's and torch's (its step wrapper)
_SKIPPED = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _caller() -> int:
    """The ``stacklevel`` of the first frame outside this package and torch (the user's)."""
    level, frame = 2, sys._getframe(2)  # the frame that called the warning's caller
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level


def _due(steps: torch.Tensor, k: int) -> torch.Tensor:
    """Whether each step count is a multiple of ``k`` (flat)."""
    return steps.reshape(-1) % k == 0


def _check_capturable(params: list[torch.Tensor]) -> None:
    """ValueError unless every parameter is on one CUDA device (``capturable=True``)."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1 or any(not d.startswith("cuda") for d in devices):
        raise ValueError(
            f"capturable=True needs every parameter on one CUDA device (a CUDA graph replays "
            f"on one device); the parameters are on {', '.join(devices)}; allowed: "
            "capturable=False, or the parameters moved to one CUDA device"
        )
