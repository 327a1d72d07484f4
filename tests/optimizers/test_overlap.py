"""Parameters that share memory (Note [Parameters that overlap in memory])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stiefel import optimizers


@pytest.mark.parametrize("name", ["rgd", "radam", "landing", "manifold_muon", "pogo"])
def test_parameters_sharing_an_element_are_refused_and_the_optimizer_is_unchanged(name):
    # a view of another parameter lost an update: rgd gave [-0.1, 0.9, ...] where torch's
    # SGD applies both updates ([-0.2, 0.8, ...])
    base = torch.arange(6.0).reshape(2, 3)
    a, b = nn.Parameter(base), nn.Parameter(base[:, :2])
    with pytest.raises(ValueError, match=r"parameter 1 of the new param group \(shape \(2, 2\)\) "
                       r"shares memory with parameter 0"):  # fmt: skip
        optimizers.create(name, [a, b], lr=0.1)
    opt = optimizers.create(name, [a], lr=0.1)
    with pytest.raises(ValueError, match="shares memory with a parameter already added"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1


def test_views_that_share_no_element_step_as_torchs_sgd_steps_them():
    # the columns of one matrix and the slices of a flat buffer share a storage and
    # ranges of memory, but no element: they are stepped, each by its own update
    m, flat = torch.zeros(4, 3, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    ours = [nn.Parameter(m[:, i]) for i in range(3)] + [nn.Parameter(flat[:4]),
                                                        nn.Parameter(flat[4:])]  # fmt: skip
    refs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = optimizers.create("rgd", ours, lr=0.1, momentum=0.5)
    ref = torch.optim.SGD(refs, lr=0.1, momentum=0.5)
    for _ in range(3):
        for p, q in zip(ours, refs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, refs, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-15)


def test_views_of_one_buffer_in_two_dtypes_are_compared_by_their_bytes():
    # element offsets were compared across element sizes: disjoint bytes were refused and
    # the same bytes accepted
    buf = torch.zeros(64, dtype=torch.uint8)
    f32 = buf[:32].view(torch.float32)  # bytes 0-31
    f16 = buf[32:].view(torch.float16)  # bytes 32-63
    optimizers.create("rgd", [nn.Parameter(f32), nn.Parameter(f16)], lr=0.1)
    same = buf[:32].view(torch.float16)  # bytes 0-31 again
    with pytest.raises(ValueError, match="shares memory"):
        optimizers.create("rgd", [nn.Parameter(f32), nn.Parameter(same)], lr=0.1)


def test_a_refused_group_leaves_nothing_in_the_optimizer_to_refuse_later():
    base = torch.zeros(6)
    a, b = nn.Parameter(base[:4]), nn.Parameter(base[2:])
    opt = optimizers.create("rgd", [nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="parameter 1 of the new param group .* parameter 0"):
        opt.add_param_group({"params": [a, b]})
    opt.add_param_group({"params": [b]})  # a was never added
    assert len(opt.param_groups) == 2
