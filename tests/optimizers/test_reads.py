"""Host reads per step (Note [One host read per step]): at most the engine's one read.

Every registered optimizer on the rule interface that takes the option a test passes
(``foreach``, ``capturable``: every built-in one does, test_buckets.py asserts it), on real
and complex, tall and square points, steps with its default options; the reads of a
tensor's value on the host are counted by `benchmarks.launch.StepCounter` (a dispatch
mode: ``.item()``, ``bool(t)``, ``.tolist()``, ...), independent of the machine's load. A
refused short path (a long step) is taken again with the kernels' exact paths: its result
is checked against the dense float64 QR of X − lr·ξ.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _optim_problems import rule_names_taking

from stiefel import optimizers
from stiefel.benchmarks.launch import StepCounter as Count  # a dispatch mode, written once
from stiefel.manifolds import Stiefel, kernels

#: (shape, complex): tall and square, real and complex
KINDS = [((9, 3), False), ((5, 5), False), ((7, 2), True), ((4, 4), True)]
STEPS = 9  # past one scheduled off-manifold test (every 8th step)


def _params(shape, cplx: bool, count: int, seed: int = 0) -> list[torch.Tensor]:
    man = Stiefel(*shape, complex=cplx)
    dtype = torch.complex128 if cplx else torch.float64
    gen = torch.Generator().manual_seed(seed)
    return [
        geoopt.ManifoldParameter(man.random(dtype=dtype, generator=gen), manifold=man)
        for _ in range(count)
    ]


def _reads_per_step(opt, params, steps: int = STEPS) -> list[int]:
    gen = torch.Generator().manual_seed(1)
    reads = []
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            p.grad = 0.1 * g.to(p.device)
        with Count(opt) as c:
            opt.step()
        reads.append(c.reads)
    return reads


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize(("shape", "cplx"), KINDS)
@pytest.mark.parametrize("name", rule_names_taking("foreach"))
def test_at_most_one_host_read_per_step(name, shape, cplx, foreach):
    params = _params(shape, cplx, 3)
    opt = optimizers.create(name, params, lr=1e-2, foreach=foreach)
    reads = _reads_per_step(opt, params)
    assert max(reads) <= 1, reads
    assert all(torch.isfinite(p).all() for p in params)


def _capturable_reads(name, params) -> list[int]:
    """Reads per step of ``capturable=True``; its points equal the eager step's (reference:
    the same parameters and gradients stepped with the default options)."""
    twins = [geoopt.ManifoldParameter(p.detach().clone(), manifold=p.manifold) for p in params]
    reads = _reads_per_step(optimizers.create(name, params, lr=1e-2, capturable=True), params)
    _reads_per_step(optimizers.create(name, twins, lr=1e-2), twins)
    for p, twin in zip(params, twins, strict=True):
        tol = 100 * p.shape[-2] * torch.finfo(p.dtype).eps
        torch.testing.assert_close(p.detach().cpu(), twin.detach().cpu(), rtol=tol, atol=tol)
    return reads


@pytest.mark.parametrize(("shape", "cplx"), KINDS)
@pytest.mark.parametrize("name", rule_names_taking("capturable"))
def test_the_capturable_path_reads_nothing(name, shape, cplx, monkeypatch):
    # the capturable path run on the CPU (its CUDA-only check set aside): points, states
    # and skips chosen by torch.where, the kernels' short paths unread (no_host_reads)
    from stiefel.optimizers import groups

    monkeypatch.setattr(groups, "_check_capturable", lambda params: None)
    assert _capturable_reads(name, _params(shape, cplx, 3)) == [0] * STEPS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturable=True needs CUDA")
@pytest.mark.parametrize(("shape", "cplx"), KINDS[:2])
@pytest.mark.parametrize("name", rule_names_taking("capturable"))
def test_a_capturable_step_on_cuda_reads_nothing(name, shape, cplx):
    params = [geoopt.ManifoldParameter(p.detach().cuda(), manifold=p.manifold)
              for p in _params(shape, cplx, 3)]  # fmt: skip
    assert _capturable_reads(name, params) == [0] * STEPS


@pytest.mark.parametrize("shape", [(9, 3), (5, 5)])
def test_a_refused_short_path_is_stepped_again_exactly(shape):
    # a long QR step: the Gram (Cholesky-QR) path refuses it, the bucket is stepped again
    # by Householder QR; reference: the dense float64 QR of X − lr·ξ, positive diagonal
    params = _params(shape, False, 3)
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    lr = 50.0
    opt = optimizers.create("rgd", params, lr=lr, retraction="qr", foreach=True)
    opt.step()
    for p, x, g in zip(params, start, grads, strict=True):
        a = x - lr * kernels.egrad2rgrad_euclidean(x, g)
        q, r = torch.linalg.qr(a)
        ref = q * torch.sign(torch.diagonal(r)).unsqueeze(-2)
        assert torch.allclose(p.detach(), ref, atol=1e-10), (p.detach() - ref).abs().max()
