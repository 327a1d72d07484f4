r"""``StiefelModel``: the PEFT tuner of the ``"stiefel"`` method.

Note [Checks before any change]
PEFT replaces the targeted layers one by one. Everything that can fail for
one layer (its type, blocks dividing its features, the butterfly fitting the
blocks) is checked for every target in ``_prepare_model``, which PEFT calls
before the first replacement; loading checks the checkpoint's shapes against
the adapter it is loaded into before a tensor is copied, and on a mismatch
removes the adapter just added, so a failed load leaves the model as it was.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_OFT_TARGET_MODULES_MAPPING
from torch import nn

from .layer import StiefelLayer, check_features, geometry

ATTRIBUTE = "stiefel_R"


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
        tuners = [k + "." for k, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
        for key, module in model.named_modules():
            if not key or any(key.startswith(t) for t in tuners):
                continue  # inside an adapter layer: PEFT skips these too
            if not self._check_target_module_exists(peft_config, key):
                continue
            if isinstance(module, BaseTunerLayer) and not isinstance(module, StiefelLayer):
                continue  # another method's layer: PEFT's own rules apply
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            shape = geometry(base, key)
            check_features(shape.features(peft_config.side), peft_config, key)

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

    # ------------------------------------------------------------------ saving and loading
    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # stiefel_R.<adapter>.originals.0 → stiefel_R.originals.0 (the Rotation's parameters
        # sit one level deeper than PEFT's default rule expects)
        return re.sub(rf"\.{ATTRIBUTE}\.{re.escape(adapter_name)}\.", f".{ATTRIBUTE}.", key)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls,
        model: nn.Module,
        config: Any,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        remapped = super()._remap_adapter_state_dict_for_load(
            model=model, config=config, adapter_name=adapter_name, state_dict=state_dict
        )
        own = model.state_dict()
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
