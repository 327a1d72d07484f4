"""Make the shared helper module ``_optim_problems`` importable (pytest --import-mode=importlib)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core runner two threads can be 100× slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
