r"""The manifold operations an update rule is written against (the plugin interface).

A `Geometry` is what a manifold hands an optimizer for one parameter and one
param group: `Stiefel.geometry(metric, retraction)` returns a `StiefelGeometry`
that runs the kernels of `stiefel.manifolds.kernels` (the fused,
drift-corrected Cayley step, QR, polar), and `EuclideanGeometry` is the plain
tensor case (the rule becomes its Euclidean form). ``lr`` arguments may be
floats or tensors broadcastable against `component_inner`'s result (one step
size per matrix on a manifold, per element in the Euclidean case).

Example:
    ```python
    import torch
    from stiefel.manifolds import Stiefel

    st = Stiefel(30, 3)
    geo = st.geometry(retraction="qr")
    x = st.random(dtype=torch.float64)
    y = geo.descend(x, geo.rgrad(x, torch.randn(30, 3, dtype=torch.float64)), 0.1)
    assert float(geo.error(y).max()) < 1e-12
    ```
"""

from __future__ import annotations

import copy
import functools
import inspect
from types import MappingProxyType

import torch

from .._core.checks import choice
from . import kernels

# fmt: off
__all__ = ["Geometry", "EuclideanGeometry", "StiefelGeometry", "linear_in_g", "METRICS",
           "EGRAD2RGRAD", "INNER"]
# fmt: on

EGRAD2RGRAD = MappingProxyType(
    {"euclidean": kernels.egrad2rgrad_euclidean, "canonical": kernels.egrad2rgrad_canonical}
)
INNER = MappingProxyType(
    {"euclidean": kernels.inner_euclidean, "canonical": kernels.inner_canonical}
)
METRICS = tuple(EGRAD2RGRAD)

# Note [Off-manifold points at a step]
# A step from X with XᴴX = I + E applies the factor K = (3I − XᴴX)/2 (Note
# [Newton–Schulz drift correction]); it maps E to −¾E² + ¼E³, a contraction while
# ‖E‖ < 1, which absorbs float drift and small perturbations. Far off (a
# load_state_dict of an arbitrary matrix, a weight scaled by 3: K = −3I) the same
# factor diverges, NaN in a few steps. So a point with ‖E‖_F above OFF_MANIFOLD is
# projected (polar factor) with a warning before the step; the test reuses the
# XᴴX the Cayley step needs anyway. A point is tested (with its float64 Gram) at
# every k-th step (`frame.correction_period`) and whenever the optimizer did not
# write it itself (Notes [The drift correction every k-th step], [Tall steps
# correct every k-th step]).
# Methods that accept points off the manifold have a wider basin (``bound`` ≥ 1):
# POGO's ‖E‖₂ < 1 keeps every σ in (0, √2), where its correction takes it to 1;
# landing's flow converges from any full-rank X. Neither leaves a rank-deficient X
# (the zero point is a fixed point of both): the test is XᴴX > 0 and ‖E‖₂ < bound by
# Cholesky factorizations, not ‖E‖_F (up to √M·‖E‖₂: a point POGO left with ‖E‖₂ < 1 <
# ‖E‖_F was projected only where tested, and a resumed run left an uninterrupted one).
# Below 1, the cheaper and stricter ‖E‖_F > bound decides.
OFF_MANIFOLD = 0.5


