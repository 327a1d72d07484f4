"""A step is a transaction, and the float32 master follows a parameter replaced from outside.

- a bfloat16 manifold weight replaced by a checkpoint's (``load_state_dict``, ``copy_``,
  `stiefel.parametrizations.initialize`) is stepped from the new weights, not from the
  optimizer's stale float32 master (Note [The master follows its parameter]);
- an optimizer state loaded with its weights keeps its (more precise) master;
- a rule that raises on the second parameter of a group leaves the first unmoved and
  every state as it was (Note [Safe step]).
"""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.manifolds.kernels import orthogonality_error


def _layer(st, dtype, seed):
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(seed)
    module.w = geoopt.ManifoldParameter(
        st.random(dtype=torch.float32, generator=gen).to(dtype), manifold=st
    )
    return module


def _replace(module, how, new):
    if how == "load_state_dict":
        module.load_state_dict({"w": new})
    elif how == "copy_":
        with torch.no_grad():
            module.w.copy_(new)
    elif how == "data=":  # a new storage, the version counter as it was
        module.w.data = new.clone()
    elif how == "vector_to_parameters":  # torch's utility assigns `.data`
        torch.nn.utils.vector_to_parameters(new.reshape(-1).clone(), [module.w])
    else:  # the deferred-initialisation recipe: a fresh valid point, in place
        from stiefel.parametrizations import initialize

        with torch.no_grad():
            module.w.zero_()
        initialize(module)


@pytest.mark.parametrize(
    "how", ["load_state_dict", "copy_", "data=", "vector_to_parameters", "initialize"]
)
@pytest.mark.parametrize("name", ["rgd", "radam", "manifold_muon"])
def test_low_precision_weight_replaced_from_outside_is_stepped_from_the_new_value(name, how):
    n, m, lr = 48, 4, 1e-3
    st = Stiefel(n, m)
    module = _layer(st, torch.bfloat16, 0)
    opt = optimizers.create(name, [module.w], lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):  # a trained optimizer: its master holds these weights
        module.w.grad = torch.randn(n, m, generator=gen).to(torch.bfloat16)
        opt.step()
    new = st.random(dtype=torch.float32, generator=gen).to(torch.bfloat16)
    _replace(module, how, new)
    loaded = module.w.detach().clone()
    assert float(orthogonality_error(loaded.double())) < 0.05  # a point of St
    for group in opt.param_groups:
        group["lr"] = lr
    module.w.grad = torch.randn(n, m, generator=gen).to(torch.bfloat16)
    opt.step()
    # one step moves an entry by about lr·|ξᵢⱼ| (≤ 1e-2 here: rgd lr·ξ, radam and muon
    # steps of norm ~lr), plus the bfloat16 rounding of entries ≤ 1 (eps/2): far below
    # the 0.7–0.9 of a step taken from the old master
    moved = float((module.w.detach().double() - loaded.double()).abs().max())
    assert moved < 10 * lr + float(torch.finfo(torch.bfloat16).eps)
    master = opt.state[module.w]["master"]
    assert float((master.double() - loaded.double()).abs().max()) < 0.05


