r"""Orthogonal fine-tuning: ``rotate``, ``merge`` and ``rotation``.

``rotate(module)`` adds a learned orthogonal Q (the identity at the start) to a
module with a frozen weight W and makes it compute as if its weight were W·Q
(``side="input"``) or Q·W (``side="output"``), without forming that product:
the features are rotated through Q's operator form and the module's own
forward runs unchanged (HRA, OFT and BOFT are the special cases of a product
of reflections, Cayley blocks and butterflies).

Note [Rotating the features of a module linear in them]
If a module computes y = f(x) with f linear in the input features (for every
other argument fixed): f(x) = W ⋆ x + b with ⋆ a contraction over the input
features (a matrix product for ``nn.Linear``, a convolution over channels for
``nn.Conv1d/2d``, a dequantize-then-matmul for a quantized layer), then
f(Q x) = W ⋆ (Q x) + b = (W Q) ⋆ x + b: rotating the input features is the
module with the weight W·Q (Q contracted with W's input-feature axis, dim 1).
On the output side, (Q W) ⋆ x + b = Q (f(x) − b) + b: the bias is *not*
rotated. "As if its weight were Q·W" means exactly this: W is replaced by
Q·W and every other tensor of the module, the bias included, is kept; it is
also what `merge` writes.

Q itself, its factors and their start at the identity, is a `Rotation`
(`stiefel.parametrizations.adapter`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

from .._core import checks as _checks
from .adapter import Rotation, q_dtype
from .factory import resolve
from .holders import holder_names, holders

__all__ = ["rotate", "merge", "rotation", "check_blocks"]

SIDES = ("input", "output")
ATTRIBUTE = "rotation"


def spatial_dims(module: nn.Module) -> int:
    """The spatial dimensions of a convolution (Conv2d: 2), 0 for a layer with features last."""
    return len(module.kernel_size) if isinstance(module, nn.modules.conv._ConvNd) else 0


def feature_axis(spatial: int, x: torch.Tensor) -> int:
    """The feature axis of a layer's input or output x: −1 with features last (``spatial`` 0),
    else a convolution's channels: 1 in a batch, 0 in an unbatched input (torch takes both)."""
    if spatial == 0:
        return -1
    return 0 if x.dim() == spatial + 1 else 1


def bias_view(b: torch.Tensor, y: torch.Tensor, axis: int) -> torch.Tensor:
    """A bias of the features at ``axis`` (`feature_axis`), shaped to broadcast against y."""
    return b.view((-1,) + (1,) * (y.dim() - 1 - axis) if axis != -1 else (-1,))