def linear_in_g(
    fn,
    x: torch.Tensor,
    g: torch.Tensor,
    absmax: torch.Tensor | None = None,
    group=None,
    checks: list | None = None,
):
    """``fn(x, g)`` for an ``fn`` linear in ``g`` (a Riemannian gradient), overflow-safe.

    Computed for g/μ and scaled back by μ, μ = max|g| per matrix (``absmax`` if the
    caller has it), so that XᴴG cannot overflow for a huge finite G (Note
    [Overflow-safe step]); μ is exactly 1 where no entry of XᴴG (≤ 2Nμ near the
    manifold) or of X·W (≤ 4NMμ) can overflow (Note [Step weights as tensors]),
    and then the result is ``fn(x, g)`` bit for bit, with no host read. ``group``:
    the process group the rows of ``g`` are split over (μ is then the maximum over
    all of them), or None. ``checks``: the step's `kernels.reads.StepChecks`, with
    which the two passes g/μ and ·μ are skipped where μ was 1 at the last step
    (Note [Scales taken as one from the last step]).
    """
    mu = kernels.reduce.rows_absmax(g, group) if absmax is None else absmax
    n, m = g.shape[-2:]
    big = torch.finfo(g.real.dtype).max
    mu = torch.where(4 * n * m * mu < big, 1.0, mu.clamp_min(torch.finfo(mu.dtype).tiny))
    if kernels.reads.taken_as_one(checks, "gradient scale", mu):
        return fn(x, g)
    return fn(x, g / mu) * mu


