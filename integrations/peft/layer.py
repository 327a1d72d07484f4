r"""``StiefelLayer``: a PEFT tuner layer holding one learned orthogonal Q per adapter.

Note [One layer class for every base layer]
The adapter never touches W: it rotates the features that enter the base
layer (``side="input"``: f(Q x) = (W Q) ⋆ x + b) or leave it
(``side="output"``: Q (f(x) − b) + b = (Q W) ⋆ x + b), Note [Rotating the
features of a module linear in them] in `stiefel.parametrizations.finetuning`.
What differs between ``nn.Linear``, ``nn.Conv1d/2d`` and transformers'
``Conv1D`` is only where the features sit: the last axis of x for the linear
layers, axis 1 for convolutions; and, for merging, which axis of the weight
they index (W is (out, in, …), Conv1D stores Wᵀ). One class with that
geometry serves them all.

Note [Several adapters, in PEFT's order]
Merging adapters a₁, …, a_k one after another gives W Q₁ ⋯ Q_k (input side)
and Q_k ⋯ Q₁ W (output side). The forward matches it: the input is rotated
by Q_k first (x ↦ Q₁(⋯(Q_k x))), the output by Q₁ first.

Note [Merging in the order of the forward]
PEFT merges ``merge_adapter(names)`` one adapter after another, in the order
given. For additive adapters (LoRA) the order does not matter; for rotations
it does on each side: W·Q_b·Q_a ≠ W·Q_a·Q_b. The forward of active adapters a, b computes
W·Q_a·Q_b, so a merge that would write another product (``names`` in
another order, or added after merged adapters in another order) is refused
before W is touched rather than making the merged model differ silently
from the unmerged one; adapters that are not active may be merged anywhere.

Each adapter's Q is a `Rotation`, which keeps its precision through a cast of the
whole model (Note [Q keeps its precision] in `stiefel.parametrizations.adapter`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from ...parametrizations import Rotation
from ...parametrizations.finetuning import (
    bias_view,
    check_blocks,
    feature_axis,
    q_dtype,
    spatial_dims,
    stored_transposed,
)

SIDES = ("input", "output")
ALLOWED_LAYERS = "nn.Linear, nn.Conv1d, nn.Conv2d (groups=1), transformers' Conv1D"


@dataclass(frozen=True)
class Geometry:
    """Where a base layer's features sit (Note [One layer class for every base layer])."""

    in_features: int
    out_features: int
    stored_transposed: bool  # weight stored (in, out): transformers' Conv1D
    spatial: int = 0  # spatial dims of a convolution (Conv1d: 1, Conv2d: 2), 0: features last

    def features(self, side: str) -> int:
        return self.in_features if side == "input" else self.out_features


def geometry(base: nn.Module, where: str) -> Geometry:
    """The geometry of a base layer, or a ValueError naming the module and what is allowed."""
    if isinstance(base, nn.Linear):
        return Geometry(base.in_features, base.out_features, False)
    if stored_transposed(base):
        rows, cols = base.weight.shape
        return Geometry(rows, cols, True)
    if isinstance(base, (nn.Conv1d, nn.Conv2d)):
        if base.groups != 1:
            raise ValueError(
                f"target_modules: {where} is a {type(base).__name__} with groups={base.groups}; "
                f"W·Q mixes every channel; allowed: {ALLOWED_LAYERS}"
            )
        return Geometry(base.in_channels, base.out_channels, False, spatial_dims(base))
    raise ValueError(
        f"target_modules: {where} is a {type(base).__module__}.{type(base).__name__}, which "
        f"the 'stiefel' method cannot serve; allowed: {ALLOWED_LAYERS}"
    )


def check_features(features: int, config: Any, where: str) -> None:
    """blocks must divide the features, butterfly must fit the blocks (ValueError otherwise)."""
    check_blocks(features, config.blocks, config.butterfly, config.side, where)


def build_rotation(features: int, config: Any, weight: torch.Tensor) -> Rotation:
    """The learned Q of one adapter (the one place this package's maps are built).

    Q is computed in float32, or in W's dtype when that is float64 or complex.
    """
    dtype = q_dtype(weight.dtype)
    device = weight.device if weight.device.type != "meta" else None
    rot = Rotation(
        features,
        config.method,
        config.blocks,
        config.butterfly,
        dtype,
        device,
        config.options,
        free=True,  # Note [Only the free values of a skew block are stored]
    )
    if not config.init_weights:
        with torch.no_grad():  # a random orthogonal start near I: any original is a valid Q
            for p in rot.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return rot


def check_merge_order(active: list[str], merged: list[str], names: list[str]) -> None:
    r"""Refuse a merge in another order than the forward's, for the adapters of one side.

    Note [Merging in the order of the forward].

    Args:
        active: the active adapters, in the order the forward applies them.
        merged: the adapters already merged into W, in their order.
        names: the adapters to merge now, in the order asked for.

    Raises:
        ValueError: the active adapters among ``merged + names`` are not in the
            active order; the message names both orders.
    """
    wanted = [a for a in merged + names if a in active]
    expected = [a for a in active if a in wanted]
    if wanted != expected:
        after = f" (after the merged {merged!r})" if merged else ""
        raise ValueError(
            f"adapter_names={names!r}{after} would write the product in the order {wanted!r}, "
            f"but the forward applies the active adapters in the order {expected!r}, and the "
            f"products do not commute; allowed: the names in the active order {expected!r}, or "
            "set_adapter() with the order wanted first"
        )


