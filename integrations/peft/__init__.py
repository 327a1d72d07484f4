r"""This package's orthogonal fine-tuning inside PEFT, and faster PEFT HRA/OFT/BOFT layers.

- `StiefelConfig`: a PEFT method registered under the name ``"stiefel"``
  (``get_peft_model(model, StiefelConfig(...))``, ``save_pretrained``,
  ``PeftModel.from_pretrained``, merging, named adapters: PEFT's workflow).
  Q comes from any registered map of `stiefel.parametrizations`, computed
  through the operator forms of `stiefel.rotate`.
- `accelerate`: runs the HRA, OFT and BOFT layers of a model already trained
  with PEFT through this package's kernels (same parameters, same outputs).

Importing this module imports PEFT (``pip install peft``; tested with 0.21)
and registers the method; ``import stiefel`` alone never imports PEFT.
"""

from ._support import MIN_VERSION, register, require

require()

from .acceleration import accelerate, cayley_neumann, restore  # noqa: E402
from .config import StiefelConfig  # noqa: E402
from .layer import StiefelLayer  # noqa: E402
from .model import StiefelModel  # noqa: E402

register(StiefelConfig, StiefelModel)

__all__ = [
    "StiefelConfig",
    "StiefelModel",
    "StiefelLayer",
    "accelerate",
    "restore",
    "cayley_neumann",
    "MIN_VERSION",
]