class Geometry:
    """Interface of the per-parameter operations (subclasses override every method).

    Attributes:
        riemannian: False for a plain tensor.
        stiefel: True when points have orthonormal columns (XᴴX = I), so that
            Stiefel-specific rules (e.g. landing) and `error` apply.
    """

    riemannian: bool = True
    stiefel: bool = False

    def on_rows(self, group) -> Geometry:
        """This geometry for points whose rows are split over the process group ``group``.

        Note [Row-sharded geometries]
        A geometry whose operations sum over the rows (Grams, norms) returns a copy
        that hands ``group`` to each kernel it calls, as their ``group`` argument
        (Note [Row-sharded kernels] in `stiefel.manifolds.kernels.reduce`); the
        group travels with the call, never in module state. A geometry with no
        such sums (the plain tensor's) returns itself. ``group=None``: whole
        matrices, this geometry itself.
        """
        return self

    def rgrad(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Riemannian gradient of the Euclidean gradient ``g`` (the group's metric)."""
        raise NotImplementedError

    def retract(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Retraction of the tangent vector ``u`` (the group's retraction)."""
        return self.descend(x, u, -1.0)

    def descend(self, x: torch.Tensor, d: torch.Tensor, lr) -> torch.Tensor:
        """retr(x, −lr·d)."""
        raise NotImplementedError

    def descend_transport(self, x: torch.Tensor, d: torch.Tensor, lr):
        """(retr(x, −lr·d), d transported to the new point)."""
        raise NotImplementedError

    def gradient_step(self, x: torch.Tensor, g: torch.Tensor, lr) -> torch.Tensor:
        """retr(x, −lr·rgrad(x, g)), fused where the kernels allow."""
        return self.descend(x, self.rgrad(x, g), lr)

    def transport(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport of the tangent vector ``v`` at ``x`` to the point ``y``."""
        raise NotImplementedError(f"{type(self).__name__} has no vector transport")

    def component_inner(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """⟨u, u⟩ per manifold component: per matrix (..., 1, 1), or per element."""
        raise NotImplementedError

    def taken_as_one(self, site: str, scale: torch.Tensor) -> bool:
        """Whether a rule may take its per-matrix ``scale`` as exactly 1 unread this step.

        True where the step's checks say the same ``site`` measured 1 at the last step
        (Note [Scales taken as one from the last step] in
        `stiefel.manifolds.kernels.reads`); a geometry that holds no checks says no.
        """
        return False

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The nearest point of the manifold (used by ``repair_every``)."""
        return x

    def error(self, x: torch.Tensor) -> torch.Tensor:
        """‖XᴴX − I‖_F per matrix (zeros where it does not apply)."""
        return x.new_zeros(x.shape[:-2] if x.dim() >= 2 else (), dtype=x.real.dtype)

    def frame(self, x: torch.Tensor) -> Geometry | None:
        """The operations on tangent vectors at ``x`` held in X's frame, or None.

        A geometry whose points are square (O(n), U(n)) and whose retraction has a
        frame step returns a `FrameGeometry`: its tangent vectors are the n×n
        skew-Hermitian Ω of ξ = XΩ, and its ``descend_transport`` returns Ω itself as
        the transported vector (Note [Moments in the frame of X]). None: as they are.
        """
        return None

    def for_step(
        self,
        checks: list | None,
        grad: torch.Tensor | None = None,
        absmax=None,
        reads: bool = True,
    ) -> Geometry:
        """This geometry for one optimizer step (itself unless it keeps per-step data).

        Args:
            checks: where the kernels append their unread tests (Note [Refused
                matrices in a step that reads nothing] in
                `stiefel.manifolds.kernels.frame`), or None: the kernels read them.
            grad: the step's gradient, whose max|grad| per matrix is ``absmax``.
            absmax: max|grad| per matrix, (..., 1, 1), or None.
            reads: False for a step that must read nothing on the host (``capturable``):
                the kernels then take their paths unread, as in a traced step.
        """
        return self

    def apply(self, kernel, x: torch.Tensor, *args, **kwargs):
        """``kernel(x, *args, **kwargs)``: a kernel of `stiefel.manifolds.kernels` on points.

        A rule that calls a kernel directly (e.g. the landing field) calls it
        through this, so that a sharded geometry (`ShardedGeometry`) can run it
        on the local shards, handing a kernel with a ``group`` parameter (one
        that sums over the rows) the process group the rows are split over.
        """
        return kernel(x, *args, **kwargs)

    def kernel_tests(self) -> dict:
        """A rule's kernel's ``checks=``/``reads=`` (`kernels.frame.replace_refused`): none."""
        return {"reads": False}

    def off_manifold(
        self,
        x: torch.Tensor,
        step: int | None = None,
        unchanged: bool = False,
        bound: float = OFF_MANIFOLD,
    ) -> torch.Tensor | None:
        """A bool tensor, True when ``x`` is too far off to be stepped; None: no test.

        Called by the optimizer's step before the rule; a geometry may keep
        what it formed (e.g. XᴴX) for the step that follows on the same ``x``.

        Args:
            x: the point.
            step: how many steps the optimizer has taken on this parameter (None:
                unknown).
            unchanged: ``x`` is the point the optimizer's previous step wrote;
                a geometry may then skip the test and return None.
            bound: the distance ‖XᴴX − I‖_F beyond which the optimizer's rule
                cannot step ``x`` (Note [Off-manifold points at a step]).
        """
        return None


class EuclideanGeometry(Geometry):
    """A plain tensor: every rule reduces to its Euclidean form."""

    riemannian = False

    def rgrad(self, x, g):
        return g

    def descend(self, x, d, lr):
        return x - lr * d

    def descend_transport(self, x, d, lr):
        return x - lr * d, d

    def transport(self, x, y, v):
        return v

    def component_inner(self, x, u):
        return (u.conj() * u).real if u.is_complex() else u * u


@functools.lru_cache(maxsize=64)  # a geometry is made at every `Stiefel.retr`
def _kernel_refusal(fn: object) -> str | None:
    """Why ``fn`` cannot be called as a descent kernel, or None."""
    try:
        signature = inspect.signature(fn)
    except ValueError:  # a callable without a signature (a builtin): left to its call
        return None
    except TypeError as err:
        return str(err)
    try:
        signature.bind(None, None, None, None, xx=None)
    except TypeError as err:  # Python's words, about the call ("too many ... arguments")
        return f"its parameters {signature} cannot take the call fn(x, d, lr, v, xx=xx): {err}"
    return None


def _descent_kernel(name: str, fn: object):
    """An entry of a retraction table, refused (TypeError naming it) unless a descent kernel.

    A manifold's ``retractions`` may hold kernels of its own: each is called as
    ``fn(x, d, lr, v=None, *, xx=None)`` (Y = retr(X, −lr·d), and ``(Y, v transported)``
    with ``v``), so one that cannot be called so fails here, not at the first step.
    """
    try:
        err = _kernel_refusal(fn)
    except TypeError:  # unhashable: not cached
        err = _kernel_refusal.__wrapped__(fn)
    if err is not None:
        raise TypeError(
            f"retraction={name!r}: the manifold's retractions map it to {fn!r}, which is not "
            f"a descent kernel ({err}); allowed: a callable fn(x, d, lr, v=None, *, xx=None) "
            "returning retr(x, −lr·d), and (it, v transported) when v is given "
            "(stiefel.manifolds.kernels.RETRACTIONS holds the built-in ones)"
        ) from None
    return fn


class StiefelGeometry(Geometry):
    """St(N, M), O(n), U(n): the kernels of `stiefel.manifolds.kernels`.

    ``metric`` (None: the manifold's) picks the Riemannian gradient and inner
    product; ``retraction`` names an entry of the manifold's retraction table
    (``manifold.retractions``, by default `kernels.RETRACTIONS`). ``"cayley"``
    goes through the fused 2M×2M Woodbury kernels; ``"qr"`` and ``"polar"``
    transport by projection onto the new tangent space. The Cayley and polar
    steps and the polar factor of `project` end with one Newton–Schulz step: in
    float32 the SVD's polar factor of a 1024×64 matrix is ~1e-5 off the
    manifold, one step brings it to float32 rounding (Note [Newton–Schulz drift
    correction]). The QR step on St(N, M), N > M, normalizes by the Gram of its
    argument formed from this point's XᴴX, which corrects drift the same way
    (Note [QR retraction through the Gram of X − lr·d]); ``"qr"`` and
    ``"cayley"`` take the fused gradient step of their kernel. The XᴴX handed
    to them is formed in float64 every k-th step only (`off_manifold`; Notes
    [The drift correction every k-th step], [Tall steps correct every k-th step]).

    Args:
        manifold: the manifold (ours, or one of geoopt's Stiefel manifolds).
        metric: ``"euclidean"``, ``"canonical"`` or None.
        retraction: a name of the retraction table.
        default_metric: the metric used for ``metric=None``.
    """

    stiefel = True

    def __init__(
        self,
        manifold,
        metric: str | None = None,
        retraction: str = "cayley",
        *,
        default_metric: str = "euclidean",
    ):
        self.manifold = manifold
        table = getattr(manifold, "retractions", kernels.RETRACTIONS)
        self.metric = default_metric if metric is None else choice("metric", metric, METRICS)
        self.retraction = choice("retraction", retraction, table)
        self._descent = _descent_kernel(retraction, table[retraction])
        self._rgrad, self._inner = EGRAD2RGRAD[self.metric], INNER[self.metric]
        self._fused = getattr(self._descent, "gradient_step", None)
        self._gram: tuple[torch.Tensor, object] | None = None
        self._skips = getattr(self._descent, "takes_uncorrected", False)
        self._frame_step = getattr(self._descent, "frame_step", None)
        self._checks: dict = {}  # the kernels' checks= and reads= of one step, if taken
        self._step_checks, self._reads = None, True  # the step's checks (for the rule's
        # scales and kernels, `kernel_tests`), and whether it may read (not capturable)
        self._known: tuple | None = None
        self.group = None  # the process group the rows are split over (`on_rows`)
        self._rows: dict = {}  # the retraction's ``group=`` when the rows are split

    def on_rows(self, group):
        """A copy that hands ``group`` to every kernel (Note [Row-sharded geometries])."""
        if group is None:
            return self
        rows = copy.copy(self)
        rows.group, rows._rows = group, {"group": group}
        return rows

    def for_step(self, checks, grad=None, absmax=None, reads=True):
        """A copy holding the step's ``checks`` list (or ``reads=False``) and the gradient's max|G|.

        Note [One pass over the gradient for its test and its scale]
        A step reads its gradient G twice for the same number: the optimizer's
        finiteness test takes min and max of G (Note [Finiteness in one pass]), and
        the kernel's overflow-safe scale takes max|G| = max(max, −min) (Note
        [Overflow-safe step]). The optimizer hands that maximum to this copy, which
        passes it as an argument to the gradient's kernels when they are given the
        very tensor (``is``) at the same version counter (not written in between).
        """
        step = object.__new__(type(self))  # a shallow copy (copy.copy's general path is slow)
        step.__dict__.update(self.__dict__)
        step._checks, step._step_checks, step._reads = {}, checks, reads
        if getattr(self._descent, "takes_checks", False):
            if checks is not None:
                step._checks["checks"] = checks
            if not reads:
                step._checks["reads"] = False
        step._known = None if absmax is None else (grad, grad._version, absmax)
        return step

    def kernel_tests(self):
        return {"checks": self._step_checks, "reads": self._reads}

    def taken_as_one(self, site, scale):
        return kernels.reads.taken_as_one(self._step_checks, site, scale)

    def _absmax(self, g: torch.Tensor) -> torch.Tensor | None:
        """max|g| per matrix if the step's optimizer handed it (Note [One pass ...])."""
        known = self._known
        if known is not None and known[0] is g and known[1] == g._version:
            return known[2]
        return None

    def frame(self, x):
        if self._frame_step is None or not kernels.frame.in_frame(x, self.group):
            return None
        from .frame_geometry import FrameGeometry  # it subclasses this module's Geometry

        return FrameGeometry(self, self._frame_step)

    def _xx(self, x: torch.Tensor):
        if self._gram is not None and self._gram[0] is x:
            return self._gram[1]
        return None

    def off_manifold(self, x, step=None, unchanged=False, bound=OFF_MANIFOLD):
        frame = kernels.frame
        # Note [The correction period grows with n]
        correct = step is None or step % frame.correction_period(x.shape[-1]) == 0
        if self._skips and not correct and unchanged:
            self._gram = (x, frame.UNCORRECTED)
            return None
        # with no step count (a traced step, a point just projected) a tall point is
        # corrected now by its Gram in its own dtype, a square one by the float64
        # Gram its frame update needs (Note [Tall steps correct every k-th step])
        wide = self._skips and (step is not None or frame.in_frame(x, self.group))
        xx = frame.wide_gram(x, self.group) if wide else kernels.reduce.gram(x, x, self.group)
        # a point tested only because the optimizer did not write it last (a state just
        # loaded, an edit) is corrected on the scheduled steps only, as it would have
        # been: a resumed run repeats the original one bit for bit (Note [Points as the
        # optimizer left them] in `stiefel.optimizers.buckets`)
        self._gram = (x, xx if correct or not self._skips else frame.UNCORRECTED)
        return frame.outside(xx, bound).any()

    def rgrad(self, x, g):
        fn = self._rgrad if self.group is None else functools.partial(self._rgrad, group=self.group)
        return linear_in_g(fn, x, g, self._absmax(g), self.group, self._step_checks)

    def gradient_step(self, x, g, lr):
        if self._fused is None:
            return self.descend(x, self.rgrad(x, g), lr)
        known = {} if self._absmax(g) is None else {"absmax": self._absmax(g)}
        xx = self._xx(x)
        return self._fused(x, g, lr, self.metric, xx=xx, **self._checks, **known, **self._rows)

    def descend(self, x, d, lr):
        return self._descent(x, d, lr, xx=self._xx(x), **self._checks, **self._rows)

    def descend_transport(self, x, d, lr):
        return self._descent(x, d, lr, d, xx=self._xx(x), **self._checks, **self._rows)

    def transport(self, x, y, v):
        # by projection onto the tangent space at y
        return kernels.proj_tangent(y, v, self.group)

    def component_inner(self, x, u):
        return self._inner(x, u, u, keepdim=True, group=self.group)

    def project(self, x):
        return kernels.newton_schulz(kernels.polar(x, self.group), group=self.group)

    def error(self, x):
        return kernels.orthogonality_error(x, self.group)