def stored_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight as (in, out): transformers' ``Conv1D`` (GPT-2).

    Looked up among the modules already imported (a ``Conv1D`` exists only once
    transformers is), so that no call imports transformers.
    """
    hf = sys.modules.get("transformers.pytorch_utils")
    return hf is not None and isinstance(module, getattr(hf, "Conv1D", ()))


def _check_module(module: object) -> torch.Tensor:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(getattr(module, ATTRIBUTE, None), Rotation):
        raise ValueError(
            f"{type(module).__name__} is already rotated; merge(module) first to rotate it again"
        )
    if hasattr(module, ATTRIBUTE):
        raise ValueError(
            f"{type(module).__name__} already has an attribute {ATTRIBUTE!r}; "
            "rotate stores Q there and needs it free"
        )
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise ValueError(
            f"rotate needs a module with a tensor `weight` (out_features, in_features, …); "
            f"{type(module).__name__} has {type(w).__name__ if w is not None else 'none'}"
        )
    if w.dim() < 2:
        raise ValueError(f"module.weight must have >= 2 dimensions, got shape {tuple(w.shape)}")
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        raise TypeError(
            f"{type(module).__name__} is not supported (its input is indices, not features: "
            "Q would rotate the indices); allowed: nn.Linear, nn.Conv1d/2d/3d and modules "
            "with a weight (out, in, …) applied to features"
        )
    if isinstance(module, nn.modules.conv._ConvNd):
        if module.transposed:
            raise TypeError(
                f"{type(module).__name__} is not supported (its weight is (in, out, …)); "
                "allowed: nn.Linear, nn.Conv1d/2d/3d and modules with a weight (out, in, …)"
            )
        if module.groups != 1:
            raise ValueError(
                f"groups={module.groups} is not supported: W·Q mixes every input channel; "
                "allowed: groups=1"
            )
    return w


def rotate(
    module: nn.Module,
    method: str = "cwy",
    side: str = "input",
    blocks: int = 1,
    butterfly: int = 0,
    **options: Any,
) -> nn.Module:
    r"""Make a frozen module compute as if its weight were W·Q (or Q·W), Q orthogonal and learned.

    Q starts at the identity. With ``side="input"`` Q ∈ O(in_features) rotates
    the input features (channels for convolutions) before the module's own
    forward, which then computes f(Qx) = (W Q) ⋆ x + b for any module linear in
    its input features (Note [Rotating the features of a module linear in
    them]); with ``side="output"`` Q ∈ O(out_features) rotates the output
    without the bias: Q(f(x) − b) + b = (Q W) ⋆ x + b. W is frozen
    (``requires_grad=False``) and never modified or cast; Q is computed in
    float32 (float64, complex64 or complex128 when W has that dtype) and the
    rotated features are cast back to the input dtype.

    Args:
        module: a module with a ``weight`` of shape (out, in, …): ``nn.Linear``,
            ``nn.Conv1d/2d/3d`` (groups=1), or a custom (e.g. quantized) layer
            whose forward is linear in its input features (features last).
        method: a name of `stiefel.parametrizations.available`; Q's blocks
            are that map (``"riemannian"``: Q itself is a
            ``geoopt.ManifoldParameter`` for ``stiefel.optimizers``).
        side: ``"input"`` (W·Q) or ``"output"`` (Q·W).
        blocks: b ≥ 1 dividing the features: Q block-diagonal with b blocks (OFT).
        butterfly: k ≥ 0: Q is a product of k butterfly-permuted
            block-diagonal factors (BOFT); needs an even block size s and b
            divisible by 2^(k−1). 0 (default) means one plain factor.
        **options: the method's options (e.g. ``reflections=L``).

    Returns:
        The module, rotated in place (Q in ``module.rotation``).

    Raises:
        TypeError: not a module, a transposed convolution, unknown options.
        ValueError: no weight, bad ``side``/``blocks``/``butterfly``, a method
            that cannot serve the blocks, a module already rotated, a weight tied
            to another module that still trains (Note [Rotating a tied weight]).

    Example:
        ```python
        import torch
        import stiefel

        layer = torch.nn.Linear(64, 32)
        x = torch.randn(5, 64)
        stiefel.rotate(layer, method="cwy", reflections=4)
        y = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.allclose(layer(x), y, atol=1e-6)  # Q = I at the start
        q = stiefel.rotation(layer)
        assert q.shape == (64, 64)
        ```
    """
    w = _check_module(module)
    if not isinstance(side, str) or side not in SIDES:
        raise ValueError(f"side={side!r} is not supported; allowed: {', '.join(SIDES)}")
    resolve(method)  # unknown names raise, listing the registry
    transposed = stored_transposed(module)  # (in, out): the features are W's rows
    features = int(w.shape[int(side == "input") ^ int(transposed)])
    blocks, butterfly = check_blocks(features, blocks, butterfly, side)
    # Note [Rotating a tied weight]
    # W is frozen by setting requires_grad=False on the Parameter; when another module
    # holds the same Parameter (an output layer tied to the embedding) that would stop
    # its training too, silently, and `merge` (which restores the flag) refuses a tied
    # weight. So a tied W that still trains is refused, naming the other holders; one
    # already frozen (a whole base model frozen first, as PEFT does) changes nothing there.
    tied = _tied_to(module, w) if w.requires_grad else []
    if tied:
        raise ValueError(
            f"rotate would freeze {type(module).__name__}.weight, which is tied: the same "
            f"Parameter is {holder_names(tied)}, and requires_grad=False would stop its "
            "training there too; freeze the shared weight first (it then stays frozen in both), or "
            "untie it (module.weight = nn.Parameter(module.weight.detach().clone())) and rotate"
        )
    dtype = q_dtype(w.dtype)
    rot = Rotation(features, method, blocks, butterfly, dtype, w.device, dict(options))
    # everything validated and built: now modify the module
    spatial = spatial_dims(module)
    rot._frozen = w.requires_grad  # restored by merge
    rot._side, rot._transposed = side, transposed
    if w.requires_grad:
        w.requires_grad_(False)
    setattr(module, ATTRIBUTE, rot)
    # the hooks are module-level functions bound by partial: a rotated module pickles
    # (torch.save(model)), which local closures made impossible
    if side == "input":
        hook = functools.partial(_rotate_input, spatial=spatial)
        rot._handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    else:
        rot._handle = module.register_forward_hook(
            functools.partial(_rotate_output, spatial=spatial)
        )
    return module


def _rotate_input(mod: nn.Module, args: tuple, kwargs: dict, *, spatial: int):
    """The forward pre-hook of ``side="input"``: x ↦ Qx on the features of the first input."""
    if not args:
        raise TypeError(
            f"a rotated {type(mod).__name__} rotates its first positional argument; "
            f"got none (keyword arguments: {', '.join(kwargs) or 'none'}): pass the "
            "input positionally"
        )
    x = args[0]
    return (mod.rotation.along(x, feature_axis(spatial, x)), *args[1:]), kwargs


def _rotate_output(mod: nn.Module, args: tuple, y: torch.Tensor, *, spatial: int):
    """The forward hook of ``side="output"``: Q on the output's features, the bias kept."""
    axis = feature_axis(spatial, y)
    b = getattr(mod, "bias", None)
    if not isinstance(b, torch.Tensor):
        return mod.rotation.along(y, axis)
    b = bias_view(b, y, axis)
    return mod.rotation.along(y - b, axis) + b


