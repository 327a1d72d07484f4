"""Tasks of the comparison harness, registered by name (`register`)."""

from __future__ import annotations

from .base import (
    Task,
    available,
    check_options,
    extra_methods,
    get,
    make,
    options,
    register,
)
from .finetune import Finetune
from .lipschitz import LipschitzDigits
from .matrix import Brockett, Procrustes
from .sequence import Adding, Copying, Digits
from .video import MovingDigits

__all__ = [
    "Task",
    "register",
    "available",
    "get",
    "options",
    "check_options",
    "make",
    "extra_methods",
    "Procrustes",
    "Brockett",
    "Copying",
    "Adding",
    "Digits",
    "Finetune",
    "MovingDigits",
    "LipschitzDigits",
]
