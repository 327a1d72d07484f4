"""Tasks of the comparison harness, registered by name (`register`).

The generic tasks live here; the paper reproductions that bring their own
models (moving digits, the Lipschitz classifier, fine-tuning) live in the
checkout's ``experiments/`` and register on import (``--import``, or
``imports = [...]`` in a TOML config).
"""

from __future__ import annotations

from .. import task as _task
from ..task import *  # noqa: F403
from .matrix import Brockett, Procrustes
from .sequence import Adding, Copying, Digits

__all__ = [*_task.__all__, "Procrustes", "Brockett", "Copying", "Adding", "Digits"]
