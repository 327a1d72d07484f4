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
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import ClassVar, TypeVar

import torch
from torch import nn

from ..manifolds import Orthogonal, Stiefel, Unitary, _checks
from ..manifolds._checks import represented_dtype
from ..manifolds._registry import Registry
from ..manifolds.kernels import haar, orthogonality_error, polar
from ._inverse import Unreachable

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

DTYPES = (
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float16,
    torch.bfloat16,
)
LOW = (torch.float16, torch.bfloat16)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a map computes in: float32 for float16/bfloat16, else the dtype itself."""
    return torch.float32 if dtype in LOW else dtype


INITS = ("nearest", "haar", "identity", "random")
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
        RIEMANNIAN: "orthogonalize makes the weight itself a manifold parameter for the "
        "Riemannian optimizers"
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


def methods_serving(shape: Sequence[int], dtype: torch.dtype) -> list[str]:
    """Names of the methods that can serve a weight of this shape and dtype."""
    out = [name for name, cls in maps().items() if not (cls.real_only and dtype.is_complex)]
    return out + ([RIEMANNIAN] if shape[-2] >= shape[-1] else [])


class OrthogonalMap(nn.Module):
    r"""A smooth map from free parameters onto St(n, m), O(n) or U(n).

    Subclasses implement ``matrix`` (original → the tall point, shape (…, n, m)
    with n ≥ m) and ``inverse`` (a tall point, float64-safe → an original), and
    may override ``operator`` (the operator form of ``F.linear``) and
    ``prepare_operator``. The base class handles wide weights (stored as their
    transpose), argument checks, the manifold and initialisation. The method's
    options are keyword-only arguments of ``__init__``.

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
        #: False when ``init="nearest"`` may be out of reach (default init: random)
        self.reaches_every_point = True
        self._initial: torch.Tensor | None = None

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

    def random_original(self, generator: torch.Generator | None, like: torch.Tensor):
        """An original for ``init="random"``; by default that of a Haar-random point."""
        return self.inverse(self._haar(like, generator))

    # ------------------------------------------------------------------ parametrize interface
    def forward(self, original: torch.Tensor) -> torch.Tensor:
        if original.is_complex() != self.is_complex:
            raise TypeError(
                f"the {self.method!r} map was built for {self.manifold!r} "
                f"({'complex' if self.is_complex else 'real'}) but got a {original.dtype} "
                "parameter (module.to(a complex dtype) on a real weight, or the reverse, is "
                "refused); orthogonalize the converted weight afresh"
            )
        # Note [Maps compute in float32 or wider]
        # A bfloat16 Gram matrix is off by 1e-2: autocast must not lower the
        # map's own products, and float16/bfloat16 parameters (and buffers, after
        # module.half()) are cast to float32; the result comes back in the
        # parameter's dtype. Gradients flow through the casts.
        meta = original.device.type == "meta"  # autocast has no meta device type
        with nullcontext() if meta else torch.autocast(original.device.type, enabled=False):
            if original.dtype in LOW:
                state = {
                    k: t.float() if t.is_floating_point() else t
                    for k, t in [*self.named_parameters(), *self.named_buffers()]
                }
                q = torch.func.functional_call(self, state, (original.float(),))
                return q.to(original.dtype)
            q = self.matrix(original)
        return q.mT if self.transposed else q

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        r"""Parameters mapping back to ``value``, a manifold point (any shape the weight has).

        Raises:
            ValueError: ``value`` is off the manifold (giving ‖QᴴQ − I‖_F and
                pointing to ``projx``) or not reachable with this map's options.
        """
        if self._initial is not None:  # inside initialised_with(): Note [Registering ...]
            return self._initial
        q = self.check_point(value, "value")
        try:
            return self.inverse(q.to(work_dtype(q.dtype))).to(
                dtype=value.dtype, device=value.device
            )
        except Unreachable as err:
            raise ValueError(f"value: {err}") from None

    @contextmanager
    def initialised_with(self, original: torch.Tensor) -> Iterator[None]:
        r"""Inside the block, ``right_inverse`` returns ``original`` (used to register).

        Note [Registering with a precomputed original]
        ``parametrize.register_parametrization`` calls ``right_inverse`` on the
        current weight, which is in general not on the manifold (a fresh
        ``nn.Linear``). ``orthogonalize`` computes the original of the initial
        point first (checking everything before the module is touched) and
        registers inside this block, so that the one call torch makes returns
        it. Writing the point into the weight first instead would modify the
        user's weight before success is known and compute the inverse twice.
        The block always resets, also when registration fails.
        """
        self._initial = original
        try:
            yield
        finally:
            self._initial = None

    def check_point(self, value: object, name: str) -> torch.Tensor:
        r"""Check ``value`` (shape, dtype, finite, on the manifold) and return it tall.

        Note [Tolerance of right inverses]
        Anything a map produced must be assignable back (geotorch's
        ``update_base`` pattern, torch's ``module.weight = module.weight``).
        A map computed in precision p (eps ε) lands within a few n·ε of the
        manifold, more for large arguments of expm. The point is therefore
        judged in the precision it is represented in (a float64 tensor whose
        entries are all float32 numbers came from float32, e.g. through
        ``.double()`` after training) and accepted when ‖QᴴQ − I‖_F ≤
        max(100·n·ε, √ε); an accepted point that is not orthonormal to
        100·n·eps(float64) is replaced by its polar factor computed in float64
        (the nearest point, a change of the size of the error) before the
        inverse, so the stored parameters map onto the manifold exactly.
        """
        value = _checks.tensor(name, value)
        if tuple(value.shape) != self.weight_shape:
            raise ValueError(
                f"{name} must have the weight's shape {self.weight_shape}, got {tuple(value.shape)}"
            )
        if value.dtype.is_complex != self.is_complex:
            raise TypeError(
                f"{name} has dtype {value.dtype}; {self.manifold!r} needs a "
                f"{'complex' if self.is_complex else 'real'} dtype"
            )
        q = value.mT if self.transposed else value
        if q.device.type == "meta":
            return q
        _checks.finite(name, value)
        err = float(orthogonality_error(high(q.detach())).max()) if q.numel() else 0.0
        eps = torch.finfo(represented_dtype(value.detach())).eps
        tol = max(100 * self.n * eps, math.sqrt(eps))
        if not err <= tol:
            raise ValueError(
                f"{name} is not on {self.manifold!r}: ‖QᴴQ − I‖_F = {err:.3e} > {tol:.3e}; "
                f"use manifold.projx(Q) (the nearest point) first"
            )
        if err > 100 * self.n * torch.finfo(torch.float64).eps:
            q = polar(high(q.detach())).to(work_dtype(q.dtype))
        return q

    def _haar(self, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        # drawn (on the CPU, for the same numbers on every device) in the precision of
        # ``like``, the weight's working dtype (Note [Initialisation in the weight's
        # precision]): a float64 draw of a 4096×4096 point costs twice the float32 one
        q = haar(self.n, self.m, *self.batch, dtype=like.dtype, generator=generator)
        return q.to(device=like.device)

    def initial(
        self, weight: torch.Tensor, init: str | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        """The original for ``init`` ("nearest", "haar", "identity", "random") and ``weight``.

        ``init=None`` is "nearest" when the map reaches every point, else "random".

        Note [Initialisation in the weight's precision]
        The point is computed in the weight's own precision (a float32 weight:
        polar factor and reflections in float32, half the time of float64 at
        n = 4096; the Haar point of ``init="haar"`` drawn in float32 too): the
        stored original is rounded to that precision anyway, and the map's
        output is then orthonormal to a few n·eps of it.

        Note [Nearest point by the SVD]
        The nearest point is the SVD's polar factor UVᴴ, O(n³) with a large
        constant (the bidiagonalisation is memory bound): about 16 s for a
        float32 4096×4096 weight on two cores, against ~1 s for the reflections.
        Two alternatives were measured on two cores and were not faster: the
        scaled Newton iteration X ← ½(μX + μ⁻¹X⁻ᴴ) (8–10 LU inverses), and the
        polar factor A·V Λ^{-1/2} Vᴴ from the eigendecomposition of the float64
        Gram AᴴA = VΛVᴴ (accurate to float32 for κ(A) ≲ 1e4, but a float64
        n×n eigh and three float64 products cost as much as the float32 SVD:
        4.2 s against 3.7 s at n = 1024, one thread). So the SVD stays, and
        ``orthogonalize`` documents the fast inits ("haar", "identity", "random").
        """
        if init is None:
            init = "nearest" if self.reaches_every_point else "random"
        weight = weight.detach().to(work_dtype(weight.dtype))
        if weight.device.type == "meta":
            # Note [Meta weights]: no values exist; the identity's original (computed on the
            # CPU, its shape and the buffers' layout are all that is kept) stands in. After
            # module.to_empty(device=...), assign a point: module.weight = Q (e.g.
            # torch.nn.init.orthogonal_(torch.empty(shape))), which resets every buffer.
            # The CPU is named explicitly: under ``with torch.device("meta")`` (a model
            # built there) tensors created without a device would be meta too.
            with torch.device("cpu"):
                eye = torch.eye(self.n, self.m, dtype=weight.dtype)
                return self.inverse(eye.expand(*self.batch, self.n, self.m)).to("meta")
        if init == "random":
            return self.random_original(generator, weight)
        if init == "haar":
            q = self._haar(weight, generator)
        elif init == "identity":
            q = torch.eye(self.n, self.m, dtype=weight.dtype, device=weight.device)
            q = q.expand(*self.batch, self.n, self.m)
        else:
            q = polar(weight.mT if self.transposed else weight)
        try:
            return self.inverse(q)
        except Unreachable as err:
            raise ValueError(
                f"init={init!r}: {err}; or init='random' (a random point this map reaches)"
            ) from None

    # ------------------------------------------------------------------ helpers for subclasses
    def tolerance(self, dtype: torch.dtype) -> float:
        """Reachability tolerance of right inverses: 1000·n·eps of the weight's dtype."""
        return 1000 * self.n * torch.finfo(dtype).eps

    def extra_repr(self) -> str:
        t = ", transposed" if self.transposed else ""
        return f"{self.method!r}, manifold={self.manifold!r}{t}"


def high(x: torch.Tensor) -> torch.Tensor:
    """x in float64 / complex128 (the working precision of right inverses)."""
    return x.to(torch.complex128 if x.is_complex() else torch.float64)
