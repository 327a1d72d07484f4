"""pogo on plain matrices is pogo-torch's step; far points and huge steps are not silent.

pogo-torch treats every parameter it is given as a (row-orthonormal, by default)
point of the Stiefel manifold: ``optimizers.create("pogo", model.parameters())``
does the same (a wide matrix through its transpose), compared with pogo-torch's
own output on the same inputs. A point outside POGO's basin (×3, ×1000, the zero
matrix) is projected back with a warning, as landing does with the zero matrix;
a step that would leave the basin (lr = 1e10) is skipped with a warning.
"""

from __future__ import annotations

import math
import warnings

import geoopt
import numpy as np
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.manifolds.kernels import orthogonality_error

pogo = pytest.importorskip("pogo", reason="pogo-torch is in the [test] extra")
pogo_base = pytest.importorskip("pogo.base")


def _rows(shape, seed):
    """Row-orthonormal matrices (..., p, n), p ≤ n: pogo-torch's default layout."""
    a = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))  # fmt: skip
    return torch.linalg.qr(a)[0].mT.contiguous()


def _polar_np(x: np.ndarray) -> np.ndarray:
    u, _, vh = np.linalg.svd(x, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize(
    "shape,ours,theirs",
    [
        ((4, 3, 8), dict(base="adam"), lambda: pogo_base.VectorAdam()),
        ((2, 5, 5), dict(base="adam"), lambda: pogo_base.VectorAdam()),
        ((3, 2, 7), dict(base="sgd", momentum=0.9), lambda: pogo_base.SGD(momentum=0.9)),
        ((3, 9), dict(base="adam"), lambda: pogo_base.VectorAdam()),
    ],
)
def test_plain_parameters_step_as_in_pogo_torch_readme(shape, ours, theirs):
    x0 = _rows(shape, 0)
    p, q = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    opt = optimizers.create("pogo", [p], lr=0.05, **ours)
    # pogo-torch's README: POGO(model.parameters(), base.VectorAdam(), lr), matrices
    # [num_matrices, p, n]; a single matrix gets a batch dimension through flatten_fn
    flatten = (lambda t: t) if len(shape) == 3 else (lambda t: t.unsqueeze(0))
    ref = pogo.POGO([q], theirs(), lr=0.05, flatten_fn=flatten)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert float((p.detach() - q.detach()).abs().max()) < 1e-12
    assert float((p.detach() - x0).abs().max()) > 1e-3  # it moved: not a no-op compared


def test_plain_vector_keeps_the_euclidean_base_update():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    opt = optimizers.create("pogo", [p], lr=0.5, base="sgd")
    p.grad = torch.full((4,), 2.0, dtype=torch.float64)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_a_plain_matrix_in_a_euclidean_group_keeps_the_euclidean_base_update(base):
    # geoopt.Euclidean() named by the group says "plain": pogo does not make the matrix
    # a Stiefel point; its step is the base optimizer's, as the same entries in a vector
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 16, dtype=torch.float64, generator=gen)
    grads = [torch.randn(4, 16, dtype=torch.float64, generator=gen) for _ in range(3)]
    p = torch.nn.Parameter(x.clone())
    v = torch.nn.Parameter(x.reshape(-1).clone())
    opt = optimizers.create("pogo", [{"params": [p], "manifold": geoopt.Euclidean()}],
                            lr=0.1, base=base)  # fmt: skip
    ref = optimizers.create("pogo", [v], lr=0.1, base=base)
    for g in grads:
        p.grad, v.grad = g.clone(), g.reshape(-1).clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is projected, nothing warns
            opt.step()
        ref.step()
    assert float((p.detach().reshape(-1) - v.detach()).abs().max()) <= 1e-13
    assert float((p.detach() - x).abs().max()) > 1e-2  # it moved


def test_a_plain_matrix_far_from_stiefel_is_projected_with_a_warning_that_says_why():
    p = torch.nn.Parameter(3 * torch.randn(16, 4, generator=torch.Generator().manual_seed(2)))
    opt = optimizers.create("pogo", [p], lr=0.01)
    message = _step(opt, p, torch.randn(16, 4))
    assert "is a plain matrix, which POGO steps as a point of Stiefel" in message
    assert "manifold=geoopt.Euclidean()" in message
    assert float(orthogonality_error(p.detach())) < 1e-3


