"""Tasks of the comparison harness, registered by name (`register`)."""

from __future__ import annotations

from .base import Task, available, check_options, get, make, options, register
from .finetune import Finetune  # noqa: F401  (registers "finetune")
from .matrix import Brockett, Procrustes
from .sequence import Adding, Copying, Digits

__all__ = [
    "Task",
    "register",
    "available",
    "get",
    "options",
    "check_options",
    "make",
    "Procrustes",
    "Brockett",
    "Copying",
    "Adding",
    "Digits",
]
