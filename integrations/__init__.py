"""Adapters to other libraries (each imports its library lazily, on first use).

- :mod:`stiefel.integrations.peft`: ``accelerate(model)`` runs a PEFT model's
  HRA, OFT and BOFT layers with this package's kernels.
"""

__all__ = ["peft"]


def __getattr__(name: str):
    if name == "peft":
        from . import peft

        return peft
    raise AttributeError(f"module 'stiefel.integrations' has no attribute {name!r}")
