"""The generic tasks of the harness, registered by name (`register`); the paper
reproductions with their own models register from the checkout's ``experiments/``
(``--import``, or ``imports = [...]`` in a TOML config).
"""

from __future__ import annotations

from .. import task as _task
from ..task import *  # noqa: F403
from .matrix import Brockett, Procrustes
from .sequence import Adding, Copying, Digits

__all__ = [*_task.__all__, "Procrustes", "Brockett", "Copying", "Adding", "Digits"]
