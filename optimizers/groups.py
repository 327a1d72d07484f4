r"""The param groups of a Riemannian optimizer: their checks, the binding of their parameters.

`ParamGroups` is the half of `RiemannianOptimizer` that runs when parameters are
added, not at a step: each param group's keys and hyper-parameters are checked
(`check_group`, with `stiefel._core.checks`), each parameter is bound to its
manifold's geometry once (`stiefel.optimizers.geometry.bind_parameter`: the
manifold it carries, its group's ``manifold=``, or the one the optimizer implies;
checked on its manifold and of the right dtype kind), and `state_dict` records the
parameters' shapes (`stiefel.optimizers.state`). Nothing is added when a check
fails. A group's values set later (by hand, a scheduler or ``load_state_dict``) are
checked again before the step that uses them (Note [Values set after
construction]). The step itself is `RiemannianOptimizer.step`
(`stiefel.optimizers.base`).

Behaviour a subclass declares here:

- `accepts_off_manifold` (False): a manifold parameter off its manifold is
  accepted at construction;
- `dtensor_points` (True): the rule reaches the kernels only through its
  `Geometry`, so DTensor manifold points run sharded (`stiefel.manifolds.sharded`).

Example:
    ```python
    import pytest, torch
    from stiefel import optimizers

    opt = optimizers.create("rgd", [torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": 0.9})
    assert len(opt.param_groups) == 1  # nothing added
    ```
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import geoopt
import torch

from .._core import checks
from ..manifolds import METRICS
from ..manifolds.binding import claim
from ..manifolds.kernels import RETRACTIONS
from . import state as saved_state
from . import terms
from .geometry import Binding, Geometry, bind_parameter
from .overlap import refuse_overlap

__all__ = ["ParamGroups"]

#: param-group keys torch and its LR schedulers add besides the hyper-parameters
_GROUP_KEYS = frozenset({"params", "initial_lr", "param_names", "manifold"})
#: keys torch's schedulers and SWA keep in a group for themselves (OneCycleLR, SWALR)
_SCHEDULER_KEYS = frozenset({"max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})
#: options of torch's optimizers that these rules do not implement, with the values that
#: ask for nothing (a state_dict of torch's Adam, SGD or AdamW carries them)
_TORCH_OFF = {"maximize": (False,), "differentiable": (False,), "fused": (None, False),
              "decoupled_weight_decay": (False,)}  # fmt: skip

# Note [Values set after construction]
# torch's optimizers check their hyper-parameters in the constructor only, and a
# value set in ``param_groups`` afterwards is used as it is. Here a bad value
# does more than a bad Euclidean step: a momentum ≥ 1 or β₁ = 1 makes a manifold
# step's direction infinite, which a retraction bounded by construction (Cayley,
# QR) turns into a finite jump to an arbitrary point that no finiteness test
# sees. So a group is checked again, with the constructor's `check_group`, at
# the first step after any of its values changed (`RiemannianOptimizer._bind`,
# `check_again`). A step compares each value with the one last checked by
# identity, and a list or tuple item by item (an item set in place, a params
# list replaced or grown, is a change): no ``==``, which reads a tensor and fails
# on a list of them, and a value equal but of another type (``amsgrad=0``) is a
# change. A step whose group nothing changed enters no code of this file. The
# check reads no tensor (`checks.tensors_unread`: a step synchronises with the
# device once, and a captured one never): a tensor value is range-checked where
# it is given (the constructor, ``add_param_group``, ``load_state_dict``), and
# one written in place afterwards is not seen. A changed params list is bound
# again, as ``add_param_group`` binds; where one of geoopt's ``stabilize`` and
# ``repair_every`` (two names of one option) was set, the other follows. A traced
# step checks nothing: torch.compile's view of an optimizer's groups sets
# ``capturable`` in each; a value set later is checked at the next eager step.


class ParamGroups(torch.optim.Optimizer):
    """Param groups checked and bound as they are added (the base of `RiemannianOptimizer`).

    A subclass may override `check_group` (call super), `check_parameter` and
    `implied_manifold`.

    Args:
        params: parameters or param groups.
        defaults: the hyper-parameters and their default values (``foreach`` and
            ``capturable`` included).
    """

    accepts_off_manifold: ClassVar[bool] = False
    dtensor_points: ClassVar[bool] = True
    #: attributes a copy keeps (pickle, deepcopy), beside torch's defaults, state and groups
    copied: ClassVar[tuple[str, ...]] = ()
    #: host structures a copy makes afresh, by their empty value's type
    host: ClassVar[dict[str, type]] = {}

    def __init__(self, params, defaults: dict):
        self._make_host()
        self._bindings: list[list[Binding]] = []
        self._checked: list[tuple | None] = []  # per group, its values as last checked
        # per group, the options its parameters' geometries were made for (None: not yet,
        # made at the next step; `RiemannianOptimizer._bind`)
        self._bound: list[tuple | None] = []
        if any(key in defaults for key in terms.REPAIR_KEYS):
            period = terms.repair_period(defaults)
            defaults.update(dict.fromkeys(terms.REPAIR_KEYS, period))
        self.check_group(dict(defaults), defaults=True)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict:
        """torch's (defaults, state, param groups) and the attributes named in `copied`."""
        return {**super().__getstate__(), **{k: getattr(self, k) for k in self.copied}}

    def __setstate__(self, state: dict) -> None:
        """torch's; then the `host` structures and the bindings, made again from the groups.

        Note [Copies of an optimizer]
        torch's Optimizer pickles its defaults, state and param groups only, and a
        deepcopy goes the same way: neither carries the bindings of the parameters to
        their geometries nor the host's structures of the step, without which a copy
        cannot step. They are made again here from the copied groups, as
        ``add_param_group`` made them, and the options the constructor took
        (`copied`) travel with the copy. torch's
        ``load_state_dict`` comes here too, into an optimizer that keeps its bindings
        (its points are tested at the next step, not refused here): a group saved
        without a key of today's defaults (by an older version, or by torch's SGD or
        Adam) takes its default, as torch's optimizers fill theirs.
        """
        copy = "_bindings" not in self.__dict__  # else torch's load_state_dict
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        if copy:
            self._make_host()
            self._bindings = [
                [bind_parameter(self, i, p, g) for i, p in enumerate(g["params"])]
                for g in self.param_groups
            ]
        self._bound = [None] * len(self.param_groups)  # geometries made at the next step
        self._checked = [None] * len(self.param_groups)  # checked at the next step

    def _make_host(self) -> None:
        """The `host` structures, empty (at construction and in a copy)."""
        self.__dict__.update({k: make() for k, make in self.host.items()})

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
        params, names = _named(group["params"])
        refuse_overlap(self, params)
        if names is not None:
            group["param_names"] = names
        claim(params)  # Note [A rebuilt weight stepped before any forward]
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
        self._bound.append(None)
        self._checked.append(None)  # compared from the first step

    def check_again(self, index: int, group: dict, last: tuple | None) -> None:
        """Check group ``index``, changed since ``last`` (Note [Values set after construction]).

        `check_group`, tensors unread; the parameters bound again where the group's list
        changed (as `add_param_group` binds them); the devices of a group made capturable.

        Args:
            index: the group's index.
            group: the group.
            last: its values when last checked, ``(key, *values)`` per key as
                `RiemannianOptimizer._bind` compares them (None: not checked yet).
        """
        before = {t[0]: t[1:] for t in last or ()}
        _follow_alias(group, before)
        self._refuse_keys(index, group, set(group) - set(before))
        with checks.tensors_unread():
            self.check_group(group)
        params, old = group["params"], before.get("params")
        moved = old is not None and (
            len(old) != len(params) or any(map(operator.is_not, old, params))
        )
        # a group's manifold set or replaced later is its plain parameters' from now on
        manifold = before.get("manifold", (None,))[0] is not group.get("manifold")
        if last is not None and (moved or manifold):
            claim(params)  # Note [A rebuilt weight stepped before any forward]
            bindings = [bind_parameter(self, i, p, group) for i, p in enumerate(params)]
            self._bindings[index], self._bound[index] = bindings, None
        if group["capturable"] and before.get("capturable") != (True,):
            _check_capturable([p for g in self.param_groups for p in g["params"]])

    def _refuse_keys(self, index: int, group: dict, keys: set) -> None:
        """Refuse keys set in group ``index`` after construction that no step would read.

        A misspelt key set by hand (``momentun``), or an option of another optimizer
        that a loaded ``state_dict`` brought (``maximize=True`` of torch's Adam,
        ``decoupled_weight_decay=True`` of its AdamW), would be ignored by every step.
        The keys of torch's schedulers, and torch's options at values that ask for
        nothing, are kept as they are.
        """
        # torch's options count as unknown even in `defaults`, where torch's __setstate__
        # puts `differentiable` after a copy or a load
        unknown = keys - (set(self.defaults) - set(_TORCH_OFF)) - _GROUP_KEYS - _SCHEDULER_KEYS
        bad = sorted(
            k for k in unknown
            if not (k in _TORCH_OFF and any(group[k] is v for v in _TORCH_OFF[k]))
        )  # fmt: skip
        if bad:
            given = ", ".join(f"{k}={group[k]!r}" for k in bad)
            allowed = sorted({*self.defaults, "params"} - set(_TORCH_OFF))
            raise ValueError(
                f"param group {index}: {given} set after construction (by hand or by "
                f"load_state_dict) is not understood by {type(self).__name__}, and no step "
                f"would read it; allowed: {', '.join(allowed)}"
            )

    @classmethod
    def dtensor_rules(cls) -> list[str]:
        """The registered optimizers whose rules step DTensor manifold points."""
        from . import registry  # at the call: the registry imports the optimizers

        return [
            name
            for name in registry.available()
            if isinstance(obj := registry.get(name), type)
            and issubclass(obj, ParamGroups)
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

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with each group's parameter shapes (`param_shapes`)."""
        return saved_state.pack(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict` (or by an older version) after checking shapes.

        Raises:
            ValueError: a parameter's shape differs from the saved one (named by
                group, index and both shapes), or a saved value is out of range
                (`check_group`); nothing is loaded then.
        """
        unpacked = saved_state.unpack(self, state_dict)
        if len(unpacked["param_groups"]) == len(self.param_groups):  # else torch refuses it
            for saved, group in zip(unpacked["param_groups"], self.param_groups, strict=True):
                self.check_group({**self.defaults, **saved, "params": group["params"]})
        super().load_state_dict(unpacked)
        self._checked = [None] * len(self.param_groups)
        saved_state.after_load(self, state_dict)


def _named(params) -> tuple[list[torch.Tensor], list[str] | None]:
    """A group's parameters and their names, from tensors or torch's ``(name, tensor)`` pairs.

    torch's optimizers take ``model.named_parameters()`` and keep the names in the
    group's ``param_names``; the tensors are split from their names before they are bound.

    Raises:
        TypeError: an item that is neither a tensor nor a ``(str, tensor)`` pair, or a
            set (its order changes between runs).
        ValueError: names given for some parameters of the group and not for others.
    """
    if isinstance(params, torch.Tensor):
        return [params], None
    if isinstance(params, set):
        raise TypeError(
            "params: a set of tensors has no fixed order (the state would load onto other "
            "parameters); pass a list, or model.parameters() / model.named_parameters()"
        )
    items = list(params)
    named = [isinstance(item, tuple) for item in items]
    for i, item in enumerate(items):
        pair = named[i] and len(item) == 2 and isinstance(item[0], str)
        if not isinstance(item[1] if pair else item, torch.Tensor):
            raise TypeError(
                f"params: item {i} is a {type(item).__name__} ({item!r:.60}); allowed: "
                "tensors, or (name, tensor) pairs as model.named_parameters() yields"
            )
    if any(named) and not all(named):
        raise ValueError(
            f"params: {sum(named)} of {len(items)} parameters come with names; a group "
            "gives names for all of its parameters (model.named_parameters()) or for none"
        )
    if any(named):
        return [t for _, t in items], [n for n, _ in items]
    return items, None


def _follow_alias(group: dict, before: dict) -> None:
    """Where one of geoopt's ``stabilize`` and ``repair_every`` (one option, two names) was
    set since ``before``, the other takes its value."""
    edited = [k for k in terms.REPAIR_KEYS if k in before and before[k] != (group.get(k),)]
    if len(edited) == 1:
        group.update(dict.fromkeys(terms.REPAIR_KEYS, group[edited[0]]))


def implied_warning(opt: ParamGroups, group: dict, bindings: list) -> str | None:
    """The warning for plain matrices a param group's optimizer steps as points, or None.

    An optimizer that steps plain matrices as manifold points (`implied_manifold`:
    pogo, as pogo-torch) changes what those weights can be; a readout made
    orthonormal without a word is a silently different model.
    """
    pairs = zip(group["params"], bindings, strict=True)
    shapes = [tuple(p.shape) for p, b in pairs if b.implied]
    if not shapes:
        return None
    shown = ", ".join(map(str, shapes[:4])) + (", ..." if len(shapes) > 4 else "")
    return (
        f"{type(opt).__name__} steps {len(shapes)} plain matrix weight(s) (shapes {shown}) as "
        "points of the Stiefel manifold: they are made and kept orthonormal. A weight that "
        "is to stay free goes in a param group with manifold=geoopt.Euclidean(), or to "
        "another optimizer"
    )


def _check_capturable(params: list[torch.Tensor]) -> None:
    """ValueError unless every parameter is on one CUDA device (``capturable=True``)."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1 or any(not d.startswith("cuda") for d in devices):
        raise ValueError(
            f"capturable=True needs every parameter on one CUDA device (a CUDA graph replays "
            f"on one device); the parameters are on {', '.join(devices)}; allowed: "
            "capturable=False, or the parameters moved to one CUDA device"
        )
