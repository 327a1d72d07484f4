r"""The plugin base class `RiemannianOptimizer`: its rule's interface and the step.

A Riemannian optimizer is a per-parameter update rule written against a `Geometry`; the
base class does the rest, each part in a module of its own: param groups, their checks
and the binding of parameters to their manifold's geometry when they are added
(`.groups`, `.geometry`), and the step here: bind → bucket → rule → commit, with the
buckets of parameters stepped together (`.buckets`), the rule's call on a copy of the
state and the commit of its result (`.engine`), the re-projection of ``repair_every``
and ``stabilize()`` (`.stabilize`), the float32 master of a low-precision parameter
(`.master`, used only for such a parameter), the warnings about skipped steps (`.skips`,
read only when a step was skipped) and the terms several rules share (`.terms`: weight
decay, momentum, stabilize).

Class attributes, read by `stiefel.optimizers.info` (the harness and the
conformance tests use them; every one has a default): `default_lr` (1e-3),
`riemannian` (True), `feasible` (True; False for landing-like methods, which
stay near the manifold), `step_flops(n, m, **hyper)` (or None), `formula`,
`paper_formula(**hyper)` (or None), `variants` (`({},)`). Behaviour:

- `accepts_off_manifold` (False) and `dtensor_points` (True): which parameters
  are accepted (`stiefel.optimizers.groups`);
- `off_manifold_bound` (0.5): at `step()`, a point further than this from the
  manifold (‖XᴴX − I‖_F; past 1 also a rank-deficient one) is projected back
  with a warning (Note [Off-manifold points at a step]);
- `writes_state_in_place` (True): False promises that `update` only replaces
  its state tensors (Note [A skipped step leaves the state as it was]);
- `wide_state` (empty): state keys kept in a dtype of their own, which
  `load_state_dict` reloads in their saved dtype (`master.restore_dtypes`).

A param group may hold only the keys of the constructor's `defaults` (and `params`,
`initial_lr`, `param_names`, `manifold`, and geoopt's `stabilize` where there is a
`repair_every`). `retraction=` is checked against the parameter's `manifold.retractions`.
`state_dict()` records each parameter's shape, checked by `load_state_dict`.

A step is a transaction (Note [Safe step]): a non-finite gradient or result
skips that parameter's step (point and state unchanged, a warning per optimizer
and kind, again at a parameter's 10th, 100th, … skip), and a rule that raises
leaves every parameter and state as they were. `repair_every=k` (geoopt's
`stabilize=k`) re-projects every manifold parameter of the group after every k-th
step; `stabilize()` does it now.
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

import operator
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .._core import autocast, checks
from ..manifolds.geometry import OFF_MANIFOLD
from . import buckets, engine, master, skips, telemetry, terms
from .geometry import OPTIONS, Geometry, bind_again, check_kind, manifold_of
from .groups import ParamGroups, implied_warning
from .stabilize import Stabilize

__all__ = ["RiemannianOptimizer", "check_number", "check_choice"]

#: the package's checks, under the names plugins import from here
check_number = checks.number
check_choice = checks.choice

#: the keys of how a group is stepped (torch's names), beside each rule's hyper-parameters
_STEP_KEYS = ("foreach", "capturable")


class RiemannianOptimizer(Stabilize, ParamGroups):
    r"""Base of every built-in optimizer and the interface a plugin may implement.

    A subclass implements

    - `update(geo, x, grad, state, group) -> new x`: the rule for one
      parameter `x` (a detached view; a stack of parameters of the same kind for a
      rule that declares `buckets_points` or `buckets_plain`, Note [One rule call
      per bucket]) with gradient `grad`, its `state` dict (`state["step"]`, a float
      tensor broadcasting against `x`'s matrices, already counts this step) and its
      `group`; `geo` supplies the manifold operations (Riemannian gradient, retraction
      `retr(x, -lr * d)` by the group's `retraction` option, transport, component
      inner product, ...) and is Euclidean for plain tensors;
    - optionally `check_group` to validate hyper-parameters (call super; it runs again
      at the step after a value of a group changed), and `check_parameter` /
      `implied_manifold` (`stiefel.optimizers.groups.ParamGroups`).

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
        ValueError: a bad hyper-parameter (one set in a param group later: at the next
            step), an unknown param-group key, a parameter off its manifold (unless
            `accepts_off_manifold`).
        TypeError: a hyper-parameter of the wrong type, a complex parameter on a real manifold.
    """

    default_lr: ClassVar[float] = 1e-3
    riemannian: ClassVar[bool] = True
    feasible: ClassVar[bool] = True
    step_flops: ClassVar[Callable[..., float] | None] = None
    formula: ClassVar[str] = ""
    paper_formula: ClassVar[Callable[..., str] | None] = None
    variants: ClassVar[tuple[dict, ...]] = ({},)
    off_manifold_bound: ClassVar[float] = OFF_MANIFOLD
    writes_state_in_place: ClassVar[bool] = True
    # whether the rule's Euclidean form (plain tensors) is elementwise, so that plain
    # tensors of one shape may be stacked into one call (Note [One rule call per bucket])
    buckets_plain: ClassVar[bool] = False
    # whether the rule steps same-kind manifold points stacked (reductions per matrix, state
    # a row each); False (a plugin's default): one `update` per parameter (docs/plugins.md)
    buckets_points: ClassVar[bool] = False
    # state keys kept in a dtype of their own, not the working one (`master.restore_dtypes`)
    wide_state: ClassVar[frozenset[str]] = frozenset()
    # a copy keeps telemetry; it remakes each bucket's state views and the unread flags of
    # traced steps, (name, non-finite-gradient, all skips) per parameter (Note [Copies ...])
    copied = ("telemetry", "orthogonality_history")
    host: ClassVar[dict[str, type]] = {"_held": dict, "_flags_unread": dict}

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        telemetry: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
    ):
        self.telemetry = checks.flag("telemetry", telemetry)
        self.orthogonality_history: list[torch.Tensor] = []
        super().__init__(params, {**defaults, "foreach": foreach, "capturable": capturable})

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and a warning once where plain matrices become points (`implied_warning`)."""
        super().add_param_group(param_group)
        if message := implied_warning(self, self.param_groups[-1], self._bindings[-1]):
            self._warn_once(f"implied {len(self.param_groups)}", message)  # once per group

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

    def _warn_once(self, key: str, message: str, when: str = "once per optimizer") -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            warnings.warn(f"{message} (warned {when})", RuntimeWarning, stacklevel=_caller())

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
            # Note [An optimizer step computes in the parameters' precision]
            if torch._C._is_any_autocast_enabled():  # torch's own test (nn.RNN's, AOTAutograd's)
                autocast.without(autocast.enabled_devices(), self._step, traced)
            else:
                self._step(traced)
        return loss

    def _step(self, traced: bool) -> None:
        """bind → bucket → rule → commit, for `step`."""
        if not traced and self._flags_unread and not self._all_capturable():
            self.report_skipped()  # flags a compiled step left (capturable: on request)
        computed = []
        for index, group in enumerate(self.param_groups):
            quiet = traced or bool(group["capturable"])
            self._bind(index, group)  # bind
            for bucket in self._buckets(index, group, quiet):  # bucket
                computed += self._rule(bucket, group, quiet)  # rule
        loud = [c for c in computed if not c.quiet]
        engine.select(self, [c for c in computed if c not in loud])  # commit
        while loud:  # buckets whose tested points were off: again, from their projections
            again = engine.commit(self, loud)
            loud = [single for c in again for single in self._again(c)]
            computed += loud
        self._repair(computed)
        if self.telemetry:
            telemetry.record(self)

    def _rule(self, bucket: buckets.Bucket, group: dict, quiet: bool) -> list[engine.Computed]:
        """`engine.compute`; a rule's RuntimeError names the parameters and their state.

        LAPACK refuses a whole stacked bucket when one of its matrices is not finite
        (a NaN gradient through an SVD or a solve): its parameters are then stepped one
        by one, so that only that one is skipped, as without buckets.
        """
        try:
            return [engine.compute(self, bucket, group, quiet)]
        except torch.linalg.LinAlgError:
            return [c for one in bucket.split() for c in self._rule(one, group, quiet)]
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
                f"{type(self).__name__}: the step of {shapes} failed: {err}"
                f"{buckets.state_hint(self, bucket)}"
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
            group["params"],
            self._bindings[index],
            self.state,
            foreach,
            (self.buckets_plain, self.buckets_points),
            quiet,
            (index, group.get("param_names")),
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
        for p, single in zip(c.bucket.params, c.bucket.split(), strict=True):
            state = self.state[p]
            x = single.binding.orient(master.point(p, state))
            # a bucket of one was found off; in a larger one, which parameter is asked
            if c.bucket.single or bool(geo.off_manifold(x, bound=self.off_manifold_bound)):
                err = f"‖XᴴX − I‖_F = {float(geo.error(x).max()):.3e}"
                self._warn_once("off", _off_message(type(self).__name__, single, err))
                master.store(p, state, single.binding.orient(geo.project(x)))
            out.append(engine.compute(self, single, c.group, False, tested=True))
        return out

    def _repair(self, computed: list[engine.Computed]) -> None:
        """``repair_every=k``: re-project a group after an accepted k-th step of any parameter."""
        for group in self.param_groups:
            if all(group.get(key) is None for key in terms.REPAIR_KEYS):
                continue  # the default: never re-project
            k, still = terms.repair_period(group), group.get("lr") == 0
            tensor = isinstance(still, torch.Tensor)  # a tensor lr, unread
            mine = [c for c in computed if c.group is group]
            if k is None or not mine or (not tensor and still):  # `still` unread if a tensor
                continue  # Note [A step of lr 0 leaves the point where it is] in `.engine`
            moving = ~still.to(mine[0].ok.device) if tensor else None
            if mine[0].quiet:
                due = torch.stack([
                    (c.ok.reshape(-1) & _due(c.work[buckets.STEP], k).to(c.ok.device)).any()
                    for c in mine
                ]).any()  # fmt: skip
                self._stabilize_where(group, due if moving is None else due & moving)
            elif any(count % k == 0 for c in mine for count in c.accepted):
                if moving is None:
                    self.stabilize_group(group)
                else:
                    self._stabilize_where(group, moving)

    def _all_capturable(self) -> bool:
        """Every group is ``capturable``: an eager step reads nothing, skips wait for
        `report_skipped` (a captured step must not read, and neither does its replay's
        eager twin)."""
        return all(group["capturable"] for group in self.param_groups)

    def report_skipped(self) -> int:
        """Warn about the steps skipped by quiet (compiled, capturable) steps since the last call.

        An eager `step` warns at once; a step traced by ``torch.compile`` or made
        ``capturable`` counts its skips per parameter instead (Note [One host read
        per step]), read here with one host read (the next eager `step` calls this too).

        Returns:
            The number of parameter steps skipped since the last report.
        """
        return skips.report(self)

    def _bind(self, index: int, group: dict) -> None:
        """Check and bind what changed since the last step; nothing when nothing did.

        A group whose values changed is checked again (Note [Values set after construction]
        in `.groups`). A parameter bound as Euclidean that carries a manifold now is bound
        again: machinery that rebuilt it (``fully_shard``, ``to_empty``, ...) dropped its
        manifold, which its module's forward pre-hook marked again (Note [The manifold
        lives on the module] in `stiefel.manifolds.binding`). A parameter whose dtype
        kind changed since it was bound (``module.to(torch.complex64)``) is refused
        (TypeError) when its manifold's is the other. The geometries are made again when
        the group's options changed: each binding holds its group's (``Binding.geo``).
        """
        traced = torch.compiler.is_compiling()  # its view of a group is torch's own
        if not traced and not _same(_as_set(group), last := self._checked[index]):
            self.check_again(index, group, last)
            self._checked[index] = _as_set(group)
        bindings = self._bindings[index]
        for i, p in enumerate(group["params"]):
            bound = bindings[i]
            if bound.manifold is None:
                if getattr(p, "manifold", None) is not None and manifold_of(p) is not None:
                    bindings[i] = bind_again(self, i, p, group)
                    self._bound[index] = None
            elif p.grad is not None and p.is_complex() != bound.complex:
                where = f"parameter {i} of param group {index} (shape {tuple(p.shape)})"
                check_kind(where, p, bound.manifold, type(self).__name__)
        options = tuple(map(group.get, OPTIONS))
        if options != self._bound[index]:
            for bound in bindings:
                bound.geo = bound.bind(group)
            self._bound[index] = options


#: the folders whose frames a warning skips: this package's and torch's (its step wrapper)
_SKIPPED = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _caller() -> int:
    """The ``stacklevel`` of the first frame outside this package and torch (the user's)."""
    level, frame = 2, sys._getframe(2)  # the frame that called the warning's caller
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level


def _as_set(group: dict) -> tuple:
    """A group's values as set, compared by `_same` (Note [Values set after construction] in
    `.groups`): a list or tuple by its items, so that an item set in place is a change."""
    return tuple((k, *v) if isinstance(v, list | tuple) else (k, v) for k, v in group.items())


def _same(now: tuple, last: tuple | None) -> bool:
    """Whether every value is the object last checked (identity: nothing is read)."""
    return (
        last is not None
        and len(now) == len(last)
        and all(
            len(a) == len(b) and all(map(operator.is_, a, b))
            for a, b in zip(now, last, strict=True)
        )
    )


def _off_message(name: str, single: buckets.Bucket, err: str) -> str:
    """The warning for a point off its manifold at a step (Note [Off-manifold points ...])."""
    if single.binding.implied:  # a plain matrix this optimizer steps as a point
        return (
            f"{name}: {single.where()} is a plain matrix, which {name} steps as a point of "
            f"{single.binding.manifold!r}, and it is not one ({err}); it is projected onto it "
            "(polar factor) before the step. A weight that is to stay free goes in a param "
            "group with manifold=geoopt.Euclidean(), or to another optimizer"
        )
    return (
        f"{name}: {single.where()} is off its manifold ({err}, e.g. after load_state_dict, "
        "an in-place edit, or a compiled or capturable Cayley step along a low-rank "
        "gradient with lr·‖grad‖ far above 1); it is projected back (polar factor) before "
        "the step"
    )


def _due(steps: torch.Tensor, k: int) -> torch.Tensor:
    """Whether each step count is a multiple of ``k`` (flat)."""
    return steps.reshape(-1) % k == 0
