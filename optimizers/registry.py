r"""The optimizer registry: `create`, `register`, `available`, `info`, entry points.

Every name maps to a `torch.optim.Optimizer` subclass or to a factory
`f(params, **hyper) -> Optimizer`. Built in: this package's `rgd`, `radam`,
`landing`; torch's `sgd`, `adam`, `adamw`, `rmsprop`, `adagrad`; geoopt's
`geoopt_rsgd`, `geoopt_radam`. Third-party packages add names through the
entry-point group `stiefel.optimizers`, e.g. in their pyproject.toml:

```toml
[project.entry-points."stiefel.optimizers"]
my_opt = "my_package.optim:MyOptimizer"
```

Entry points are looked up on first use (never while `stiefel` is imported)
and loaded when their name is created or asked about. A registered name wins
over an entry point of the same name, which is ignored with a warning naming
it: a plugin can never shadow, or break, a built-in.

What the harness and the conformance tests need to know about an optimizer
(default learning rate, whether it steps manifold parameters, FLOP and bytes
models of one step, the variants worth measuring) is `info(name)`, read from class
attributes with defaults.

Example:
    ```python
    import torch
    from stiefel import optimizers

    assert "rgd" in optimizers.available()
    opt = optimizers.create("adam", [torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert type(opt).__name__ == "Adam"
    assert optimizers.info("rgd").riemannian and not optimizers.info("adam").riemannian
    ```
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import geoopt
import torch

from .._core import checks
from .._core.registry import Registry
from ..manifolds.binding import restore
from ..manifolds.geoopt_points import check_geoopt
from .base import RiemannianOptimizer

__all__ = [
    "create",
    "register",
    "available",
    "info",
    "get",
    "OptimizerInfo",
    "Passes",
    "DEFAULT_STEP_BYTES",
    "load_entry_points",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "stiefel.optimizers"


def _int_steps(opt: torch.optim.Optimizer) -> None:
    for state in opt.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            state["step"] = int(step.item())


def _finite_gradients(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuse a geoopt step with a non-finite gradient before it writes any parameter.

    Note [geoopt's steps are parameter by parameter]
    geoopt steps its parameters one after another, and `Stiefel.retr` refuses a
    non-finite step: a NaN gradient of a later parameter raised after the earlier
    ones had moved, a half-stepped model and a message naming no parameter. The
    gradients are tested first, in one read (this package's optimizers skip such
    a step with a warning instead).
    """
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        return
    for gi, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                raise ValueError(
                    f"{type(opt).__name__}: parameter {i} of param group {gi} (shape "
                    f"{tuple(p.shape)}) has a non-finite gradient, and geoopt would step the "
                    "parameters before it first; nothing was stepped. Allowed: finite "
                    "gradients (clip, or skip the step), or this package's rgd/radam, "
                    "which skip such a step with a warning"
                )


def _geoopt_rsgd(params, **hyper: Any) -> geoopt.optim.RiemannianSGD:
    """geoopt's `RiemannianSGD`, refusing a non-finite gradient before any write and the
    points it would step as Euclidean tensors (Note [geoopt steps only ManifoldTensors])."""
    opt = geoopt.optim.RiemannianSGD(params, **hyper)
    check_geoopt(opt)
    opt.register_step_pre_hook(_finite_gradients)
    return opt


def _geoopt_radam(params, **hyper: Any) -> geoopt.optim.RiemannianAdam:
    """geoopt's `RiemannianAdam`, resumable exactly, refusing a non-finite gradient first.

    Note [geoopt's integer step after load_state_dict]
    geoopt keeps `state["step"]` as a Python int; torch's `load_state_dict`
    turns it into a float32 tensor, so after a resume the bias corrections
    1 − βᵗ are computed in float32 and the run departs from the uninterrupted
    one by ~1e-7. A post-load hook turns the step back into an int.
    """
    opt = geoopt.optim.RiemannianAdam(params, **hyper)
    check_geoopt(opt)  # Note [geoopt steps only ManifoldTensors]
    opt.register_load_state_dict_post_hook(_int_steps)
    opt.register_step_pre_hook(_finite_gradients)
    return opt


