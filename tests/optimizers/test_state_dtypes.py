"""A state saved in one dtype loads into a model of another, as torch's optimizers' does.

torch's ``load_state_dict`` casts floating state to the parameter's dtype; this
package keeps two kinds of state in a dtype of their own (the float32 master and
moments of a low-precision parameter, pogo's float64 second moment,
`stiefel.optimizers.master.restore_dtypes`) and casts the rest as torch does.
"""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel

PAIRS = [(torch.float32, torch.float64), (torch.float64, torch.float32)]


def _riemannian():
    return [
        n
        for n in optimizers.available()
        if isinstance(c := optimizers.get(n), type)
        and issubclass(c, optimizers.RiemannianOptimizer)
    ]


def _run(make, param, grads):
    opt = make([param])
    for g in grads:
        param.grad = g.to(param.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("src,dst", PAIRS)
@pytest.mark.parametrize(
    "ours,theirs",
    [
        (dict(name="radam", lr=0.1), lambda ps: torch.optim.Adam(ps, lr=0.1)),
        (
            dict(name="radam", lr=0.1, amsgrad=True),
            lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
        ),
        (
            dict(name="rgd", lr=0.1, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        ),
    ],
)
def test_a_plain_tensor_resumed_in_another_dtype_steps_as_torchs_optimizer(src, dst, ours, theirs):
    # torch's own optimizer, saved and loaded the same way, is the reference
    hyper = dict(ours)
    name = hyper.pop("name")
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(5)]
    results = []
    for make in (lambda ps: optimizers.create(name, ps, **hyper), theirs):
        p = torch.nn.Parameter(x0.to(src, copy=True))
        saved = _run(make, p, grads[:3]).state_dict()
        q = torch.nn.Parameter(p.detach().to(dst))
        opt = make([q])
        opt.load_state_dict(saved)
        for g in grads[3:]:
            q.grad = g.to(dst)
            opt.step()
        assert all(
            v.dtype == dst for k, v in opt.state[q].items() if k != "step" and torch.is_tensor(v)
        )
        results.append(q.detach())
    # the two differ by the rounding of their own operations, in the coarser dtype
    coarse = max(torch.finfo(src).eps, torch.finfo(dst).eps)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=100 * coarse)


@pytest.mark.parametrize("name", _riemannian())
@pytest.mark.parametrize(
    "src,dst", PAIRS + [(torch.float64, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_a_manifold_weight_resumed_in_another_dtype_keeps_each_state_in_its_dtype(name, src, dst):
    st = Stiefel(24, 4)
    gen = torch.Generator().manual_seed(1)
    x0 = st.random(dtype=torch.float64, generator=gen)
    grads = [torch.randn(24, 4, generator=gen, dtype=torch.float64) for _ in range(6)]
    p = geoopt.ManifoldParameter(x0.to(src, copy=True), manifold=st)
    saved = _run(lambda ps: optimizers.create(name, ps, lr=1e-2), p, grads[:3]).state_dict()
    q = p.detach().to(dst)
    if torch.finfo(src).eps > torch.finfo(dst).eps:  # a coarser point is off the finer manifold:
        q = st.projx(q)  # projected, as the optimizers' refusal of it says
    q = geoopt.ManifoldParameter(q, manifold=st)
    opt = optimizers.create(name, [q], lr=1e-2)
    opt.load_state_dict(saved)
    for g in grads[3:]:
        q.grad = g.to(dst)
        opt.step()  # before: "expected dtype float for 'end' but got dtype double"
    low = dst in (torch.float16, torch.bfloat16)
    for key, value in opt.state[q].items():
        if not torch.is_tensor(value) or key == "step" or not value.is_floating_point():
            continue
        want = torch.float64 if key in opt.wide_state else torch.float32 if low else dst
        assert value.dtype == want, (key, value.dtype)
    assert ("master" in opt.state[q]) == low
    point = opt.state[q]["master"] if low else q.detach()
    tol = 100 * 4 * torch.finfo(point.dtype).eps
    if not opt.feasible:  # landing and pogo stay near the manifold, not on it
        tol = 1e-2
    assert float(st.orthogonality_error(point.double())) < tol
