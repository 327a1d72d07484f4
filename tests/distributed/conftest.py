"""Make the worker modules importable by the spawned processes (pytest --import-mode=importlib)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLDS = (2, 4)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Every scenario at world size 2 (which saves a sharded checkpoint), then at 4 (which
    resumes from it): {world: output folder}."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    from _all import all_worker
    from _launch import launch

    out = {w: tmp_path_factory.mktemp(f"world{w}") for w in WORLDS}
    launch(all_worker, 2, out[2], True, None)
    launch(all_worker, 4, out[4], False, str(out[2] / "ckpt"))
    return out
