"""radam's second moment cannot overflow (issue 13, Note [Second moment in scaled form]).

⟨ξ, ξ⟩ of a float32 gradient ≥ ~1e19 is past float32's range; radam keeps v in a
scaled form. References: a plain float64 Adam on the manifold written here (where
1e30² is representable) and torch's own float64 Adam for plain tensors.
"""

from __future__ import annotations

import math

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel


def _assert_state_finite(opt):
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.isfinite(value).all(), key


def _true_v(state, key="exp_avg_sq"):
    """v itself (float64), from its scaled form."""
    scale = state.get("exp_avg_sq_scale", torch.ones(()))
    return state[key].double() * scale.double() ** 2


def _sym(a):
    return 0.5 * (a + a.mT)


def _qf(a):
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(-2)


class _ReferenceAdam:
    """Riemannian Adam on St(N, M) in float64: Euclidean metric, QR retraction,
    momentum transported by projection (the formulas of radam's docstring)."""

    def __init__(self, x, lr, betas=(0.9, 0.999), eps=1e-8):
        self.x, self.lr, self.betas, self.eps = x.double().clone(), lr, betas, eps
        self.m = torch.zeros_like(self.x)
        self.v, self.t = 0.0, 0

    def step(self, g):
        b1, b2 = self.betas
        x, self.t = self.x, self.t + 1
        xi = g - x @ _sym(x.mT @ g)
        self.m = b1 * self.m + (1 - b1) * xi
        self.v = b2 * self.v + (1 - b2) * float((xi * xi).sum())
        mhat, vhat = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
        y = _qf(x - self.lr * mhat / (vhat**0.5 + self.eps))
        self.m = self.m - y @ _sym(y.mT @ self.m)
        self.x = y


def _loss_grad(w, target):
    """½‖W − T‖²_F and its Euclidean gradient (float64)."""
    d = w.detach().double() - target
    return 0.5 * float((d * d).sum()), d


# dtype, burst sizes B, betas, steps: the bursts' squares are past the dtype's range;
# the betas are small (β₁² < β₂, as Adam needs) so that m and v forget the burst
# within the run: v ~ B² needs ln(B²)/ln(1/β₂) steps (with β₂ = 0.999, ~1e5 steps,
# as in exact arithmetic: Adam's memory, not an overflow)
BURSTS = [
    (torch.float32, (1e20, 1e30), (0.3, 0.5), 450),
    (torch.float64, (1e160, 1e170), (0.1, 0.2), 650),
]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype,bursts,betas,steps", BURSTS)
def test_huge_then_ordinary_gradients_stiefel(amsgrad, dtype, bursts, betas, steps):
    man = Stiefel(16, 4)
    gen = torch.Generator().manual_seed(0)
    w = geoopt.ManifoldParameter(man.random(dtype=dtype, generator=gen), manifold=man)
    target = man.random(dtype=torch.float64, generator=gen)
    opt = optimizers.create("radam", [w], lr=0.05, betas=betas, amsgrad=amsgrad)
    tol = 10 * 16 * torch.finfo(dtype).eps
    for scale in bursts:
        x0 = w.detach().clone()
        w.grad = scale * torch.randn(w.shape, dtype=dtype, generator=gen).clamp(-3, 3)
        opt.step()
        assert torch.isfinite(w).all()
        assert float(man.orthogonality_error(w.detach())) <= tol
        assert float((w.detach() - x0).abs().max()) > 1e-3  # a real step of length lr
        _assert_state_finite(opt)
    # v holds ~(1 − β₂)·B², past the dtype's range
    state = opt.state[w]
    log2_v = state["exp_avg_sq"].double().log2() + 2 * state["exp_avg_sq_scale"].double().log2()
    assert float(log2_v.min()) > math.frexp(torch.finfo(dtype).max)[1]
    after_burst, _ = _loss_grad(w, target)
    for _ in range(20 if amsgrad else steps):  # amsgrad keeps the burst: a few steps
        _, g = _loss_grad(w, target)
        w.grad = g.to(dtype)
        opt.step()
        _assert_state_finite(opt)
    final, _ = _loss_grad(w, target)
    assert float(man.orthogonality_error(w.detach())) <= tol
    if amsgrad:  # the running maximum keeps the burst: the steps stay tiny, never inf/NaN
        assert float(opt.state[w]["exp_avg_sq_scale"]) > 1.0
    else:  # recovered: the loss went down once v forgot the burst
        assert final < 0.5 * after_burst, (after_burst, final)
        assert float(opt.state[w]["exp_avg_sq_scale"]) == 1.0  # back to the unscaled form


