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

from .._core import checks as _checks
from .._core.checks import represented_dtype
from .._core.registry import Registry
from ..manifolds import Orthogonal, Stiefel, Unitary
from ..manifolds.binding import is_dtensor
from ..manifolds.kernels import haar, orthogonality_error, polar
from ._inverse import Unreachable
from ._polar import nearest_point, torus

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


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a map computes in: float32 for float16/bfloat16, else the dtype itself."""
    return torch.float32 if dtype in _checks.LOW_PRECISION else dtype


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
        #: how error messages name the constrained weight (set by the caller of `build`)
        self.label = "the weight"
        #: the ``init`` given when the weight was constrained (used again by resets)
        self.init: str | None = None
        self._verified = False
        self.register_load_state_dict_post_hook(_changed_outside)

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

    def random_original(self, generator: torch.Generator | None, like: torch.Tensor):
        """An original for ``init="random"``; by default that of a Haar-random point."""
        return self.inverse(self._haar(like, generator))

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
        # map's own products, and float16/bfloat16 parameters (and buffers, after
        # module.half()) are cast to float32; the result comes back in the
        # parameter's dtype. Gradients flow through the casts.
        meta = original.device.type == "meta"  # autocast has no meta device type
        with nullcontext() if meta else torch.autocast(original.device.type, enabled=False):
            if original.dtype in _checks.LOW_PRECISION:
                state = {
                    k: t.float() if t.is_floating_point() else t
                    for k, t in [*self.named_parameters(), *self.named_buffers()]
                }
                q = torch.func.functional_call(self, state, (original.float(),))
                return q.to(original.dtype)
            q = self.matrix(original)
        return q.mT if self.transposed else q

    def _refuse_shard(self, original: torch.Tensor) -> None:
        r"""Refuse a sharded original when the map holds local tensors.

        Note [A sharded weight is read after unshard()]
        After FSDP2's ``fully_shard`` the original is a DTensor shard outside
        the forward (inside it, FSDP2 puts the gathered Parameter there). A
        map that holds tensors of its own (signs, a base point, a scaling)
        cannot mix them with a shard (torch's "mixed torch.Tensor and DTensor"),
        and gathering the original here would hide a collective in an
        attribute read: reading ``model.layer.weight`` on one rank (logging,
        a check) would wait for the other ranks forever. So reading the weight
        there is refused with the fix: ``unshard()`` on the ``fully_shard``
        module that holds it (every rank), then read, then ``reshard()``. A map
        with no tensors of its own (the identity of ``"riemannian"`` kernels)
        computes on the shard as before.
        """
        tensors = [*self.named_parameters(), *self.named_buffers()]
        local = [k for k, t in tensors if not is_dtensor(t)]
        if not local:
            return
        raise ValueError(
            f"{self.label} ({self.method!r} map) is sharded by fully_shard: its free parameter "
            f"is a DTensor shard (placements {tuple(original.placements)}) and the map's "
            f"{', '.join(local)} are local tensors, so the weight is formed only from the "
            "gathered parameter: call unshard() first on the fully_shard module that holds it, "
            "on every rank (module.unshard(); w = module.weight; module.reshard()), or read "
            "it inside the forward"
        )

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

    def check_original(self, original: torch.Tensor) -> str | None:
        """Why ``original`` (finite) cannot be used, or None; maps with a singular case override."""
        return None

    def check_state(self) -> str | None:
        """Why the map's own tensors (its buffers) cannot be used, or None.

        Maps whose buffers must hold particular values (signs ±1, a base point
        on the manifold) override this; it runs at the first-use check and
        when a state dict is loaded (Note [Free parameters are checked at first
        use]).
        """
        return None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # the map's buffers as they were, to put back if the checkpoint's are refused
        before = {k: (b, b.detach().clone()) for k, b in self._buffers.items() if b is not None}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        buffers = [b for b in self._buffers.values() if b is not None]
        if any(b.device.type == "meta" for b in buffers):
            return
        why = self.check_state()
        if why is None:
            return
        with torch.no_grad():
            for k, (old, value) in before.items():
                if self._buffers[k] is old:
                    old.copy_(value)
                else:  # load_state_dict(assign=True) replaced it
                    self._buffers[k] = old
        raise ValueError(
            f"{self.label} ({self.method!r} map): the state dict's {why}; the map's buffers "
            "are left as they were. Load a checkpoint saved from this map, or call "
            "stiefel.parametrizations.initialize(model) or the module's reset_parameters()"
        )

    def verify(self, original: torch.Tensor) -> None:
        r"""Refuse free parameters that were never initialised (first use after a change).

        Note [Free parameters are checked at first use]
        After ``module.to_empty(device=...)`` the originals and the maps'
        buffers hold uninitialised memory, and a checkpoint can hold values no
        map accepts (a zero reflection vector: 0/0). Computing with them would
        give a NaN or an arbitrary matrix silently. So the first forward after
        the map is built, moved or converted (``_apply``: ``to``, ``to_empty``,
        ``half``…) or loaded (``load_state_dict``) checks that the original and
        the map's tensors are finite, that its buffers hold values it can use
        (`check_state`: signs ±1, a base point on the manifold) and that the
        map accepts the original (`check_original`), and raises naming the
        weight and the fix otherwise. ``load_state_dict`` runs `check_state`
        on the loaded buffers at once and puts the old ones back when it fails.
        Later forwards skip the check: no host synchronisation per step. The
        check is skipped while tracing with ``torch.compile`` (it would break
        the graph) and for values that cannot be read (meta, ``vmap``).
        """
        if self._verified or original.device.type == "meta" or torch.compiler.is_compiling():
            return
        if torch._C._functorch.is_functorch_wrapped_tensor(original):
            return
        tensors = [("the free parameter", original.detach())]
        tensors += [(f"the map's {k}", t.detach()) for k, t in self.named_parameters()]
        tensors += [(f"the map's {k}", t) for k, t in self.named_buffers()]
        floating = [(k, t) for k, t in tensors if t.is_floating_point() or t.is_complex()]
        bad = [k for k, t in floating if not bool(torch.isfinite(t).all())]
        why = f"{', '.join(bad)} not finite" if bad else self.check_state()
        why = why if why is not None else self.check_original(original.detach())
        if why is not None:
            raise ValueError(
                f"{self.label} ({self.method!r} map) cannot be computed: {why} (never "
                "initialised, e.g. after module.to_empty(), or a bad checkpoint); call "
                "stiefel.parametrizations.initialize(model) or the module's "
                "reset_parameters(), or assign a point (module.weight = Q)"
            )
        self._verified = True

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.changed_outside()
        return out

    def changed_outside(self) -> None:
        """The map's tensors were rewritten from outside (``_apply``, ``load_state_dict``).

        Forgets the first-use check (Note [Free parameters are checked at first
        use]); maps with a buffer that must stay on the manifold also repair it.
        """
        self._verified = False

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
        err, tol = self.point_error(q)
        if not err <= tol:
            raise ValueError(
                f"{name} is not on {self.manifold!r}: ‖QᴴQ − I‖_F = {err:.3e} > {tol:.3e}; "
                f"use manifold.projx(Q) (the nearest point) first"
            )
        if err > 100 * self.n * torch.finfo(torch.float64).eps:
            q = polar(high(q.detach())).to(work_dtype(q.dtype))
        return q

    def point_error(self, q: torch.Tensor) -> tuple[float, float]:
        """‖QᴴQ − I‖_F (the largest of a batch) and the tolerance of a point (Note [Tolerance
        of right inverses]): max(100·n·ε, √ε), ε of the precision ``q`` is represented in."""
        err = float(orthogonality_error(high(q.detach())).max()) if q.numel() else 0.0
        eps = torch.finfo(represented_dtype(q.detach())).eps
        return err, max(100 * self.n * eps, math.sqrt(eps))

    def _haar(self, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        # drawn (on the CPU, for the same numbers on every device) in the precision of
        # ``like``, the weight's working dtype (Note [Initialisation in the weight's
        # precision]): a float64 draw of a 4096×4096 point costs twice the float32 one
        q = haar(self.n, self.m, *self.batch, dtype=like.dtype, generator=generator)
        return q.to(device=like.device)

    def initial(
        self, weight: torch.Tensor, init: str | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        """The original for ``init`` and ``weight`` (the map's buffers are set with it).

        ``init``: "nearest" (the polar factor of the weight), "haar" (a Haar
        random point), "identity" ([I; 0]), "random" (a random point the map
        reaches: Haar for the maps that reach every point), "torus" (geotorch's
        ``sample("torus")``: a block diagonal of 2×2 rotations with angles
        uniform in (−π, π), `_polar.torus`). ``init=None`` is "nearest" when
        the map reaches every point, else "random".

        Note [Initialisation in the weight's precision]
        The point is computed in the weight's own precision (a float32 weight:
        polar factor and reflections in float32, half the time of float64 at
        n = 4096; the Haar point of ``init="haar"`` drawn in float32 too): the
        stored original is rounded to that precision anyway, and the map's
        output is then orthonormal to a few n·eps of it.

        The nearest point is computed by a scaled Newton iteration, with the
        SVD as its fallback (Note [Nearest point by the scaled Newton iteration]).
        """
        if init is None:
            init = "nearest" if self.reaches_every_point else "random"
        weight = weight.detach().to(work_dtype(weight.dtype))
        self._verified = False
        if weight.device.type == "meta":
            # Note [Meta weights]: no values exist; an original computed on the CPU stands
            # in (its shape and the buffers' layout are all that is kept). After
            # module.to_empty(device=...), the module's reset_parameters() (FSDP2's recipe)
            # or initialize(model) writes a point (Note [Deferred initialisation by
            # reset_parameters]). The CPU is named explicitly: under ``with
            # torch.device("meta")`` tensors created without a device would be meta too.
            # A random original (from a fixed generator: the caller's random stream is not
            # consumed) rather than the identity's: a map with fewer reflections than m
            # reads its meta sign buffer in ``inverse``.
            with torch.device("cpu"):
                like = torch.empty((), dtype=weight.dtype)
                fixed = torch.Generator().manual_seed(0)
                return self.random_original(fixed, like).to("meta")
        if init == "random":
            return self.random_original(generator, weight)
        if init == "haar":
            q = self._haar(weight, generator)
        elif init == "identity":
            q = torch.eye(self.n, self.m, dtype=weight.dtype, device=weight.device)
            q = q.expand(*self.batch, self.n, self.m)
        elif init == "torus":
            q = torus(self.n, self.m, *self.batch, dtype=weight.dtype, generator=generator)
            q = q.to(weight.device)
        else:
            q = nearest_point(weight.mT if self.transposed else weight)
        try:
            return self.inverse(q)
        except Unreachable as err:
            raise ValueError(
                f"init={init!r}: {err}; or init='random' (a random point this map reaches)"
            ) from None

    # ------------------------------------------------------------------ helpers for subclasses
    def fresh_init(self) -> str:
        """The ``init`` of a reset: the one given, "nearest" read as a random point.

        A reset (``reset_parameters``, `initialize`) has no weight to be near:
        the module's own reset draws a fresh random weight, whose nearest point
        is Haar-distributed for Gaussian entries; "haar" (or "random" where the
        map does not reach every point) is that distribution, without the SVD.
        """
        if self.init in (None, "nearest"):
            return "haar" if self.reaches_every_point else "random"
        return self.init

    def tolerance(self, dtype: torch.dtype) -> float:
        """Reachability tolerance of right inverses: 1000·n·eps of the weight's dtype."""
        return 1000 * self.n * torch.finfo(dtype).eps

    def extra_repr(self) -> str:
        t = ", transposed" if self.transposed else ""
        return f"{self.method!r}, manifold={self.manifold!r}{t}"


def _changed_outside(module: OrthogonalMap, incompatible_keys: object) -> None:
    module.changed_outside()


def high(x: torch.Tensor) -> torch.Tensor:
    """x in float64 / complex128 (the working precision of right inverses)."""
    return x.to(torch.complex128 if x.is_complex() else torch.float64)
