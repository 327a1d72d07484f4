"""Shared fixtures: the devices every GPU-relevant suite runs on.

``device`` is "cpu", and "cuda" when a CUDA device is visible (the cuda case is
skipped otherwise, so a CPU run lists it as skipped). Tests create their tensors
on ``device``, compute references in float64 on the CPU and compare after
``.cpu()``.
"""

import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test's tensors live on: "cpu", or "cuda" when one is visible."""
    return request.param