_geoopt_rsgd.__wrapped__ = geoopt.optim.RiemannianSGD  # its options are the class's
_geoopt_radam.__wrapped__ = geoopt.optim.RiemannianAdam


_INFO_FIELDS = (
    "default_lr",
    "riemannian",
    "feasible",
    "step_flops",
    "step_bytes",
    "formula",
    "paper_formula",
    "variants",
)


@dataclass(frozen=True)
class Passes:
    """A step's bytes model: ``reads`` N×M operands read and ``writes`` written.

    Note [Bytes model of a step]
    The bytes one step must move, counted as passes over N×M operands (the
    point X, the gradient G, N×M state such as a momentum or a first moment):
    each operand read once per pass that needs the result of an earlier one,
    and each output written once. A Stiefel step needs M×M Grams (XᴴX, XᴴG)
    before it can write X, so a fused step still reads X and G twice: once
    for the Grams, once for the update. The passes are those of a fused
    implementation of the rule, not of the kernels as written (which make
    more: that is what the harness's roofline multiple measures). M×M
    operands (M/N of a pass each) are left out. Without a declaration
    (`DEFAULT_STEP_BYTES`) a step reads X, G and one N×M state tensor and
    writes X and the state: 5 passes. The same Note for maps is Note [Bytes
    model] in `stiefel.parametrizations.base`.

    Example:
        ```python
        from stiefel.optimizers import registry

        assert registry.Passes(reads=4, writes=1)(4096, 64, itemsize=4) == 5 * 4096 * 64 * 4
        ```
    """

    reads: int
    writes: int

    def __call__(self, n: int, m: int, itemsize: int = 4, **hyper: Any) -> float:
        """(reads + writes)·n·m·itemsize bytes (``hyper`` does not change it)."""
        return float((self.reads + self.writes) * n * m * itemsize)


#: the bytes model of a step that declares none (Note [Bytes model of a step])
DEFAULT_STEP_BYTES = Passes(reads=3, writes=2)


@dataclass(frozen=True)
class OptimizerInfo:
    """What is known about a registered optimizer, declared on its class.

    Read by `info` from class attributes of the same names when present, else
    the defaults below; `register(name, **info)` keywords win over both.

    Attributes:
        name: the registered name.
        default_lr: the learning rate used when a caller names none (1e-3).
        riemannian: True when it steps manifold parameters on their manifold
            (default: True for `RiemannianOptimizer` subclasses and geoopt's
            optimizers, False otherwise).
        feasible: True when its iterates are on the manifold to rounding; False
            for infeasible methods such as landing, which stay near the manifold
            and reach it where the gradient vanishes (default True).
        step_flops: `(n, m, **hyper) -> float`, the FLOPs of one step on
            St(n, m) for the hyper-parameters `hyper` (NaN where it has no
            model), or None when it has no FLOP model at all.
        step_bytes: `(n, m, itemsize, **hyper) -> float`, the bytes one step
            moves (Note [Bytes model of a step]; default `DEFAULT_STEP_BYTES`).
        formula: the serial complexity of a step, as text ("" when unknown).
        paper_formula: `(**hyper) -> str`, the FLOP count a paper gives for a
            step with these hyper-parameters ("" where it gives none, e.g. the
            CWY paper's Table 2 for `rgd`), or None.
        variants: hyper-parameter sets the complexity section measures
            (default `[{}]`: the defaults only).
    """

    name: str
    default_lr: float = 1e-3
    riemannian: bool = False
    feasible: bool = True
    step_flops: Callable[..., float] | None = None
    step_bytes: Callable[..., float] = DEFAULT_STEP_BYTES
    formula: str = ""
    paper_formula: Callable[..., str] | None = None
    variants: list[dict] = field(default_factory=lambda: [{}])

    def flops(self, n: int, m: int, **hyper: Any) -> float:
        """`step_flops(n, m, **hyper)`, or NaN when there is no FLOP model."""
        return math.nan if self.step_flops is None else float(self.step_flops(n, m, **hyper))

    def bytes(self, n: int, m: int, itemsize: int = 4, **hyper: Any) -> float:
        """`step_bytes(n, m, itemsize, **hyper)`: the bytes of one step on St(n, m)."""
        return float(self.step_bytes(n, m, itemsize, **hyper))

    def paper(self, **hyper: Any) -> str:
        """`paper_formula(**hyper)`, or "" when there is none."""
        return "" if self.paper_formula is None else str(self.paper_formula(**hyper))


