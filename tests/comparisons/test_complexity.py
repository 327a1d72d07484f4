"""The complexity section's measuring tools: peak memory and the measurement plans."""

import torch

from stiefel.comparisons.complexity import map_plan, peak_bytes, step_plan

MiB = 2**20


def test_peak_bytes_follows_allocations_and_frees():
    def fn():
        x = torch.empty(MiB, dtype=torch.uint8)
        y = torch.empty(2 * MiB, dtype=torch.uint8)
        del x  # freed before z exists: the peak is x + y, not x + y + z
        z = torch.empty(MiB // 2, dtype=torch.uint8)  # y + z = 2.5 MiB < x + y
        return y, z

    assert peak_bytes(fn) == 3 * MiB

    def keep():
        return [torch.empty(MiB, dtype=torch.uint8) for _ in range(3)]

    assert peak_bytes(keep) == 3 * MiB


def test_peak_bytes_ignores_views_in_place_ops_and_earlier_tensors():
    a = torch.zeros(1024, 1024)
    assert peak_bytes(lambda: (a.add_(1), a[:10], a.T, a.detach())) == 0
    b = torch.randn(64, 64)
    # b @ b allocates one 64×64 float32 result: 16 KiB, the input is not counted
    assert peak_bytes(lambda: b @ b) == 64 * 64 * 4


def test_peak_bytes_sees_the_backward_pass():
    w = torch.randn(128, 128, requires_grad=True)

    def fwd_bwd():
        (w @ w).sum().backward()

    # the product (64 KiB) and at least the gradient of w (64 KiB) are held together
    assert peak_bytes(fwd_bwd) >= 2 * 128 * 128 * 4
    assert w.grad is not None


def test_plans_honour_limits():
    plan = map_plan(["cwy", "exp"], [8, 16, 32], [0.25, 1.0], {"exp": 16})
    assert [p for p in plan if p[0] == "exp"] == [("exp", 1.0, 8), ("exp", 1.0, 16)]
    assert len([p for p in plan if p[0] == "cwy"]) == 2 * 3
    steps = step_plan([(64, 4), (128, 4)], {"landing": 64})
    assert ("landing", 64, 4) in steps and ("landing", 128, 4) not in steps
    assert ("geoopt RiemannianSGD CanonicalStiefel", 128, 4) in steps