def _step(opt, p, g):
    p.grad = g
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return " ".join(str(c.message) for c in caught)


@pytest.mark.parametrize("scale", [3.0, 1000.0, 0.0])
@pytest.mark.parametrize("name", ["pogo", "landing"])
def test_far_points_are_projected_back_with_a_warning(name, scale):
    if name == "landing" and scale != 0.0:
        pytest.skip("landing converges from any full-rank point (its safe step)")
    x = _rows((6, 10), 2).mT.contiguous()  # a tall point of St(10, 6)
    p = geoopt.ManifoldParameter(x * scale, manifold=Stiefel(10, 6))
    opt = optimizers.create(name, [p], lr=0.01)
    g = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    message = _step(opt, p, g)
    assert "off its manifold" in message and "projected back" in message
    assert torch.isfinite(p.detach()).all()
    assert float(orthogonality_error(p.detach())) < 1e-3
    if scale:  # the step starts from the polar factor (numpy), moving by ~lr
        start = torch.tensor(_polar_np((x * scale).numpy()))
        assert float((p.detach() - start).abs().max()) < 0.1
    for _ in range(20):  # and it goes on near the manifold (landing: within ~lr‖G‖²/λ)
        assert "off its manifold" not in _step(opt, p, g)
    assert float(orthogonality_error(p.detach())) < 0.05


def test_a_step_leaving_the_basin_is_skipped_with_a_warning():
    st = Stiefel(10, 3)
    p = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    before = p.detach().clone()
    opt = optimizers.create("pogo", [p], lr=1e10, base="sgd")
    g = torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    message = _step(opt, p, g)
    assert "not finite" in message
    assert torch.equal(p.detach(), before)
    assert float(orthogonality_error(p.detach())) < 1e-12