def _check_info(name: str, declared: dict[str, Any]) -> None:
    unknown = sorted(set(declared) - set(_INFO_FIELDS))
    if unknown:
        raise TypeError(
            f"register({name!r}, ...): unknown info keyword(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(_INFO_FIELDS)}"
        )
    if "default_lr" in declared:  # the harness steps with it
        checks.number("default_lr", declared["default_lr"], low_open=True)
    for key in ("riemannian", "feasible"):
        if key in declared:
            checks.flag(key, declared[key])


def _check_target(name: str, obj: Any) -> None:
    if inspect.isclass(obj):
        if not issubclass(obj, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer {name!r}: {obj.__name__} is a class but not a torch.optim.Optimizer "
                "subclass; register an Optimizer subclass or a factory returning one"
            )
    elif not callable(obj):
        raise TypeError(
            f"optimizer {name!r}: {obj!r} is neither an Optimizer subclass nor a callable factory"
        )


#: the optimizer registry (the one `Registry` policy for names, entry points and options);
#: an optimizer's options are its keyword arguments after ``params``
OPTIMIZERS: Registry[Any] = Registry(
    "optimizer",
    group=ENTRY_POINT_GROUP,
    fixed=("params",),
    stop=(RiemannianOptimizer, torch.optim.Optimizer),
    check=_check_target,
    sort=True,
)


def register(name: str, **info: Any) -> Callable[[Any], Any]:
    """Decorator registering an Optimizer subclass or a factory under `name`.

    Args:
        name: a Python identifier not taken by a registered optimizer.
        **info: fields of `OptimizerInfo` (`default_lr`, `riemannian`, `feasible`,
            `step_flops`, `step_bytes`, `formula`, `paper_formula`, `variants`) for a target that
            does not declare them as class attributes (e.g. a factory); they
            win over class attributes.

    Returns:
        The decorator, which returns its argument unchanged.

    Raises:
        ValueError: `name` is not an identifier or is taken by another object
            (an entry point of that name not yet loaded is dropped with a
            warning: the registered one wins; registering the same object
            again does nothing).
        TypeError: the target is neither an Optimizer subclass nor callable,
            or an `info` keyword is unknown.

    Example:
        ```python
        import torch
        from stiefel import optimizers

        @optimizers.register("half_sgd_doc", default_lr=0.2, riemannian=False)
        def half_sgd(params, lr):
            return torch.optim.SGD(params, lr=lr / 2)

        opt = optimizers.create("half_sgd_doc", [torch.nn.Parameter(torch.ones(2))], lr=1.0)
        assert opt.param_groups[0]["lr"] == 0.5
        assert optimizers.info("half_sgd_doc").default_lr == 0.2
        ```
    """
    _check_info(name, info)
    return OPTIMIZERS.register(name, **info)


#: torch's and geoopt's optimizers, with what `info` reports for them (keywords of
#: `register` win over class attributes). The learning rates are the harness
#: defaults: torch's move a map's free parameters, geoopt's move points on the manifold.
for _name, _obj, _declared in (
    ("sgd", torch.optim.SGD, dict(default_lr=0.05)),
    ("adam", torch.optim.Adam, dict(default_lr=1e-2)),
    ("adamw", torch.optim.AdamW, dict(default_lr=1e-2)),
    ("rmsprop", torch.optim.RMSprop, dict(default_lr=1e-3)),
    ("adagrad", torch.optim.Adagrad, dict(default_lr=0.1)),
    ("geoopt_rsgd", _geoopt_rsgd, dict(default_lr=0.05, riemannian=True)),
    ("geoopt_radam", _geoopt_radam, dict(default_lr=1e-2, riemannian=True)),
):
    register(_name, **_declared)(_obj)