class StiefelLayer(nn.Module, BaseTunerLayer):
    """A base layer (Linear, Conv1d/2d, Conv1D) with one learned orthogonal Q per adapter.

    ``stiefel_R[name]`` is the adapter's `stiefel.parametrizations.Rotation`;
    ``stiefel_side[name]`` its side. See Note [One layer class for every base
    layer] and Note [Several adapters, in PEFT's order].
    """

    adapter_layer_names = ("stiefel_R",)
    other_param_names = ("stiefel_side",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, **kwargs: Any):
        super().__init__()
        self.base_layer = base_layer
        self.stiefel_R = nn.ModuleDict()
        self.stiefel_side: dict[str, str] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.kwargs = kwargs
        self.geometry = geometry(self.get_base_layer(), type(base_layer).__name__)
        self.in_features = self.geometry.in_features
        self.out_features = self.geometry.out_features
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)

    def update_layer(self, adapter_name: str, config: Any) -> None:
        """Add (or replace) the adapter ``adapter_name`` with Q = I (or a random start)."""
        features = self.geometry.features(config.side)
        check_features(features, config, type(self.get_base_layer()).__name__)
        self.stiefel_R[adapter_name] = build_rotation(features, config, self._weight())
        self.stiefel_side[adapter_name] = config.side
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _weight(self) -> torch.Tensor:
        return self.get_base_layer().weight

    def _move_adapter_to_device_of_base_layer(
        self, adapter_name: str, device: torch.device | None = None
    ) -> None:
        # Q keeps its own dtype (float32 at least): only the device follows the base layer.
        target = device if device is not None else self._weight().device
        if adapter_name in self.stiefel_R and target.type != "meta":
            self.stiefel_R[adapter_name].to(target)

    # ------------------------------------------------------------------ forward
    def _active(self) -> list[str]:
        return [a for a in self.active_adapters if a in self.stiefel_R]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        active = self._active()
        axis = feature_axis(self.geometry.spatial, x)
        for a in reversed(active):  # Note [Several adapters, in PEFT's order]
            if self.stiefel_side[a] == "input":
                x = self.stiefel_R[a].along(x, axis)
        y = self.base_layer(x, *args, **kwargs)
        outputs = [a for a in active if self.stiefel_side[a] == "output"]
        if outputs:
            b = self.get_base_layer().bias
            b = bias_view(b, y, axis) if isinstance(b, torch.Tensor) else None
            z = y if b is None else y - b
            for a in outputs:
                z = self.stiefel_R[a].along(z, axis)
            y = z if b is None else z + b
        return y

    # ------------------------------------------------------------------ merging
    def _product(self, w: torch.Tensor, adapter: str, inverse: bool) -> torch.Tensor:
        """W·Q or Q·W (inverse: W·Qᵀ or Qᵀ·W), W as stored, in Q's dtype (complex for complex W)."""
        rot = self.stiefel_R[adapter]
        q = rot.matrix()
        q = q.mT.conj() if inverse else q
        # Q's dtype, or complex for a complex W and a real Q (a model cast to complex)
        dtype = torch.promote_types(q.dtype, w.dtype)
        q, canon = q.to(dtype), w.to(dtype)
        canon = canon.mT if self.geometry.stored_transposed else canon  # (out, in, …)
        if self.stiefel_side[adapter] == "input":
            new = torch.einsum("oi...,ij->oj...", canon, q)
        else:
            new = torch.einsum("po,oi...->pi...", q, canon)
        return new.mT if self.geometry.stored_transposed else new

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Write W·Q (or Q·W) of the given (default: active) adapters into the base weight.

        The adapters are merged in the order the forward applies them (Note
        [Merging in the order of the forward]); every product is computed before
        W is written, so a refused merge leaves W as it was.

        Raises:
            ValueError: ``adapter_names`` in another order than the active
                adapters (naming both orders), or a non-finite product with
                ``safe_merge``.
        """
        adapter_names = check_adapters_to_merge(self, adapter_names)
        names = self.check_merge(adapter_names)
        w = self._weight()
        with torch.no_grad():
            new = w
            for a in names:
                new = self._product(new, a, inverse=False)
                if safe_merge and not torch.isfinite(new).all():
                    raise ValueError(
                        f"NaNs detected in the merged weights; the adapter {a} seems to be broken"
                    )
            if names:
                w.copy_(new.to(w.dtype))  # in place: the base Parameter object is kept
        self.merged_adapters.extend(names)

    def check_merge(self, adapter_names: list[str] | None) -> list[str]:
        """The adapters of this layer a merge of ``adapter_names`` writes, in order (no change).

        Raises:
            ValueError: an order other than the forward's, on either side (Note
                [Merging in the order of the forward]).
        """
        given = self.active_adapters if adapter_names is None else adapter_names
        names = [a for a in given if a in self.stiefel_R and a not in self.merged_adapters]
        for side in SIDES:
            check_merge_order(
                [a for a in self.active_adapters if self.stiefel_side.get(a) == side],
                [a for a in self.merged_adapters if self.stiefel_side.get(a) == side],
                [a for a in names if self.stiefel_side[a] == side],
            )
        return names

    def unmerge(self) -> None:
        """Undo `merge` (W·Q·Qᵀ = W, to rounding in W's dtype)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        w = self._weight()
        while self.merged_adapters:
            a = self.merged_adapters.pop()
            if a in self.stiefel_R:
                with torch.no_grad():
                    w.copy_(self._product(w, a, inverse=True).to(w.dtype))

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The dense Q of an adapter (features × features, for inspection)."""
        return self.stiefel_R[adapter_name].matrix()

    def __repr__(self) -> str:
        return "stiefel." + super().__repr__()
