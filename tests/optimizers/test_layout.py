"""Note [Batches stepped by rows]: a CPU batch of tall points stored by columns.

Every Riemannian optimizer of the package steps such a batch on a row-major copy, so
the same points stored by rows and by columns take bit-identical steps; the
parameter keeps its object, its storage and its layout.
"""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.optimizers.base import RiemannianOptimizer
from stiefel.optimizers.layout import by_rows

# this package's Riemannian optimizers (the registry also lists geoopt's as anchors)
OURS = [
    n
    for n in optimizers.available()
    if isinstance(optimizers.get(n), type) and issubclass(optimizers.get(n), RiemannianOptimizer)
]


def _points(batch: int, n: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.linalg.qr(torch.randn(batch, n, m, generator=gen, dtype=dtype))[0]


@pytest.mark.parametrize("name", OURS)
def test_a_batch_by_columns_steps_as_the_same_batch_by_rows(name):
    dtype = torch.float64
    col = _points(5, 12, 4, dtype)  # QR's Q: each matrix stored by columns
    assert col.stride(-2) == 1 and col.stride(-1) != 1
    target = _points(5, 12, 4, dtype).flip(0)
    man = Stiefel(12, 4)
    params = [geoopt.ManifoldParameter(t, manifold=man) for t in (col.clone(), col.contiguous())]
    by_col, by_row = params
    storage, strides = by_col.data_ptr(), by_col.stride()
    hyper = {"lr": optimizers.info(name).default_lr}
    opts = [optimizers.create(name, [p], **hyper) for p in params]
    seen = []  # the layout each rule's update receives, for both parameters
    for opt in opts:
        update = opt.update

        def spy(geo, x, grad, state, group, update=update):
            seen.append(x.is_contiguous() and grad.is_contiguous())
            return update(geo, x, grad, state, group)

        opt.update = spy
    for _ in range(3):
        for p, opt in zip(params, opts, strict=True):
            opt.zero_grad()
            ((p - target) ** 2).sum().backward()
            opt.step()
    # the same numbers (a step of the column-major batch runs by rows), not only close
    assert torch.equal(by_col.detach(), by_row.detach())
    assert not torch.equal(by_col.detach(), col)  # the steps moved the points
    assert seen == [True] * 6  # 3 steps × 2 parameters, each stepped by rows
    assert by_col.data_ptr() == storage and by_col.stride() == strides


def test_a_bfloat16_batch_by_columns_steps_its_master_by_rows():
    col = _points(4, 10, 3, torch.float32)
    target = _points(4, 10, 3, torch.float32).flip(0)
    params = [
        geoopt.ManifoldParameter(t.to(torch.bfloat16), manifold=Stiefel(10, 3))
        for t in (col, col.contiguous())
    ]
    assert params[0].stride(-2) == 1 and params[1].is_contiguous()
    opts = [optimizers.create("radam", [p], lr=0.05) for p in params]
    for _ in range(3):
        for p, opt in zip(params, opts, strict=True):
            opt.zero_grad()
            ((p.float() - target) ** 2).sum().backward()
            opt.step()
    masters = [opt.state[p]["master"] for p, opt in zip(params, opts, strict=True)]
    assert torch.equal(masters[0], masters[1]) and torch.equal(params[0], params[1])
    assert params[0].stride(-2) == 1  # the parameter keeps its layout
    assert not torch.equal(masters[0], col)


def test_every_riemannian_optimizer_of_the_package_is_covered():
    assert {"rgd", "radam", "landing", "pogo", "manifold_muon"} <= set(OURS)


def test_by_rows_copies_only_a_cpu_batch_of_tall_matrices_stored_by_columns():
    q = _points(3, 8, 3, torch.float32)
    r = by_rows(q)
    assert r.is_contiguous() and torch.equal(r, q) and r.data_ptr() != q.data_ptr()
    kept = [
        q.contiguous(),  # by rows already
        q[0],  # one matrix
        torch.linalg.qr(torch.randn(3, 5, 5))[0],  # square: the same product shapes
        torch.empty(3, 3, 8, device="meta").mT,  # not on the CPU
    ]
    for t in kept:
        assert by_rows(t) is t