def load_entry_points(force: bool = False) -> list[str]:
    """Scan the entry-point group `stiefel.optimizers` (once, or again with `force`).

    The policy of every registry (Note [One entry-point policy]): a name that
    clashes with a registered one is skipped with a warning naming the entry
    point (the registered one wins); an entry point is imported when its name
    is first created or asked about; a broken environment warns and finds
    nothing, it never raises.

    Args:
        force: scan again even if scanned before.

    Returns:
        The sorted names found and not yet loaded.
    """
    return OPTIMIZERS.load_entry_points(force)


def available() -> list[str]:
    """Sorted names of every optimizer that `create` accepts (entry points included)."""
    return OPTIMIZERS.available()


def get(name: str) -> Any:
    """The Optimizer subclass or factory registered as `name` (an entry point is loaded).

    Args:
        name: a name of `available()`.

    Returns:
        The registered class or factory.

    Raises:
        ValueError: unknown name (the available ones are listed), or an entry
            point that could not be loaded (the reason is given).
        TypeError: `name` is not a string.
    """
    return OPTIMIZERS.get(name)


def _default_riemannian(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(
        obj, (RiemannianOptimizer, geoopt.optim.mixin.OptimMixin)
    )


def info(name: str) -> OptimizerInfo:
    """What is declared about the optimizer registered as `name`.

    Args:
        name: a name of `available()` (an entry point is loaded to read it).

    Returns:
        The `OptimizerInfo`: `register` keywords, else class attributes
        (`default_lr`, `riemannian`, `feasible`, `step_flops`, `step_bytes`,
        `formula`, `paper_formula`, `variants`), else the defaults.

    Raises:
        ValueError: unknown name (the available ones are listed).
        TypeError: `name` is not a string.

    Example:
        ```python
        from stiefel import optimizers

        rgd = optimizers.info("rgd")
        assert rgd.riemannian and rgd.default_lr > 0
        print(rgd.flops(1024, 64, metric="euclidean", retraction="qr"))
        ```
    """
    obj = OPTIMIZERS.get(name)
    declared = OPTIMIZERS.meta(name)
    values: dict[str, Any] = {"riemannian": _default_riemannian(obj)}
    for key in _INFO_FIELDS:
        if key in declared:
            values[key] = declared[key]
        elif hasattr(obj, key):
            values[key] = getattr(obj, key)
    if "variants" in values:
        values["variants"] = [dict(v) for v in values["variants"]]
    return OptimizerInfo(name=name, **values)


def create(name: str, params, **hyper: Any) -> torch.optim.Optimizer:
    """Build the optimizer registered as `name` over `params` with `hyper`.

    Args:
        name: a name of `available()`.
        params: parameters or param groups, as for any torch optimizer, or a
            module: its parameters, each Riemannian weight marked with the
            manifold its module recorded (Note [The manifold lives on the
            module] in `stiefel.manifolds.binding`).
        **hyper: the optimizer's hyper-parameters.

    Returns:
        The optimizer.

    Raises:
        ValueError: unknown name (the available ones are listed); the
            optimizer's own checks raise for bad hyper-parameters.
        RegistryError: (a ValueError and a TypeError) a hyper-parameter the
            optimizer's signature does not take (the accepted ones are listed).
        TypeError: the registered factory did not return an Optimizer.
    """
    obj = OPTIMIZERS.get(name)
    OPTIMIZERS.check_options(name, hyper)
    if isinstance(params, torch.nn.Module):  # the parameters sitting at each name now
        for module in params.modules():
            restore(module)
        params = params.parameters()
    opt = obj(params, **hyper)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer factory {name!r} returned {type(opt).__name__}, not a torch.optim.Optimizer"
        )
    return opt
