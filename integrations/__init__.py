"""Adapters to other libraries (each imports its library lazily, on first use).

- `stiefel.integrations.peft`: `StiefelConfig`, this package's orthogonal
  fine-tuning as a PEFT method (registered as ``"stiefel"``), and
  `accelerate(model)`, which runs a PEFT model's HRA, OFT and BOFT layers
  with this package's kernels.
"""

import importlib

__all__ = ["peft"]


def __getattr__(name: str):
    # `from . import peft` here would ask this very __getattr__ for "peft" first
    # (importlib's fromlist handling) and recurse: import the submodule by name.
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'stiefel.integrations' has no attribute {name!r}")
