r"""`OrthogonalMatrix`: a bare tensor constrained, held by a module of its own.

``orthogonalize(tensor)`` returns one; ``W()`` is the matrix and
``W.linear(x)``/``W.operator()`` apply it without forming it where the map has
an operator form. It holds its tensor as ``weight`` and constrains it as
``orthogonalize(module, "weight")`` would (`registration`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .._core.autocast import autocast_off, autocast_on
from ..manifolds import Stiefel
from .base import OrthogonalMap
from .factory import Method, resolve
from .registration import check_weight, orthogonalize_module

__all__ = ["OrthogonalMatrix"]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w) if w.dim() == 2 else x @ w.mT


def _reads_values(options: dict[str, Any]) -> bool:
    """Whether the ``init`` of ``options`` reads the tensor's values (the nearest point)."""
    return options.get("init") in (None, "nearest")


class OrthogonalMatrix(nn.Module):
    r"""A trainable matrix on O(n), U(n) or St(N, M): ``W()`` is the matrix.

    Made by `orthogonalize` from a bare tensor. ``W.linear(x)`` equals
    ``F.linear(x, W())`` (x of shape (…, m), the result (…, n); for a batched
    W, ``x @ W().mT``), computed without forming W() for ``householder``,
    ``cwy`` and ``tcwy`` (O(nL) per vector). ``W.manifold`` and ``W.method``
    say what it is; ``W.map`` is the parametrization module (None for
    ``"riemannian"``).
    """

    def __init__(self, tensor: torch.Tensor, method: Method = "cwy", **options: Any):
        super().__init__()
        t = check_weight("tensor", tensor, values=_reads_values(options))
        self._hold(nn.Parameter(t.detach().clone()), method, options)

    @classmethod
    def _holding(cls, param: nn.Parameter, method: Method, options: dict[str, Any]):
        """The holder of a free ``param`` itself (no copy): ``param`` becomes its free parameter."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        # named as the caller of orthogonalize gave it (not the holder's "module.weight")
        check_weight("module_or_tensor (a free nn.Parameter)", param, _reads_values(options))
        self._hold(param, method, options)
        return self

    def _hold(self, param: nn.Parameter, method: Method, options: dict[str, Any]) -> None:
        for key, needs in (("conv_kernel", "convolution module"), ("gates", "nn.LSTM/nn.GRU")):
            if options.get(key):
                raise TypeError(f"{key}=True needs a {needs}; got {type(param).__name__}")
        label, _, _ = resolve(method)
        self.weight = param
        orthogonalize_module(self, "weight", method, dict(options))
        self.method = label

    def forward(self) -> torch.Tensor:
        return self.weight

    @property
    def map(self) -> OrthogonalMap | None:
        if parametrize.is_parametrized(self, "weight"):
            return self.parametrizations.weight[0]  # type: ignore[index, return-value]
        return None

    @property
    def manifold(self) -> Stiefel:
        fmap = self.map
        return fmap.manifold if fmap is not None else self.weight.manifold  # type: ignore

    def operator(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function x ↦ ``F.linear(x, W())`` for applying one W to many inputs.

        For a rollout call it once per sequence: the map's per-weight work (for
        ``cwy``/``tcwy`` the factors U and S, Note [Factors once per rollout])
        is done here, and each call costs O(N·L) per vector without forming W.
        Maps without an operator form form W once, here. (Inside
        ``parametrize.cached()`` this still uses the operator form: torch offers
        no public way to ask whether caching is on, and the factors cost
        O(NL²) once per call of ``operator()``, less than forming W.)

        Example:
            ```python
            import torch
            from stiefel import orthogonalize

            W = orthogonalize(torch.randn(64, 64), method="cwy", reflections=8)
            step = W.operator()
            h = torch.randn(5, 64)
            assert torch.allclose(step(step(h)), h @ W().T @ W().T, atol=1e-5)
            ```
        """
        fmap = self.map
        if fmap is None:
            w = self.weight
            return lambda x: _linear(x, w)
        original = self.parametrizations.weight.original
        # Note [Autocast off for the maps' own products]: the operator is the map's own
        # work; inside an autocast region it runs in the weight's dtype with autocast off,
        # on x cast to it, and returns x's dtype (the region's bfloat16 activations)
        with autocast_off(original):
            apply = fmap.prepare_operator(original)

        def run(x: torch.Tensor) -> torch.Tensor:
            return apply(x.unsqueeze(0)).squeeze(0) if x.dim() == 1 else apply(x)

        def op(x: torch.Tensor) -> torch.Tensor:
            if not autocast_on(x):
                return run(x)
            with autocast_off(x):
                return run(x.to(original.dtype)).to(x.dtype)

        return op

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, W())``, in the operator form where the map has one."""
        return self.operator()(x)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, manifold={self.manifold!r}"
