"""A parametrized weight after FSDP2's ``fully_shard`` (gloo, CPU, world 2): reading it outside
the forward says "call unshard() first"; after ``unshard()`` it is the unsharded model's
weight, orthogonal by the dense float64 error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


@pytest.mark.slow
def test_reading_a_sharded_parametrized_weight_says_unshard_first(tmp_path):
    from _launch import launch
    from _validity_workers import N, model, read_sharded_worker

    launch(read_sharded_worker, 2, tmp_path, timeout=600)
    got = torch.load(tmp_path / "read_sharded.pt", weights_only=True)
    for message in got["refused"]:
        assert "call unshard() first" in message, message
        assert message.startswith("ValueError"), message
    want = [layer.weight.detach() for layer in model()]
    eye = torch.eye(N, dtype=torch.float64)
    for w, ref in zip(got["read"], want, strict=True):
        w64 = w.double()
        err = float(torch.linalg.matrix_norm(w64.T @ w64 - eye))
        assert err < 10 * N * torch.finfo(torch.float32).eps, err
        torch.testing.assert_close(w, ref, rtol=0, atol=0)