def _procrustes():
    """A full-batch least-squares loss on St(32, 8) and a start (float64)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    b = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    x0 = Stiefel(32, 8).random(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return (lambda x: 0.5 * (a @ x - b).square().sum()), x0


def test_a_full_batch_run_takes_the_steps_pogo_torch_takes():
    # Note [POGO's basin]: the midpoint test was ‖MᴴM − I‖_F < 1, which refused a midpoint
    # with eigenvalues of MᴴM − I in [0.09, 0.69] (‖·‖_F = 1.06); the same step was then
    # refused at every iteration (a full-batch loss), and the run stood still with one
    # warning. The reference is pogo-torch on the same problem.
    loss, x0 = _procrustes()
    ours = geoopt.ManifoldParameter(x0.clone(), manifold=Stiefel(32, 8))
    theirs = torch.nn.Parameter(x0.T.clone()[None])
    opt = optimizers.create("pogo", [ours], lr=0.01, base="sgd", momentum=0.9)
    ref = pogo.POGO([theirs], pogo_base.SGD(momentum=0.9), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step is skipped
        for _ in range(60):
            opt.zero_grad(), ref.zero_grad()
            loss(ours).backward()
            loss(theirs[0].T).backward()
            opt.step(), ref.step()
    torch.testing.assert_close(ours.detach(), theirs.detach()[0].T, rtol=0, atol=1e-10)


def test_the_basin_test_is_the_eigenvalue_range_of_the_correction():
    # Note [POGO's basin]: eigenvalues of E = MᴴM − I in (−1, 1/λ); the reference is
    # eigvalsh of E, on Hermitian E drawn with eigenvalues on both sides of both ends
    from stiefel.optimizers.pogo import _within_basin

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float64, torch.complex128):
        for lam in (0.0, 0.25, 0.5, 1.0):
            top = 1 / lam if lam else 3.0  # λ = 0 (no correction): σ > 0 is the test
            q = torch.linalg.qr(torch.randn(400, 5, 5, dtype=dtype, generator=gen))[0]
            width = top + 1.4  # (−1.2, 1/λ + 0.2): both ends crossed
            ev = (torch.rand(400, 5, dtype=torch.float64, generator=gen) * width - 1.2).to(dtype)
            e = q @ torch.diag_embed(ev) @ q.mH
            spectrum = torch.linalg.eigvalsh(e)
            expected = spectrum.amin(-1) > -1
            if lam:
                expected &= spectrum.amax(-1) < 1 / lam
            assert 50 < int(expected.sum()) < 350  # both outcomes are drawn
            assert torch.equal(_within_basin(e, lam), expected)
    big = torch.full((2, 3, 3), 1e200, dtype=torch.float64)  # E² overflows
    assert not _within_basin(big, 0.5).any()


def test_a_resumed_run_is_the_uninterrupted_one_where_pogo_left_its_point_far():
    # Note [Off-manifold points at a step]: the second step leaves ‖XᴴX − I‖_F = 1.06 with
    # ‖XᴴX − I‖₂ < 1, inside POGO's basin; the point test was ‖·‖_F < 1, so a step that
    # tested the point (the first after load_state_dict) projected it and the resumed run
    # left the uninterrupted one (the reference)
    loss, x0 = _procrustes()

    def steps(w, opt, k):
        for _ in range(k):
            opt.zero_grad()
            loss(w).backward()
            opt.step()

    def fresh():
        w = geoopt.ManifoldParameter(x0.clone(), manifold=Stiefel(32, 8))
        return w, optimizers.create("pogo", [w], lr=0.01, base="sgd", momentum=0.9)

    w, opt = fresh()
    steps(w, opt, 2)
    assert float(orthogonality_error(w.detach())) > 1  # far, inside the basin
    saved, point = opt.state_dict(), w.detach().clone()
    steps(w, opt, 3)
    w2, opt2 = fresh()
    with torch.no_grad():
        w2.copy_(point)
    opt2.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing projected
        steps(w2, opt2, 3)
    torch.testing.assert_close(w2.detach(), w.detach(), rtol=0, atol=1e-12)


def test_a_correction_of_zero_steps_without_a_basin_above():
    # λ = 0 (allowed: no correction) divided by zero in the basin test
    st = Stiefel(10, 3)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = optimizers.create("pogo", [w], lr=0.01, base="sgd", lam=0.0)
    g = torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    half = 0.005 * (g @ (x.T @ x) - x @ (g.T @ x))  # M = X − lr·ψ, kept as it is
    torch.testing.assert_close(w.detach(), x - half, rtol=0, atol=1e-14)


def test_a_step_skipped_for_an_infinite_gradient_reads_once():
    # a non-finite midpoint failed the short basin test and stepped its bucket again on
    # the exact path (three reads) only to skip it; the reference is the one read of a
    # step whose tests all pass
    from stiefel.benchmarks.launch import StepCounter

    st = Stiefel(10, 3)
    ws = [geoopt.ManifoldParameter(st.random(dtype=torch.float32), manifold=st) for _ in range(4)]
    opt = optimizers.create("pogo", ws, lr=0.01)
    reads = []
    for k in range(3):
        for w in ws:
            w.grad = torch.full_like(w, math.inf) if k == 1 else torch.randn_like(w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with StepCounter(opt) as count:
                opt.step()
        reads.append(count.reads)
    assert reads == [1, 1, 1]


def test_a_tensor_lam_steps_as_a_float_one_through_the_exact_path():
    # the basin test branched on λ (`if lam`), a read of a tensor λ; the reference is the
    # same run with a float λ, through the steps whose short path fails (Procrustes)
    loss, x0 = _procrustes()

    def run(lam) -> torch.Tensor:
        w = geoopt.ManifoldParameter(x0.clone(), manifold=Stiefel(32, 8))
        opt = optimizers.create("pogo", [w], lr=0.01, base="sgd", momentum=0.9, lam=lam)
        for _ in range(4):
            opt.zero_grad()
            loss(w).backward()
            opt.step()
        return w.detach()

    torch.testing.assert_close(
        run(torch.tensor(0.5, dtype=torch.float64)), run(0.5), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="lam=2.0"):
        from stiefel.optimizers.pogo import pogo_step

        pogo_step(x0, x0, 0.1, lam=2.0)
