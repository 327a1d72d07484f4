r"""From a point of the manifold to a map's original: right inverses and initialisation.

`Originals` is the part of `OrthogonalMap` that goes the other way from its
forward: ``right_inverse`` (a point assigned to the weight), `initial` (the
point of each ``init``: nearest, Haar, identity, random, torus) and
`check_point` (shape, dtype and the tolerance a point is accepted with, Note
[Tolerance of right inverses]). Every way ends in the map's ``inverse``. It
is a mixin: only `OrthogonalMap` uses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .._core import checks as _checks
from .._core.checks import represented_dtype
from ..manifolds import Stiefel
from ..manifolds.kernels import haar, orthogonality_error, polar
from ._inverse import Unreachable
from ._polar import nearest_point, torus
from ._precision import high, work_dtype

__all__ = ["Originals"]


class Originals(nn.Module):
    """Right inverses and initialisation of `OrthogonalMap` (a mixin, not a map).

    Reads the map's geometry (``n``, ``m``, ``batch``, ``weight_shape``,
    ``transposed``, ``is_complex``, ``manifold``) and calls its ``inverse``.
    """

    n: int
    m: int
    batch: tuple[int, ...]
    weight_shape: tuple[int, ...]
    transposed: bool
    is_complex: bool
    manifold: Stiefel
    #: the first-use check of `Guards`, forgotten when `initial` sets the map's buffers
    _verified: bool

    def __init__(self) -> None:
        super().__init__()
        #: False when ``init="nearest"`` may be out of reach (default init: random)
        self.reaches_every_point = True
        #: the ``init`` given when the weight was constrained (used again by resets)
        self.init: str | None = None
        self._initial: torch.Tensor | None = None

    def random_original(self, generator: torch.Generator | None, like: torch.Tensor):
        """An original for ``init="random"``; by default that of a Haar-random point."""
        return self.inverse(self._haar(like, generator))

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        r"""Parameters mapping back to ``value``, a manifold point (any shape the weight has).

        Raises:
            ValueError: ``value`` is off the manifold (giving ‖QᴴQ − I‖_F and
                pointing to ``projx``) or not reachable with this map's options.
        """
        if self._initial is not None:  # inside initialised_with(): Note [Registering ...]
            return self._initial
        dtype = self._weight_dtype(value)  # Note [A point assigned in another precision]
        q = self.check_point(value, "value", dtype)
        try:
            return self.inverse(q.to(work_dtype(dtype))).to(dtype=dtype, device=value.device)
        except Unreachable as err:
            raise ValueError(f"value: {err}") from None

    def hold(self, parametrizations: nn.Module) -> None:
        """Record the ``ParametrizationList`` that registers this map (for `right_inverse`).

        Kept outside the module tree (not a submodule: the list holds the map), so
        ``deepcopy`` and pickling copy the reference with the model they copy.
        """
        self.__dict__["_holder"] = parametrizations

    def _weight_dtype(self, value: torch.Tensor) -> torch.dtype:
        """The dtype of the original this map is registered with (``value``'s: unregistered).

        Note [A point assigned in another precision]
        torch's parametrize refuses an original of another dtype than the one it
        holds, but only after every ``right_inverse`` has run, and the inverse of a
        map with tensors of its own (a base, signs or phases) sets them: a float32
        point assigned to a float64 weight left it neither the old point nor the new
        one. The inverse is computed for the weight's dtype instead, as ``copy_``
        and ``load_state_dict`` cast: the point is judged in its own precision
        (Note [Tolerance of right inverses]) and its original stored in the weight's.
        """
        holder = self.__dict__.get("_holder")
        return value.dtype if holder is None else holder.original.dtype

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

    def check_point(
        self, value: object, name: str, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        r"""Check ``value`` (shape, dtype, finite, on the manifold) and return it tall.

        A point that is projected comes back in the working precision of ``dtype``
        (default: its own).

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
            q = polar(high(q.detach())).to(work_dtype(dtype or q.dtype))
        return q

    def point_error(self, q: torch.Tensor) -> tuple[float, float]:
        """‖QᴴQ − I‖_F (the largest of a batch) and the tolerance of a point (Note [Tolerance
        of right inverses]): max(100·n·ε, √ε), ε of the precision ``q`` is represented in."""
        err = float(orthogonality_error(high(q.detach())).max()) if q.numel() else 0.0
        eps = torch.finfo(represented_dtype(q.detach())).eps
        return err, max(100 * self.n * eps, math.sqrt(eps))

    def tolerance(self, dtype: torch.dtype) -> float:
        """Reachability tolerance of right inverses: 1000·n·eps of the weight's dtype."""
        return 1000 * self.n * torch.finfo(dtype).eps

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

        The nearest point is the SVD polar factor after a power-of-two scaling
        (Note [Nearest point of a scaled matrix] in `stiefel.parametrizations._polar`).
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
