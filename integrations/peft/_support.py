"""PEFT's version window and the registration of the ``"stiefel"`` method.

Note [Extending PeftType]
PEFT 0.21's ``register_peft_method`` accepts only names already in the
``PeftType`` enum (PEFT's docs for custom methods: add an entry first). A
stdlib ``Enum`` has no public way to grow, so the member is built as the enum
machinery builds its own (``str.__new__`` on the class, then ``_name_`` and
``_value_``) and entered in the three tables lookups read: the class
attribute (``PeftType.STIEFEL``), ``_member_map_`` (``PeftType["STIEFEL"]``,
iteration via ``_member_names_``) and ``_value2member_map_``
(``PeftType("STIEFEL")``, what a saved ``adapter_config.json`` is read
with). Both steps are idempotent, so the order in which PEFT and this package
are imported, or a re-import, does not matter.
"""

from __future__ import annotations

import enum

NAME = "stiefel"
MIN_VERSION = "0.17.0"


def require():
    """Import PEFT, checking the supported version window ``MIN_VERSION <= v < 1.0``."""
    try:
        import peft
    except ModuleNotFoundError as err:
        if err.name != "peft":  # installed, and one of its own imports failed
            raise ImportError(
                f"stiefel.integrations.peft: PEFT is installed but importing it failed: "
                f"{err} (a PEFT and transformers/accelerate versions that do not match?)"
            ) from err
        raise ImportError("stiefel.integrations.peft needs PEFT: pip install peft") from err
    from packaging.version import Version

    version = Version(peft.__version__)
    if not Version(MIN_VERSION) <= version < Version("1.0"):
        raise ImportError(
            f"PEFT {peft.__version__} is not supported by stiefel.integrations.peft; "
            f"allowed: {MIN_VERSION} <= peft < 1.0 (tested with 0.21)"
        )
    return peft


def peft_type() -> enum.Enum:
    """``PeftType.STIEFEL``, added to PEFT's enum once (Note [Extending PeftType])."""
    from peft.utils import PeftType

    key = NAME.upper()
    if key in PeftType.__members__:
        return PeftType[key]
    member = str.__new__(PeftType, key)
    member._name_ = key
    member._value_ = key
    setattr(PeftType, key, member)  # before _member_map_: EnumType refuses to reassign members
    PeftType._member_map_[key] = member
    PeftType._value2member_map_[key] = member
    PeftType._member_names_.append(key)
    return member


def register(config_cls: type, model_cls: type) -> None:
    """Register the method with ``peft.utils.register_peft_method`` (once)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils import register_peft_method

    member = peft_type()
    if member not in PEFT_TYPE_TO_CONFIG_MAPPING:
        register_peft_method(name=NAME, config_cls=config_cls, model_cls=model_cls)