def check_blocks(
    features: int, blocks: object, butterfly: object, side: str, where: str = ""
) -> tuple[int, int]:
    """``blocks`` divides the features and ``butterfly`` fits the blocks (ValueError otherwise).

    Args:
        features: the size Q acts on.
        blocks: the number of diagonal blocks (an int >= 1).
        butterfly: the number of butterfly factors (an int >= 0).
        side: ``"input"`` or ``"output"``, for the message.
        where: the layer, for the message (e.g. a PEFT target's name).

    Returns:
        ``(blocks, butterfly)`` as Python ints (numpy's integers are taken).
    """
    blocks = _checks.positive_int("blocks", blocks)
    butterfly = _checks.int_at_least("butterfly", butterfly, 0)
    of = f" of {where}" if where else ""
    if features % blocks:
        divisors = [d for d in range(1, features + 1) if features % d == 0]
        raise ValueError(
            f"blocks={blocks} does not divide the {side} features ({features}){of}; "
            f"allowed: {', '.join(map(str, divisors))}"
        )
    size = features // blocks
    if butterfly > 1 and (size % 2 or blocks % 2 ** (butterfly - 1)):
        raise ValueError(
            f"butterfly={butterfly} with blocks={blocks} (block size {size}) on {features} "
            f"{side} features{of}: a butterfly needs an even block size and blocks divisible "
            f"by 2^(butterfly-1) = {2 ** (butterfly - 1)}; allowed: butterfly <= "
            f"{_max_butterfly(blocks, size)} for these blocks"
        )
    return blocks, butterfly


def _max_butterfly(blocks: int, size: int) -> int:
    if size % 2:
        return 1
    k = 1
    while blocks % 2**k == 0:
        k += 1
    return k


def _rotation_of(module: object) -> Rotation:
    rot = getattr(module, ATTRIBUTE, None)
    if not isinstance(rot, Rotation):
        raise ValueError(
            f"{type(module).__name__} is not rotated (no Rotation in module.{ATTRIBUTE}); "
            "allowed: a module returned by stiefel.rotate (a PEFT 'stiefel' adapter's Q is "
            "layer.stiefel_R[adapter_name].matrix(), or layer.get_delta_weight(adapter_name))"
        )
    return rot


def rotation(module: nn.Module) -> torch.Tensor:
    """The dense Q of a rotated module (features × features, in Q's dtype, differentiable).

    Raises:
        ValueError: the module is not rotated.
    """
    return _rotation_of(module).matrix()


def _tied_to(module: nn.Module, w: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """The holders of ``w`` other than ``module`` (a tied weight), as `holders` finds them.

    A submodule cannot see the model it is tied in: the garbage collector's
    referrers of ``w`` can (Note [Finding a Parameter's holders]); `rotate` and
    `merge` run once, so the scan is cheap.
    """
    return [(m, key) for m, key in holders(w) if m is not module]


def merge(module: nn.Module) -> nn.Module:
    r"""Write W·Q (``side="input"``) or Q·W (``side="output"``) into the weight; remove Q.

    The bias is kept (Note [Rotating the features of a module linear in
    them]); the product is computed in Q's dtype and stored in the weight's
    dtype, in place (the Parameter object is kept), and the weight's
    ``requires_grad`` is restored.

    Raises:
        ValueError: the module is not rotated, or its weight is tied (held by
            another module too, e.g. an output layer tied to the embedding):
            writing W·Q would change the other module silently.
        TypeError: the weight is not floating point (e.g. int8): dequantize first.
    """
    rot = _rotation_of(module)
    w = module.weight
    others = _tied_to(module, w)
    if others:
        raise ValueError(
            f"merge would write W·Q into a tied weight: {type(module).__name__}.weight is also "
            f"{holder_names(others)}, which would change silently; keep the "
            "rotation (it applies to this module only), or untie first "
            "(module.weight = nn.Parameter(module.weight.detach().clone())) and merge"
        )
    if not (w.is_floating_point() or w.is_complex()):
        raise TypeError(
            f"merge writes W·Q into module.weight, which has dtype {w.dtype}; allowed: a "
            "floating-point or complex weight (dequantize first, or keep the rotation)"
        )
    with torch.no_grad():
        q = rot.matrix()
        wq = w.to(q.dtype)
        if getattr(rot, "_transposed", False):  # Conv1D stores Wᵀ: (WQ)ᵀ = QᵀWᵀ, (QW)ᵀ = WᵀQᵀ
            new = q.mT @ wq if rot._side == "input" else wq @ q.mT
        elif rot._side == "input":
            new = torch.einsum("oj...,ji->oi...", wq, q)
        else:
            new = torch.einsum("oj,j...->o...", q, wq)
        w.copy_(new.to(w.dtype))
    rot._handle.remove()
    delattr(module, ATTRIBUTE)
    if rot._frozen:
        w.requires_grad_(True)
    return module
