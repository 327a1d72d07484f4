r"""``StiefelModel``: the PEFT tuner of the ``"stiefel"`` method.

Note [Checks before any change]
PEFT replaces the targeted layers one by one. Everything that can fail for
one layer (its type, blocks dividing its features, the butterfly fitting the
blocks, the map's options fitting a block, e.g. ``reflections`` at most its
size: a Q of each size is built on the meta device, which checks them and
allocates nothing) is checked for every target in ``_prepare_model``, which PEFT calls
before the first replacement; loading checks the checkpoint's shapes against
the adapter it is loaded into before a tensor is copied, and on a mismatch
removes the adapter just added, so a failed load leaves the model as it was.

Note [The map is saved with its tensors]
The exp, cayley and scaled_cayley maps of blocks of the same size have
originals of the same shape (and exp and cayley the same base buffer), so
an adapter folder whose ``adapter_config.json`` names another of them would
load without a shape error and compute another Q. Saving therefore adds,
per adapted layer, a tensor ``….stiefel_R.map``: the UTF-8 bytes of
``{"method": …, "side": …}`` (uint8, in the safetensors file beside the
adapter's tensors, whatever the file format). Loading compares it with the
config and refuses a mismatch before any tensor is copied; a folder without
it (saved before it existed) loads as before.

Note [Older folders: full skew blocks]
Folders saved before Note [Only the free values of a skew block are stored]
hold each exp/cayley/scaled_cayley block as a full (s, s) original; loading
keeps their strict upper triangle (the values the map read), which gives
the same Q exactly.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import torch
from peft.tuners.tuners_utils import (  # the expansion of "all-linear" PEFT applies
    BaseTuner,
    BaseTunerLayer,
    _maybe_include_all_linear_layers,
)
from peft.utils import TRANSFORMERS_MODELS_TO_OFT_TARGET_MODULES_MAPPING
from torch import nn

from ...parametrizations import Rotation
from .layer import StiefelLayer, check_features, geometry, q_dtype

ATTRIBUTE = "stiefel_R"
TAG = "map"  # Note [The map is saved with its tensors]


class StiefelModel(BaseTuner):
    """Injects `StiefelLayer`s into a model for a `StiefelConfig` (``get_peft_model`` does it)."""

    prefix: str = "stiefel_"
    tuner_layer_cls = StiefelLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_OFT_TARGET_MODULES_MAPPING

    def _pre_injection_hook(self, model: nn.Module, config: Any, adapter_name: str) -> None:
        # what a failed load restores (Note [Checks before any change])
        self._stiefel_requires_grad = [(p, p.requires_grad) for p in model.parameters()]

    def _prepare_model(self, peft_config: Any, model: nn.Module) -> None:
        """Check every target before PEFT replaces the first (Note [Checks before any change])."""
        # "all-linear" is expanded by PEFT after this hook: checked as the layers it names
        peft_config = _maybe_include_all_linear_layers(copy.copy(peft_config), model)
        tuners = [k + "." for k, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
        built: set[int] = set()
        for key, module in model.named_modules():
            if not key or any(key.startswith(t) for t in tuners):
                continue  # inside an adapter layer: PEFT skips these too
            if not self._check_target_module_exists(peft_config, key):
                continue
            if isinstance(module, BaseTunerLayer) and not isinstance(module, StiefelLayer):
                continue  # another method's layer: PEFT's own rules apply
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            shape = geometry(base, key)
            features = shape.features(peft_config.side)
            check_features(features, peft_config, key)
            if features not in built:
                built.add(features)
                _check_options(features, peft_config, base.weight.dtype, key)

    def _create_and_replace(
        self,
        config: Any,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        if isinstance(target, StiefelLayer):
            target.update_layer(adapter_name, config)
            return
        new_module = StiefelLayer(target, adapter_name, config)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)  # an added adapter is not trainable by default
        self._replace_module(parent, target_name, new_module, target)

    def merge_adapter(
        self, adapter_names: list[str] | None = None, safe_merge: bool = False
    ) -> None:
        """PEFT's merge, after every layer has checked the order (nothing written if one refuses).

        Note [Merging in the order of the forward] in `stiefel.integrations.peft.layer`.
        """
        for module in self.model.modules():
            if isinstance(module, StiefelLayer):
                module.check_merge(adapter_names)
        super().merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge)

    # ------------------------------------------------------------------ saving and loading
    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # stiefel_R.<adapter>.originals.0 → stiefel_R.originals.0 (the Rotation's parameters
        # sit one level deeper than PEFT's default rule expects)
        return re.sub(rf"\.{ATTRIBUTE}\.{re.escape(adapter_name)}\.", f".{ATTRIBUTE}.", key)

    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: Any,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        """PEFT's selection of the adapter's tensors, plus its map tags (Note [The map is ...])."""
        out = super()._get_adapter_state_dict(
            model=model,
            config=config,
            adapter_name=adapter_name,
            state_dict=state_dict,
            unwanted_adapter_names=unwanted_adapter_names,
        )
        first = re.compile(rf"^(.*)\.{ATTRIBUTE}\.{re.escape(adapter_name)}\.originals\.0$")
        for key in list(out):
            match = first.match(key)
            if match:
                out[f"{match.group(1)}.{ATTRIBUTE}.{adapter_name}.{TAG}"] = _tag(config)
        return out

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls,
        model: nn.Module,
        config: Any,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        tags = {k: v for k, v in state_dict.items() if k.endswith(f".{ATTRIBUTE}.{TAG}")}
        state_dict = {k: v for k, v in state_dict.items() if k not in tags}
        mismatch = _tag_mismatch(tags, config)
        if mismatch:
            _remove_adapter(model, adapter_name)
            raise ValueError(
                f"the adapter folder for adapter {adapter_name!r} was saved with {mismatch}, but "
                f"its config names method={config.method!r}, side={config.side!r}: the same "
                "tensors would give another Q; allowed: the config the folder was saved with (its "
                "adapter_config.json unchanged)"
            )
        remapped = super()._remap_adapter_state_dict_for_load(
            model=model, config=config, adapter_name=adapter_name, state_dict=state_dict
        )
        own = model.state_dict()
        remapped = _free_values(model, own, remapped)
        wanted = {k for k in own if f".{ATTRIBUTE}.{adapter_name}." in k}
        found = {k.removeprefix("base_model.model.") for k in remapped}
        found |= set(remapped)
        problems = [
            f"{k}: checkpoint {tuple(v.shape)}, model {tuple(own[k].shape)}"
            for k, v in remapped.items()
            if k in own and k in wanted and own[k].shape != v.shape
        ]
        missing = sorted(k for k in wanted if k not in found)
        if problems or missing:
            _remove_adapter(model, adapter_name)
            detail = "; ".join(problems + [f"{k}: not in the checkpoint" for k in missing[:5]])
            raise ValueError(
                f"the adapter folder does not fit this model for adapter {adapter_name!r} "
                f"(method={config.method!r}, blocks={config.blocks}, butterfly="
                f"{config.butterfly}, side={config.side!r}, options={config.options}): {detail}; "
                "allowed: a folder saved from a model with the same targeted layer sizes"
            )
        return remapped


def _check_options(features: int, config: Any, dtype: torch.dtype, where: str) -> None:
    """The map's options fit a Q of ``features`` (Note [Checks before any change]).

    Raises:
        ValueError, TypeError: the map's own error, with the layer and its features named.
    """
    try:
        Rotation(
            features,
            config.method,
            config.blocks,
            config.butterfly,
            q_dtype(dtype),
            torch.device("meta"),
            config.options,
            free=True,
        )
    except (ValueError, TypeError) as err:
        cls = ValueError if isinstance(err, ValueError) else TypeError
        raise cls(
            f"{err} (target_modules: {where}, {features} {config.side} features, "
            f"blocks={config.blocks}, options={config.options})"
        ) from err


def _tag(config: Any) -> torch.Tensor:
    """The saved map tag of an adapter (Note [The map is saved with its tensors])."""
    text = json.dumps({"method": config.method, "side": config.side}, sort_keys=True)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def _tag_mismatch(tags: dict[str, torch.Tensor], config: Any) -> str | None:
    """What the saved tags say when it differs from ``config`` (None when they agree)."""
    for value in tags.values():
        try:
            saved = json.loads(bytes(value.to(torch.uint8).tolist()).decode("utf-8"))
            method, side = saved["method"], saved["side"]
        except (ValueError, KeyError, TypeError):
            return "an unreadable map tag (not the UTF-8 JSON of the method and side)"
        if (method, side) != (config.method, config.side):
            return f"method={method!r}, side={side!r}"
    return None


def _free_values(
    model: nn.Module, own: dict[str, torch.Tensor], remapped: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Full (s, s) originals of an older folder as the free values the model stores.

    Note [Older folders: full skew blocks].
    """
    rotations = {
        f"{name}.": module
        for name, module in model.named_modules()
        if isinstance(module, Rotation) and module.free
    }
    out = dict(remapped)
    for key, value in remapped.items():
        target = own.get(key)
        if target is None or value.dim() != target.dim() + 1:
            continue
        prefix = next((p for p in rotations if key.startswith(p + "originals.")), None)
        if prefix is not None and value.shape[-1] == value.shape[-2]:
            out[key] = rotations[prefix].free_values(value)
    return out


def _remove_adapter(model: nn.Module, adapter_name: str) -> None:
    """Take out the adapter a failed load added (Note [Checks before any change])."""
    tuner = getattr(model, "base_model", model)
    if not isinstance(tuner, StiefelModel):
        return
    if len(tuner.peft_config) > 1:
        model.delete_adapter(adapter_name)
        return
    tuner.unload()
    for p, flag in getattr(tuner, "_stiefel_requires_grad", []):
        p.requires_grad_(flag)