def test_state_loaded_with_its_weights_keeps_the_float32_master():
    st = Stiefel(32, 3)
    module = _layer(st, torch.bfloat16, 2)
    opt = optimizers.create("radam", [module.w], lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        module.w.grad = torch.randn(32, 3, generator=gen).to(torch.bfloat16)
        opt.step()
    saved_weights, saved_opt = module.state_dict(), opt.state_dict()
    master = opt.state[module.w]["master"].clone()
    assert not torch.equal(master, master.to(torch.bfloat16).float())  # finer than bf16

    resumed = _layer(st, torch.bfloat16, 7)
    opt2 = optimizers.create("radam", [resumed.w], lr=0.05)
    resumed.load_state_dict(saved_weights)
    opt2.load_state_dict(saved_opt)
    g = torch.randn(32, 3, generator=gen).to(torch.bfloat16)
    module.w.grad, resumed.w.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(opt2.state[resumed.w]["master"], opt.state[module.w]["master"])
    assert torch.equal(resumed.w.detach(), module.w.detach())


@pytest.mark.parametrize("name,key", [("rgd", "momentum_buffer"), ("radam", "exp_avg")])
def test_a_rule_raising_on_the_second_parameter_moves_nothing(name, key):
    st = Stiefel(10, 3)
    gen = torch.Generator().manual_seed(4)
    ws = [
        geoopt.ManifoldParameter(st.random(dtype=torch.float64, generator=gen), manifold=st)
        for _ in range(3)
    ]
    hyper = dict(momentum=0.5) if name == "rgd" else {}
    opt = optimizers.create(name, ws, lr=0.1, **hyper)
    for _ in range(2):
        for w in ws:
            w.grad = torch.randn(10, 3, dtype=torch.float64, generator=gen)
        opt.step()
    opt.state[ws[1]][key] = torch.zeros(7, 7, dtype=torch.float64)  # a corrupted state
    points = [w.detach().clone() for w in ws]
    states = [{k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)} for w in ws]
    for w in ws:
        w.grad = torch.randn(10, 3, dtype=torch.float64, generator=gen)
    with pytest.raises(RuntimeError):
        opt.step()
    for w, p0, s0 in zip(ws, points, states, strict=True):
        assert torch.equal(w.detach(), p0)
        tensors = {k: v for k, v in opt.state[w].items() if torch.is_tensor(v)}
        assert sorted(tensors) == sorted(s0)
        for k, v in tensors.items():
            assert torch.equal(v, s0[k]), k


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64]
)
def test_finite_is_isfinite_all_for_every_bad_entry(dtype):
    """`finite` (one aminmax, Note [Finiteness in one pass]) against ``isfinite(t).all()``."""
    from stiefel.optimizers.engine import finite, finite_gradient

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=gen).to(dtype)
    assert bool(finite(x)) and bool(finite(x[:, :0])) and bool(finite(x.mT))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in range(x.numel()):
            y = x.clone()
            y.view(-1)[i] = complex(0.0, bad) if dtype.is_complex else bad
            assert not bool(finite(y)) and not bool(torch.isfinite(y).all())
            assert not bool(finite(y.mT))  # a transposed layout too
    # a single real matrix: the test from its max |G| (Note [One pass over the gradient
    # for its test and its scale])
    if dtype.is_floating_point:
        g = x[0]
        ok, absmax = finite_gradient(g)
        assert bool(ok) and float(absmax) == float(g.abs().max())
        for bad in (float("nan"), float("inf"), float("-inf")):
            h = g.clone()
            h[2, 1] = bad
            assert not bool(finite_gradient(h)[0])


def test_memory_order_is_a_contiguous_view_of_every_dense_layout():
    """Note [Reductions over all entries in memory order]: permuted, never copied."""
    from stiefel.manifolds.kernels.reduce import memory_order

    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, 4, 5, generator=gen)
    for dims in ((0, 1, 3, 2), (3, 2, 1, 0), (1, 0, 2, 3), (2, 0, 3, 1)):
        t = base.permute(dims)
        d = memory_order(t)
        assert d.is_contiguous() and d.data_ptr() == t.data_ptr()
        assert torch.equal(d.flatten().sort().values, t.flatten().sort().values)
    for t in (base[:, :, ::2], base[:, :1].expand(2, 3, 4, 5), base.mT[..., 1:]):
        assert memory_order(t) is t  # not dense: left as it is (the reduction copies)


def test_finite_reads_a_column_major_batch_without_a_copy():
    # points from torch.linalg.qr are stored by columns, and their gradients like them
    from torch.autograd.profiler import profile

    from stiefel.optimizers.engine import finite

    x = torch.linalg.qr(torch.randn(8, 6, 3, generator=torch.Generator().manual_seed(2)))[0]
    assert not x.is_contiguous()
    with profile() as prof:
        ok = finite(x)
    names = {e.name for e in prof.function_events}
    assert bool(ok) and "aten::clone" not in names and "aten::contiguous" not in names
    y = x.clone()
    y[5, 4, 1] = float("nan")
    assert not bool(finite(y))
