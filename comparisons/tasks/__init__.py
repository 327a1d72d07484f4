"""Tasks of the comparison harness, registered by name (`register`)."""

from __future__ import annotations

from .base import (
    Task,
    available,
    baseline_needs,
    baselines,
    check_options,
    get,
    make,
    options,
    register,
)
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
    "baselines",
    "baseline_needs",
    "Procrustes",
    "Brockett",
    "Copying",
    "Adding",
    "Digits",
    "MovingDigits",
    "LipschitzDigits",
]
