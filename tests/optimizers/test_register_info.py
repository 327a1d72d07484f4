"""What `optimizers.register` records for the harness is checked when it is registered."""

from __future__ import annotations

import pytest
import torch

from stiefel import optimizers


def _factory(params, lr):
    return torch.optim.SGD(params, lr=lr)


@pytest.mark.parametrize(
    ("info", "error", "match"),
    [
        ({"default_lr": "x"}, TypeError, "default_lr must be a real number"),
        ({"default_lr": -1.0}, ValueError, r"default_lr=-1\.0 is out of range"),
        ({"default_lr": 0.0}, ValueError, r"default_lr=0\.0 is out of range"),
        ({"riemannian": "yes"}, TypeError, "riemannian='yes' is not allowed"),
        ({"feasible": 1}, TypeError, "feasible=1 is not allowed"),
    ],
)
def test_a_bad_info_value_is_refused_at_registration(info, error, match):
    # accepted before: the harness failed later, stepping with lr "x" or -1
    with pytest.raises(error, match=match):
        optimizers.register("bad_info_doc", **info)(_factory)
    assert "bad_info_doc" not in optimizers.available()
