"""``StiefelConfig``: the PEFT configuration of this package's orthogonal fine-tuning."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from peft.config import PeftConfig

from ..._core import checks as _checks
from ...parametrizations import maps
from ._support import peft_type

SIDES = ("input", "output")
BIASES = ("none", "all", "stiefel_only")


@dataclass
class StiefelConfig(PeftConfig):
    r"""A learned orthogonal Q per targeted layer: the layer computes as if its weight were W·Q.

    Q starts at the identity (``init_weights=True``) and is built from any
    registered map of `stiefel.parametrizations` (``method``, with its options
    such as ``reflections``); ``blocks=b`` makes it block-diagonal (OFT),
    ``butterfly=k`` a product of k butterfly-permuted block-diagonal factors
    (BOFT). Training rotates the features through Q's operator form (the
    kernels of `stiefel.rotate`); W is never multiplied by Q and stays frozen
    in its own dtype. ``merge_and_unload`` writes W·Q (``side="output"``: Q·W).

    Args:
        method: a registered map (`stiefel.parametrizations.maps`), default ``"cwy"``.
        options: the map's options (e.g. ``{"reflections": 8}``); they may also be
            passed as keyword arguments: ``StiefelConfig(reflections=8)``.
        blocks: number of equal diagonal blocks of Q (must divide the features).
        butterfly: number of butterfly factors (0: one block-diagonal factor).
        side: ``"input"`` (W·Q, Q on the input features) or ``"output"`` (Q·W).
        target_modules: names or a regex of the layers to adapt (``nn.Linear``,
            ``nn.Conv1d/2d`` with groups=1, transformers' ``Conv1D``).
        exclude_modules: names or a regex of layers not to adapt.
        init_weights: True: Q = I at the start; False: a random orthogonal Q
            near I (for tests).
        bias: ``"none"``, ``"all"`` or ``"stiefel_only"`` (biases trained).
        modules_to_save: other modules trained in full and saved.
        layers_to_transform: layer indices to adapt, as in PEFT's other methods.
        layers_pattern: the name of the layer list, with ``layers_to_transform``.

    Raises:
        ValueError: an unknown method, option, side or bias, or a bad count.

    Example:
        ```python
        import torch
        from peft import get_peft_model
        from stiefel.integrations.peft import StiefelConfig

        base = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        config = StiefelConfig(method="cwy", reflections=4, target_modules=["0", "2"])
        model = get_peft_model(base, config)
        x = torch.randn(3, 16)
        with model.disable_adapter():
            y0 = model(x)
        assert torch.allclose(model(x), y0, atol=1e-5)  # Q = I at the start
        ```
    """

    method: str = field(default="cwy", metadata={"help": "A registered map of stiefel."})
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "The map's options, e.g. {'reflections': 8}."}
    )
    blocks: int = field(default=1, metadata={"help": "Equal diagonal blocks of Q."})
    butterfly: int = field(default=0, metadata={"help": "Butterfly factors (0: none)."})
    side: str = field(default="input", metadata={"help": "'input' (W·Q) or 'output' (Q·W)."})
    target_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Names or a regex of the modules to adapt."}
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Names or a regex of the modules not to adapt."}
    )
    init_weights: bool = field(default=True, metadata={"help": "Q = I at the start."})
    layers_to_transform: list[int] | int | None = field(default=None)
    layers_pattern: list[str] | str | None = field(default=None)
    bias: str = field(default="none", metadata={"help": "'none', 'all' or 'stiefel_only'."})
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Other modules trained in full and saved."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = peft_type()
        registered = maps()
        if not isinstance(self.method, str) or self.method not in registered:
            raise ValueError(
                f"method={self.method!r} is not a registered map; allowed: {', '.join(registered)}"
            )
        if not isinstance(self.options, dict):
            raise ValueError(f"options={self.options!r} is not allowed; allowed: a dict")
        names = registered[self.method].options()
        unknown = sorted(set(self.options) - set(names))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for method={self.method!r}; "
                f"allowed: {', '.join(names) or 'none'}"
            )
        # Python ints: the config is saved as JSON (numpy's integers are taken, not written)
        self.blocks = _checks.positive_int("blocks", self.blocks)
        self.butterfly = _checks.int_at_least("butterfly", self.butterfly, 0)
        _checks.choice("side", self.side, SIDES)
        _checks.choice("bias", self.bias, BIASES)
        _checks.flag("init_weights", self.init_weights)
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(self, name, set(value))
        if isinstance(self.target_modules, str) and self.layers_to_transform is not None:
            raise ValueError("layers_to_transform cannot be used when target_modules is a str")
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("layers_pattern needs layers_to_transform")


class UnknownKeyword(TypeError, ValueError):
    """An unknown keyword of `StiefelConfig` (a TypeError, as Python's own; a ValueError too).

    Note [Unknown keywords of StiefelConfig]
    PEFT loads a config with ``config_cls(**saved)`` and, when that raises a
    TypeError saying "got an unexpected keyword argument", drops the keys that
    are not parameters of ``config_cls.__init__`` with a warning and tries
    again (its forward compatibility: a config saved by a later version with
    new fields still loads). ``StiefelConfig(reflections=8)`` accepts the
    method's options as keywords, so only the keywords that are neither fields
    nor options of the chosen map are unknown; they raise this error, whose
    message starts as Python's, so PEFT's fallback runs. The wrapped
    ``__init__`` keeps the dataclass's signature (``functools.wraps``), which
    is what PEFT filters the saved keys by. It is also a ValueError, the class
    an unknown option raised before.
    """


def _accept_map_options(init):
    """Let ``StiefelConfig(reflections=8)`` mean ``StiefelConfig(options={"reflections": 8})``.

    Keywords that are neither fields nor options of ``method`` raise `UnknownKeyword`
    (Note [Unknown keywords of StiefelConfig]).
    """

    @functools.wraps(init)
    def __init__(self, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        fields = [f.name for f in dataclasses.fields(StiefelConfig) if f.init]
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in fields}
        if extra:
            method = kwargs.get("method", "cwy")
            registered = maps()
            if not isinstance(method, str) or method not in registered:
                raise ValueError(
                    f"method={method!r} is not a registered map; allowed: {', '.join(registered)}"
                )
            names = registered[method].options()
            unknown = sorted(k for k in extra if k not in names)
            if unknown:
                shown = ", ".join(repr(k) for k in unknown)
                raise UnknownKeyword(
                    f"StiefelConfig.__init__() got an unexpected keyword argument {shown}; "
                    f"allowed: the fields {', '.join(f for f in fields if f != 'options')} and "
                    f"the options of method={method!r}: {', '.join(names) or 'none'}"
                )
        merged = {} if options is None else options
        if isinstance(merged, dict):
            both = sorted(k for k in extra if k in merged and merged[k] != extra[k])
            if both:
                shown = ", ".join(
                    f"{k}={extra[k]!r} and options[{k!r}]={merged[k]!r}" for k in both
                )
                raise ValueError(
                    f"StiefelConfig got {shown}: two values for one option; allowed: one of "
                    "them (the keyword or the options entry), or the same value in both"
                )
            merged = {**merged, **extra}
        init(self, *args, options=merged, **kwargs)

    return __init__


StiefelConfig.__init__ = _accept_map_options(StiefelConfig.__init__)  # type: ignore[method-assign]
