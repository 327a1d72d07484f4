"""Tasks of the comparison harness, registered by name (`register`)."""

from __future__ import annotations

from . import base as _base
from .base import *  # noqa: F403
from .finetune import Finetune
from .lipschitz import LipschitzDigits
from .matrix import Brockett, Procrustes
from .sequence import Adding, Copying, Digits
from .video import MovingDigits

__all__ = [
    *_base.__all__,
    "Procrustes",
    "Brockett",
    "Copying",
    "Adding",
    "Digits",
    "Finetune",
    "MovingDigits",
    "LipschitzDigits",
]