# the bursts' squares overflow float32 (1e30² = 1e60); in float64 1e100² does not,
# so the float64 case checks that the scaled form leaves ordinary float64 alone
@pytest.mark.parametrize("dtype,big", [(torch.float32, 1e30), (torch.float64, 1e100)])
def test_matches_float64_reference_through_bursts(dtype, big):
    man = Stiefel(16, 4)
    gen = torch.Generator().manual_seed(1)
    x0 = man.random(dtype=dtype, generator=gen)
    w = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    opt = optimizers.create("radam", [w], lr=0.05, retraction="qr")
    ref = _ReferenceAdam(x0, lr=0.05)
    for k, scale in enumerate([1.0, 1.0, 1e20, big, 1.0, 1.0, 1e-3, 1.0]):
        g = torch.randn(w.shape, dtype=dtype, generator=gen) * scale
        w.grad = g
        opt.step()
        ref.step(g.double())
        tol = 100 * torch.finfo(dtype).eps
        assert float((w.detach().double() - ref.x).abs().max()) < tol, (k, scale)
        v = float(_true_v(opt.state[w]))
        assert abs(v - ref.v) <= 1e-5 * ref.v, (k, v, ref.v)
        _assert_state_finite(opt)


def test_plain_tensor_matches_torch_adam_in_float64():
    """Plain tensors get torch's Adam, per-entry v; entries of 1e30 next to 1."""
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(6, 3, generator=gen)
    ours = torch.nn.Parameter(x0.clone())
    theirs = torch.nn.Parameter(x0.double().clone())
    opt = optimizers.create("radam", [ours], lr=0.01)
    ref = torch.optim.Adam([theirs], lr=0.01)
    for k in range(6):
        g = torch.randn(6, 3, generator=gen)
        if k in (1, 3):
            g[0] *= 1e30
            g[1] *= 1e20
        ours.grad, theirs.grad = g.clone(), g.double()
        opt.step()
        ref.step()
        _assert_state_finite(opt)
        assert torch.allclose(ours.detach().double(), theirs.detach(), rtol=0, atol=1e-5), k
        v_ref = ref.state[theirs]["exp_avg_sq"]
        assert torch.allclose(_true_v(opt.state[ours]), v_ref, rtol=1e-5, atol=0), k


def test_state_saved_before_the_scale_existed_loads_and_steps_the_same():
    """A state dict without `exp_avg_sq_scale` (saved by an earlier version) means scale 1."""
    man = Stiefel(10, 3)
    gen = torch.Generator().manual_seed(3)
    x0 = man.random(dtype=torch.float32, generator=gen)
    grads = [torch.randn(10, 3, generator=gen) for _ in range(5)]
    w = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    opt = optimizers.create("radam", [w], lr=0.05, amsgrad=True)
    for g in grads[:2]:
        w.grad = g.clone()
        opt.step()
    saved = opt.state_dict()
    old = {**saved, "state": {0: {k: v for k, v in saved["state"][0].items() if "scale" not in k}}}
    w2 = geoopt.ManifoldParameter(w.detach().clone(), manifold=man)
    opt2 = optimizers.create("radam", [w2], lr=0.05, amsgrad=True)
    opt2.load_state_dict(old)
    for g in grads[2:]:
        w.grad, w2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
        assert torch.equal(w.detach(), w2.detach())
