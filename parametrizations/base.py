r"""The base class of the maps onto St(N, M), O(n), U(n), and the registry of methods.

A map is an ``nn.Module`` in the ``torch.nn.utils.parametrize`` style: ``forward``
takes the free parameter tensor ("original") and returns the constrained weight;
``right_inverse`` takes a point of the manifold and returns an original that maps
back to it (possibly updating the map's own buffers and parameters, such as a
sign or phase diagonal or a base point).

A new map subclasses [`OrthogonalMap`][stiefel.parametrizations.OrthogonalMap],
implements ``matrix`` and ``inverse`` and is registered with
[`register`][stiefel.parametrizations.register]; third-party packages can
instead declare it in the entry-point group ``stiefel.parametrizations``:

```text
[project.entry-points."stiefel.parametrizations"]
polar = "my_package.maps:PolarMap"
```

`OrthogonalMap` is its forward (here) and two parts of its own: the
first-use checks and state-dict guards (`_guards.Guards`) and the way back
from a point to an original, right inverses and initialisation
(`_originals.Originals`). The dtypes are in `_precision`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import torch

from .._core.autocast import autocast_off
from .._core.registry import Registry
from ..manifolds import Orthogonal, Stiefel, Unitary
from ..manifolds.binding import is_dtensor
from ..manifolds.kernels import orthogonality_error
from ._guards import Guards
from ._originals import Originals
from ._precision import DTYPES, real_work_dtype, work_dtype

__all__ = [
    "OrthogonalMap",
    "register",
    "available",
    "maps",
    "get",
    "manifold_for",
    "INITS",
    "DTYPES",
    "RIEMANNIAN",
    "ENTRY_POINT_GROUP",
]

INITS = ("nearest", "haar", "identity", "random", "torus")
RIEMANNIAN = "riemannian"
ENTRY_POINT_GROUP = "stiefel.parametrizations"

M = TypeVar("M", bound=type)


def _check_map(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, OrthogonalMap)):
        raise TypeError(f"register({name!r}) decorates OrthogonalMap subclasses, got {cls!r}")


def _name_map(name: str, cls: type[OrthogonalMap]) -> None:
    cls.method = name


#: the map registry (the one `Registry` policy for names, entry points and options)
MAPS: Registry[type[OrthogonalMap]] = Registry(
    "map",
    argument="method",
    group=ENTRY_POINT_GROUP,
    reserved={
        RIEMANNIAN: "no map: the constrained tensor itself (a weight, or a rotation's "
        "blocks) is a manifold parameter for the Riemannian optimizers"
    },
    fixed=("shape", "dtype", "device"),
    check=_check_map,
    on_register=_name_map,
)


def manifold_for(shape: Sequence[int], is_complex: bool) -> Stiefel:
    """The manifold of a weight of this shape: O(n), U(n), or St(N, M) (wide: its transpose)."""
    rows, cols = shape[-2:]
    n, m = max(rows, cols), min(rows, cols)
    if n == m:
        return Unitary(n) if is_complex else Orthogonal(n)
    return Stiefel(n, m, complex=is_complex)


def register(name: str) -> Callable[[M], M]:
    """Class decorator adding an `OrthogonalMap` subclass under ``name``.

    Built-in maps register in a fixed order when the package is imported; user
    maps come after them, in registration order. Registering the same class
    again under its name does nothing.

    Args:
        name: the method name ``orthogonalize`` will accept (a Python identifier).

    Returns:
        The decorator (it returns the class unchanged, with ``method = name``).

    Raises:
        ValueError: ``name`` is not an identifier, is ``"riemannian"`` or is
            taken by another class.
        TypeError: the decorated object is not an `OrthogonalMap` subclass.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import OrthogonalMap, available, register

        @register("polar_demo")
        class PolarDemo(OrthogonalMap):
            def matrix(self, a):
                u, _, vh = torch.linalg.svd(a, full_matrices=False)
                return u @ vh

            def inverse(self, q):
                return q

        assert "polar_demo" in available()
        ```
    """
    return MAPS.register(name)


def load_entry_points(force: bool = False) -> list[str]:
    """Scan the entry-point group ``stiefel.parametrizations`` (once, or again with ``force``).

    Note [Plugin maps never break the import]
    Entry points are scanned on the first call to `maps`, `available` or
    `get`, never at import, and a plugin's module is imported when its map is
    first needed. The policy is the one of every registry (Note [One
    entry-point policy]): a plugin whose name is taken (by a built-in or a map
    registered before) is ignored with a warning, the registered map wins; a
    plugin that fails to load, or is not an `OrthogonalMap` subclass, is
    dropped with a warning naming it.

    Returns:
        The names found and not loaded yet, sorted.
    """
    return MAPS.load_entry_points(force)


def maps() -> dict[str, type[OrthogonalMap]]:
    """The registered maps, name → class: built-ins, then user and plugin maps (loaded)."""
    return MAPS.items()


def available() -> list[str]:
    """Names ``orthogonalize`` accepts: the registered maps, then ``"riemannian"``."""
    return [*MAPS.available(), RIEMANNIAN]


def get(name: object) -> type[OrthogonalMap]:
    """The map class registered under ``name`` (ValueError listing `available` otherwise)."""
    return MAPS.get(name)  # type: ignore[arg-type]


def point_error(q: torch.Tensor) -> float:
    """max ‖QᴴQ − I‖_F over a batch of points, in float64 (complex128); 0 for no entries."""
    wide = torch.complex128 if q.is_complex() else torch.float64
    return float(orthogonality_error(q.detach().to(wide)).max()) if q.numel() else 0.0


class OrthogonalMap(Guards, Originals):
    r"""A smooth map from free parameters onto St(n, m), O(n) or U(n).

    Subclasses implement ``matrix`` (original → the tall point, shape (…, n, m)
    with n ≥ m) and ``inverse`` (a tall point, float64-safe → an original), and
    may override ``operator`` (the operator form of ``F.linear``) and
    ``prepare_operator``. The base class handles wide weights (stored as their
    transpose), argument checks, the manifold and initialisation (the checks
    and state-dict guards from `Guards`, right inverses and ``initial`` from
    `Originals`). The method's options are keyword-only arguments of
    ``__init__``.

    Capabilities the harness reads are declared on the class: ``formula`` and
    ``domain`` (text), `flops` (a FLOP model), `has_operator` and
    `takes_reflections`; ``real_only`` refuses complex weights.

    Args:
        shape: shape of the weight, (…, rows, cols).
        dtype: its dtype (float32, float64, complex64 or complex128).
        device: its device.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import CWY

        fmap = CWY((6, 3), torch.float64, reflections=3)
        v = torch.randn(6, 3, dtype=torch.float64)
        q = fmap(v)
        assert torch.allclose(q.mT @ q, torch.eye(3, dtype=torch.float64))
        assert CWY.has_operator() and CWY.takes_reflections()
        ```
    """

    method: ClassVar[str] = ""
    formula: ClassVar[str] = ""
    domain: ClassVar[str] = ""
    real_only: ClassVar[bool] = False
    #: whether this package's conformance suites test the class's points (Note [A map
    #: from elsewhere is checked at its first point])
    tested_here: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "tested_here" not in cls.__dict__:
            cls.tested_here = cls.__module__.startswith(__name__.partition(".")[0] + ".")

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str | None = None
    ):
        super().__init__()
        shape = tuple(int(s) for s in shape)
        self.weight_shape = shape
        self.transposed = shape[-2] < shape[-1]
        self.n, self.m = max(shape[-2:]), min(shape[-2:])
        self.batch = shape[:-2]
        self.is_complex = dtype.is_complex
        self.manifold = manifold_for(shape, self.is_complex)
        #: how error messages name the constrained weight (set by the caller of `build`)
        self.label = "the weight"
        self._unchecked = not self.tested_here

    # ------------------------------------------------------------------ capabilities
    @classmethod
    def options(cls) -> list[str]:
        """The method's options: the keyword-only arguments of ``__init__``."""
        params = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]

    @classmethod
    def has_operator(cls) -> bool:
        """True iff the class has an operator form (it overrides ``operator``)."""
        return cls.operator is not OrthogonalMap.operator

    @classmethod
    def takes_reflections(cls) -> bool:
        """True iff ``reflections`` is one of the method's options."""
        return "reflections" in cls.options()

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None = None) -> float:
        """Forward FLOPs of materializing the tall n×m matrix (NaN: no model)."""
        return math.nan

    @classmethod
    def bytes(cls, n: int, m: int, reflections: int | None = None, itemsize: int = 4) -> float:
        """Forward bytes moved to materialize the tall n×m matrix: 2·n·m·itemsize by default.

        Note [Bytes model]
        The bytes a forward must move between memory and the processor: every
        operand it reads or writes, once per pass that cannot start before the
        previous one ends (a product needs its whole input before the next
        product starts). Without a model of its own a map reads an n×m original
        and writes the n×m result. Forward+backward is charged 3× the forward,
        as its FLOPs (Note [Forward+backward FLOP convention]): the backward of
        a pass that reads A and writes B reads ∂B and A and writes ∂A, twice
        the forward's traffic. The harness divides by the bandwidth of a large
        triad, so operands that stay in cache make the time shorter, never
        longer, than the bytes predict (`stiefel.comparisons.cost.roofline`).
        """
        return 2.0 * n * m * itemsize

    # ------------------------------------------------------------------ to implement
    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        """The point of the manifold, tall: shape (…, n, m)."""
        raise NotImplementedError(f"{type(self).__name__} must implement matrix(original)")

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        """An original with ``matrix(original) == q`` (q tall, on the manifold, float64-safe)."""
        raise NotImplementedError(f"{type(self).__name__} must implement inverse(q)")

    def operator(self, original: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, W)`` without forming W (maps with an operator form override this)."""
        return x @ self.forward(original).mT

    def prepare_operator(self, original: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function x ↦ ``F.linear(x, W)`` for many x with one W (a rollout).

        Note [Factors once per rollout]
        A recurrent rollout applies the same W at every step. Maps whose
        operator form needs per-weight work (CWY's U and S, O(nL²)) override
        this to do it once; the default calls ``operator`` each time, and forms
        W once when the map has no operator form.
        """
        if not self.has_operator():
            w = self.forward(original)
            return lambda x: x @ w.mT
        return lambda x: self.operator(original, x)

    # ------------------------------------------------------------------ parametrize interface
    def forward(self, original: torch.Tensor) -> torch.Tensor:
        if is_dtensor(original):
            self._refuse_shard(original)
        self.verify(original)
        if original.is_complex() != self.is_complex:
            raise TypeError(
                f"the {self.method!r} map was built for {self.manifold!r} "
                f"({'complex' if self.is_complex else 'real'}) but got a {original.dtype} "
                "parameter (module.to(a complex dtype) on a real weight, or the reverse, is "
                "refused); orthogonalize the converted weight afresh"
            )
        # Note [Maps compute in float32 or wider]
        # A bfloat16 Gram matrix is off by 1e-2: autocast must not lower the
        # map's own products, and float16/bfloat16 parameters are cast to float32;
        # the map's own real tensors (signs, a complex map's phases) are computed in
        # the real dtype of that precision whatever a cast of the module left them
        # in (module.half() lowers the phases of a complex64 weight it leaves as it
        # is; module.double() raises them). The result comes back in the parameter's
        # dtype. Gradients flow through the casts.
        work, real = work_dtype(original.dtype), real_work_dtype(original.dtype)
        own = (*self._parameters.values(), *self._buffers.values())  # the map's, not its manifold's
        with autocast_off(original):  # Note [Autocast off for the maps' own products]
            if work != original.dtype or any(
                t is not None and t.is_floating_point() and t.dtype != real for t in own
            ):
                named = [*self.named_parameters(), *self.named_buffers()]
                state = {k: t.to(real) if t.is_floating_point() else t for k, t in named}
                q = torch.func.functional_call(self, state, (original.to(work),))
                return q.to(original.dtype)
            q = self.matrix(original)
        if self._unchecked and q.device.type != "meta" and not torch.compiler.is_compiling():
            self.check_first_point(original, q)
        return q.mT if self.transposed else q

    def check_first_point(self, original: torch.Tensor, q: object) -> None:
        """Refuse a point of ``matrix`` that is not (…, n, m) with orthonormal columns.

        Note [A map from elsewhere is checked at its first point]
        The package's own maps are tested by its conformance suites; a map from
        elsewhere (a plugin, a class or function passed as ``method``) is not,
        and torch's shape check is off (the weight is registered ``unsafe``, as
        a wide weight is stored transposed). Its first point (computed when
        `orthogonalize` registers it, before anything is changed) is checked
        once: its shape, and ‖QᴴQ − I‖_F within the reachability tolerance.
        Otherwise a map of another shape failed at the first forward in a matmul
        naming neither, and one that is not orthogonal trained silently.

        Raises:
            ValueError: naming the map, what it returned and what is allowed.
        """
        name, want = self.method or type(self).__name__, (*self.batch, self.n, self.m)
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        if got != want:
            raise ValueError(
                f"the {name!r} map's matrix() returned {got} for {self.label}; allowed: a "
                f"tensor of shape {want} (…, n, m) with orthonormal columns"
            )
        err = point_error(q)
        if not err <= self.tolerance(q.dtype):
            raise ValueError(
                f"the {name!r} map's point for {self.label} is not on {self.manifold!r}: "
                f"‖QᴴQ − I‖_F = {err:.3e} (allowed: ≤ {self.tolerance(q.dtype):.1e}); its "
                "matrix() must return orthonormal columns for every original"
            )
        self._unchecked = False

    def extra_repr(self) -> str:
        t = ", transposed" if self.transposed else ""
        return f"{self.method!r}, manifold={self.manifold!r}{t}"
