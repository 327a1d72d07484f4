"""Paper reproductions that bring their own models (not installed, like ``benchmarks/``).

Each module registers a task of the harness (`stiefel.comparisons.tasks.register`)
or a part of its complexity section when imported; run them from the root of a
checkout with the harness's ``--import MODULE`` flag, or through the configs
that name them (``imports = [...]``):

```text
python -m stiefel.comparisons convergence --config configs/moving_digits.toml
python -m stiefel.comparisons convergence --config configs/lipschitz.toml
python -m stiefel.comparisons convergence --config configs/finetune.toml
python -m stiefel.comparisons complexity --import experiments.conv_complexity
```

- `moving_digits` (`video_models`): one-step video prediction, ConvNERU against
  ConvLSTM (CWY paper §3.4, Table 5);
- `lipschitz` (`lipschitz_net`): a Lipschitz classifier with orthogonal convolutions;
- `finetune` (`transformer`): orthogonal fine-tuning of a small transformer;
- `conv_complexity`: time of the orthogonal convolution layers in the complexity section;
- `recurrent_step`: one recurrent step, the Householder paper's Table 2 layout.
"""

from __future__ import annotations

import torch


def real_dtype(task: str, dtype: torch.dtype) -> None:
    """ValueError naming the task when ``dtype`` is complex (a task on real data only)."""
    if dtype.is_complex:
        raise ValueError(f"task {task!r}: dtype={dtype}; allowed: float32, float64 (a real task)")
