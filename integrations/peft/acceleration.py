r"""Run a PEFT model's HRA, OFT and BOFT layers with this package's kernels.

``accelerate(model)`` swaps, in place, the ``forward`` of every supported PEFT
layer for the same map computed faster: same parameters, same ``state_dict``,
same outputs (to rounding). ``restore(model)`` undoes it. PEFT is imported
lazily (``pip install peft``); tested with PEFT 0.21.

Note [What each PEFT map is, and how it is computed here]
- HRA (``HRALinear``, without Gram–Schmidt): PEFT forms Q = H(u₁)⋯H(u_r) by r
  dense n×n updates, then W·Q (n³) on every forward. Q is exactly this
  package's CWY map of V = ``hra_u``, so F.linear(x, W·Q) = base(x Qᵀ) with
  x Qᵀ in the compact WY operator form, O(T·n·r), Q and W·Q never formed.
- OFT (``oft.Linear``): PEFT already rotates the inputs block by block; each
  block is R = I + 2A + 2A² + … + A^{t−1} (a truncated Cayley–Neumann series
  of the skew A, not orthogonal once ‖A‖ grows). By default the same series
  is computed (outputs match); ``exact_cayley=True`` uses the exact Cayley
  map (I + A)⁻¹(I − A), orthogonal to rounding at every size.
- BOFT (``boft.Linear``): PEFT stores each butterfly permutation as a dense
  n×n matrix and forms P·B·Pᵀ and x·R with dense products; here each factor
  is two index gathers and b small block products (Note [Butterfly factors
  as index gathers] in `stiefel.parametrizations.finetuning`).
Note [Caches outside inference mode]
Index tensors cached across calls (the strict upper triangle of OFT's skew
blocks, BOFT's permutations) are made under ``torch.inference_mode(False)``:
a tensor made in inference mode can never be saved for backward, so a cache
filled by one ``inference_mode`` forward would break every later training
forward.

Note [Half-precision adapters]
With ``autocast_adapter_dtype=False`` PEFT keeps float16/bfloat16 adapter
weights. The LU and triangular solves of the Cayley map and of CWY have no
half-precision CPU kernels, and their conditioning needs more than 8 bits of
mantissa anyway: the maps are computed in float32 and their result cast back
to the adapter's dtype, where PEFT's own arithmetic continues.

Layers in a state the fast path does not cover (adapters disabled or merged,
HRA with ``apply_GS``, OFT with ``coft``) run PEFT's own forward.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..._core import checks as _checks
from ...parametrizations import kernels
from ._support import require

__all__ = ["accelerate", "restore", "cayley_neumann"]

FLAG = "_stiefel_accelerated"


# --------------------------------------------------------------------------- kernels
def cayley_neumann(a: torch.Tensor, terms: int) -> torch.Tensor:
    r"""PEFT OFT's truncated Cayley–Neumann series of a skew A, batched (…, s, s).

    R = I + 2A + 2A² + … + 2A^{t−2} + A^{max(3, t−1)} for t = ``terms`` > 2
    (t = 2: I + 2A; t = 1: I), term for term PEFT's ``_cayley_batch``. It
    approximates the Cayley map (I − A)(I + A)⁻¹ = I + 2Σ_{j≥1}(−A)^j … only for
    small ‖A‖: ‖RᵀR − I‖ grows like ‖A‖^t.
    """
    r = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand(a.shape).clone()
    if terms > 1:
        r = r + 2 * a
    if terms > 2:
        power = a @ a
        r = r + 2 * power
        for _ in range(3, terms - 1):
            power = power @ a
            r = r + 2 * power
        r = r + power @ a
    return r


def _skew(vec: torch.Tensor, size: int) -> torch.Tensor:
    """A = X₊ − X₊ᵀ with PEFT's packed strict upper triangle ``vec`` (…, s(s−1)/2).

    Same as ``kernels.skew_from_raw`` of the scattered triangle, one op shorter.
    """
    rows, cols = _triu(size, vec.device)
    raw = vec.new_zeros(*vec.shape[:-1], size, size)
    raw[..., rows, cols] = vec
    return raw - raw.mT


_TRIU: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _triu(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (size, str(device))
    if key not in _TRIU:
        with torch.inference_mode(False):  # Note [Caches outside inference mode]
            rows, cols = torch.triu_indices(size, size, 1, device=device)
        _TRIU[key] = (rows, cols)
    return _TRIU[key]


def _blocks_apply(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x (…, b·s) times diag(R_1, …, R_b) (rows): b products of s×s blocks, no transpose."""
    b, s, _ = r.shape
    return torch.einsum("...bk,bkc->...bc", x.reshape(*x.shape[:-1], b, s), r).reshape(x.shape)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision adapters (Note [Half-precision adapters]), else their own."""
    return torch.promote_types(dtype, torch.float32)


def _cayley(a: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return kernels.cayley_map(a, eye)


# --------------------------------------------------------------------------- forwards
def _hra_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = [a for a in self.active_adapters if a in self.hra_u.keys()]
    if self.disable_adapters or self.merged or any(self.hra_apply_GS[a] for a in adapters):
        return type(self).forward(self, x, *args, **kwargs)
    previous = x.dtype
    if adapters:
        x = self._cast_input_dtype(x, self.hra_u[adapters[0]].dtype)
    # F.linear(x, W Q_1⋯Q_k) = base(x Q_kᵀ ⋯ Q_1ᵀ): the last adapter's Q acts first
    for a in reversed(adapters):
        u = self.hra_u[a]
        work = _work_dtype(u.dtype)  # Note [Half-precision adapters]
        x = kernels.cwy_linear(u.to(work), x.to(work)).to(u.dtype)
    return _base(self, x, previous, *args, **kwargs)


def _base(self, x: torch.Tensor, previous: torch.dtype, *args, **kwargs) -> torch.Tensor:
    w = self.get_base_layer().weight
    if w.is_floating_point() and x.dtype != w.dtype:
        x = x.to(w.dtype)
    return self.base_layer(x, *args, **kwargs).to(previous)


def _oft_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = [a for a in self.active_adapters if a in self.oft_R.keys()]
    if self.disable_adapters or self.merged or any(self.oft_R[a].coft for a in adapters):
        return type(self).forward(self, x, *args, **kwargs)
    previous = x.dtype
    exact = getattr(self, FLAG)["exact_cayley"]
    for a in adapters:
        rot = self.oft_R[a]
        x = self._cast_input_dtype(x, rot.weight.dtype)
        a_skew = _skew(rot.weight, rot.block_size)
        if exact or not rot.use_cayley_neumann:  # (I + A)⁻¹(I − A) = PEFT's (I − A)(I + A)⁻¹
            r = _cayley(a_skew.to(_work_dtype(a_skew.dtype))).to(a_skew.dtype)
        else:
            r = cayley_neumann(a_skew, rot.num_cayley_neumann_terms)
        blocks = rot.in_features // rot.block_size
        if rot.block_share:
            r = r.expand(blocks, -1, -1)
        dt = x.dtype
        x = _blocks_apply(x.to(rot.weight.dtype), r).to(dt)
    return self.base_layer(x.to(previous), *args, **kwargs).to(previous)


def _boft_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if self.disable_adapters or self.merged:
        return type(self).forward(self, x, *args, **kwargs)
    previous = x.dtype
    scale = None
    # PEFT: rotation = R_k ⋯ R_1 (later adapters on the left), x ↦ x·rotation
    for a in reversed([a for a in self.active_adapters if a in self.boft_R.keys()]):
        param = self.boft_R[a]
        n, d, h, _ = param.shape
        raw = param.view(n * d, h, h)
        skew = (0.5 * (raw - raw.mT)).to(_work_dtype(raw.dtype))
        blocks = _cayley(skew).to(raw.dtype).view(n, d, h, h)  # = (I − S)(I + S)⁻¹
        blocks = self.boft_dropout[a](blocks).to(x.dtype)
        perms = getattr(self, FLAG)["perms"]
        # x·M_{N−1}⋯M_0, M_i = P_i B_i P_iᵀ: x P_i = x[…, π_i⁻¹], (·)P_iᵀ = (·)[…, π_i]
        for i in reversed(range(n)):
            perm, inv = perms[i]
            if perm is not None:
                x = x[..., inv.to(x.device)]
            x = _blocks_apply(x, blocks[i])
            if perm is not None:
                x = x[..., perm.to(x.device)]
        s = self.boft_s[a]
        scale = s if scale is None else s * scale
    result = self.base_layer(x.to(previous), *args, **kwargs)
    if scale is not None:
        bias = self.base_layer.bias
        s = scale.squeeze(-1).to(previous)
        result = result * s if bias is None else (result - bias) * s + bias
    return result.to(previous)


def _perms(layer: nn.Module) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    with torch.inference_mode(False):  # Note [Caches outside inference mode]
        return _perms_of(layer)


def _perms_of(layer: nn.Module) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    out = []
    for p in layer.boft_P:
        perm = p.argmax(-1)
        if not bool((p.sum(-1) == 1).all() and (p.sum(-2) == 1).all()):
            raise ValueError("boft_P is not a stack of permutation matrices")
        if torch.equal(perm, torch.arange(len(perm), device=perm.device)):
            out.append((None, None))
        else:
            out.append((perm, torch.argsort(perm)))
    return out


# --------------------------------------------------------------------------- public API
def _kinds() -> dict[type, tuple[str, Callable]]:
    from peft.tuners.boft.layer import Linear as BOFTLinear
    from peft.tuners.hra.layer import HRALinear
    from peft.tuners.oft.layer import Linear as OFTLinear

    return {
        HRALinear: ("hra", _hra_forward),
        OFTLinear: ("oft", _oft_forward),
        BOFTLinear: ("boft", _boft_forward),
    }


def accelerate(model: nn.Module, *, exact_cayley: bool = False) -> nn.Module:
    r"""Swap in place the forward of a PEFT model's HRA, OFT and BOFT Linear layers.

    Parameters, buffers and ``state_dict`` are untouched; ``merge_and_unload``,
    ``torch.compile`` and saving work as before. See Note [What each PEFT map
    is, and how it is computed here].

    Args:
        model: a PEFT model (``peft.get_peft_model``) or any module holding PEFT layers.
        exact_cayley: OFT blocks with the exact Cayley map instead of PEFT's
            Cayley–Neumann series (outputs then differ from PEFT's, by the
            series' error; Q stays orthogonal). Off by default.

    Returns:
        The model (modified in place).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``exact_cayley`` not a bool.
        ImportError: PEFT missing, or a version outside ``MIN_VERSION <= v < 1.0``.

    Warns:
        UserWarning: no supported layer found (the PEFT layers found are listed).

    Example:
        ```python
        import torch
        from peft import HRAConfig, get_peft_model
        from stiefel.integrations.peft import accelerate

        base = torch.nn.Sequential(torch.nn.Linear(16, 16))
        model = get_peft_model(base, HRAConfig(r=4, target_modules=["0"]))
        x = torch.randn(3, 16)
        before = model(x)
        accelerate(model)
        assert torch.allclose(model(x), before, atol=1e-5)
        ```
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _checks.flag("exact_cayley", exact_cayley)
    require()
    from peft.tuners.tuners_utils import BaseTunerLayer

    kinds = _kinds()
    plan, others = [], []
    for name, layer in model.named_modules():
        kind = kinds.get(type(layer))
        if kind is not None:
            state = {"kind": kind[0], "exact_cayley": exact_cayley}
            if kind[0] == "boft":
                state["perms"] = _perms(layer)
            plan.append((layer, kind[1], state))
        elif isinstance(layer, BaseTunerLayer):
            others.append(f"{name or '<root>'} ({type(layer).__module__}.{type(layer).__name__})")
    if not plan:
        found = ", ".join(others) if others else "no PEFT layer at all"
        warnings.warn(
            f"accelerate found no supported layer (allowed: HRA, OFT and BOFT Linear layers); "
            f"found: {found}",
            stacklevel=2,
        )
    for layer, forward, state in plan:  # all checks done: now swap
        layer.__dict__[FLAG] = state
        # a partial of a module-level function pickles (a bound method is pickled by a
        # name the layer does not have)
        layer.forward = functools.partial(forward, layer)
    tuner = _tuner(model)
    if tuner is not None:  # layers that add_adapter / load_adapter create later
        tuner.inject_adapter = _InjectThenAccelerate(tuner, exact_cayley)
    return model


def _tuner(model: nn.Module) -> nn.Module | None:
    from peft.tuners.tuners_utils import BaseTuner

    for candidate in (model, getattr(model, "base_model", None)):
        if isinstance(candidate, BaseTuner):
            return candidate
    return None


class _InjectThenAccelerate:
    """``tuner.inject_adapter`` that accelerates the layers it creates (picklable)."""

    def __init__(self, tuner: nn.Module, exact_cayley: bool):
        self.tuner, self.exact_cayley = tuner, exact_cayley

    def __call__(self, *args, **kwargs):
        out = type(self.tuner).inject_adapter(self.tuner, *args, **kwargs)
        with warnings.catch_warnings():  # an adapter of another kind: nothing to accelerate
            warnings.simplefilter("ignore")
            accelerate(self.tuner.model, exact_cayley=self.exact_cayley)
        return out


def restore(model: nn.Module) -> nn.Module:
    """Undo `accelerate`: every layer runs PEFT's own forward again."""
    for layer in model.modules():
        if FLAG in layer.__dict__:
            del layer.__dict__[FLAG]
            layer.__dict__.pop("forward", None)
        if isinstance(layer.__dict__.get("inject_adapter"), _InjectThenAccelerate):
            del layer.__dict__["inject_adapter"]
    return model
