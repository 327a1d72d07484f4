"""A Riemannian weight keeps its manifold through torch's recipes that rebuild Parameters
(Note [The manifold lives on the module]): each step is checked against the step of the
same optimizer on a weight that was never rebuilt."""

from __future__ import annotations

import copy
import io
import warnings

import geoopt
import pytest
import torch
from torch import nn

from stiefel import optimizers, orthogonalize
from stiefel.manifolds import Stiefel
from stiefel.parametrizations import initialize

TOL = 100 * 12 * torch.finfo(torch.float64).eps  # a few float64 steps on St(12, 4)


def _layer(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return orthogonalize(nn.Linear(4, 12, dtype=torch.float64), method="riemannian")


def _train(layer: nn.Module, params, steps: int = 5) -> torch.Tensor:
    opt = optimizers.create("rgd", params, lr=0.1)
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        (layer(x) ** 2).sum().backward()
        opt.step()
    return layer.weight.detach().clone()


def _err(w: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(w.T @ w - torch.eye(w.shape[1], dtype=w.dtype)))


def _rebuilt(how: str) -> nn.Linear:
    """``_layer(0)``'s values in a layer whose weight Parameter the recipe ``how`` rebuilt."""
    ref = _layer(0)
    if how == "assign":
        layer = _layer(5)
        layer.load_state_dict(ref.state_dict(), assign=True)
    elif how == "deepcopy":
        layer = copy.deepcopy(ref)
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(ref, buf)
        buf.seek(0)
        layer = torch.load(buf, weights_only=False)
    else:  # built on meta, to_empty (a new Parameter), then the values loaded
        with torch.device("meta"):
            layer = orthogonalize(nn.Linear(4, 12, dtype=torch.float64), method="riemannian")
        layer.to_empty(device="cpu")
        layer.load_state_dict(ref.state_dict())
    return layer


@pytest.mark.parametrize("how", ["assign", "deepcopy", "torch.save", "to_empty"])
@pytest.mark.parametrize("given", ["parameters", "model"])
def test_rebuilt_weight_is_stepped_on_its_manifold(how, given):
    want = _train(ref := _layer(0), ref.parameters())
    layer = _rebuilt(how)
    got = _train(layer, layer.parameters() if given == "parameters" else layer)
    assert isinstance(layer.weight, geoopt.ManifoldParameter)
    assert _err(got) < TOL
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("how", ["assign", "deepcopy", "torch.save", "to_empty"])
def test_a_rebuilt_weight_stepped_before_any_forward_is_stepped_on_its_manifold(how):
    """Gradients set by hand, no forward: the optimizer built from a bare parameter list
    still finds the manifold (Note [A rebuilt weight stepped before any forward]); the
    reference is the never-rebuilt layer stepped with the same gradients."""
    g = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = []
    for layer in (_layer(0), _rebuilt(how)):
        opt = optimizers.create("rgd", list(layer.parameters()), lr=0.1)
        for _ in range(3):
            layer.weight.grad = g.clone()
            layer.bias.grad = torch.ones_like(layer.bias)
            opt.step()
        got.append(layer.weight.detach())
    assert _err(got[1]) < TOL
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=1e-12)


def test_a_torch_optimizer_is_warned_about_a_rebuilt_weight_before_any_forward():
    layer = _rebuilt("assign")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.weight.grad = torch.ones_like(layer.weight)
    with pytest.warns(UserWarning, match="SGD is not a Riemannian optimizer"):
        opt.step()


def test_to_empty_then_reset_parameters_gives_a_point():
    with torch.device("meta"):
        layer = orthogonalize(nn.Linear(4, 12, dtype=torch.float64), method="riemannian")
    layer.to_empty(device="cpu")
    layer.reset_parameters()  # nn.Linear's own reset: not a point; projected at first use
    got = _train(layer, layer.parameters(), steps=3)
    assert _err(got) < TOL


@pytest.mark.parametrize("fill", [float("nan"), 0.0])
def test_uninitialised_memory_is_refused_at_first_use(fill):
    with torch.device("meta"):
        model = nn.Sequential(orthogonalize(nn.Linear(4, 12), method="riemannian"))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model[0].weight.fill_(fill)
    with pytest.raises(ValueError, match=r"Linear\.weight .*reset_parameters\(\) or .*initialize"):
        model(torch.randn(2, 4))
    initialize(model)  # finds the rebuilt weight through its module
    assert _err(model[0].weight.detach().double()) < 10 * 4 * torch.finfo(torch.float32).eps


def test_a_real_weight_made_complex_is_refused():
    layer = _layer()
    layer.to(torch.complex128)
    with pytest.raises(TypeError, match="real manifold"):
        layer(torch.randn(2, 4, dtype=torch.complex128))


def test_a_torch_optimizer_stepping_a_manifold_weight_is_warned_about():
    layer = _layer()
    opt = torch.optim.Adam(layer.parameters())
    (layer(torch.randn(3, 4, dtype=torch.float64)) ** 2).sum().backward()
    with pytest.warns(UserWarning, match="Adam is not a Riemannian optimizer"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        opt.step()
        fresh = _layer()
        (fresh(torch.randn(3, 4, dtype=torch.float64)) ** 2).sum().backward()
        optimizers.create("rgd", fresh.parameters(), lr=0.1).step()  # Riemannian: silent


def _dtensor_weights_are_marked() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    lin = nn.Linear(4, 12, dtype=torch.float64)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Replicate()]))
    orthogonalize(lin, method="riemannian")  # TypeError on __class__ before
    w = lin.weight
    assert w.manifold is not None and _err(w.full_tensor()) < TOL
    lin2 = nn.Linear(4, 12, dtype=torch.float64)
    lin2.weight = nn.Parameter(distribute_tensor(lin2.weight.detach(), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="allowed there: 'nearest'"):
        orthogonalize(lin2, method="riemannian", init="haar")


def test_a_dtensor_weight_is_marked_not_reclassed():
    import gc

    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh single-process gloo group")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        _dtensor_weights_are_marked()
    finally:
        # the mesh and weights die before the group (Note [Nothing of a run outlives its
        # process group] in tests/distributed/_launch.py)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("given", ["parameters", "model"])
def test_module_to_device_keeps_the_manifold(device, given):
    """``layer.to(device)`` after ``orthogonalize``: the steps there equal the CPU steps."""
    want = _train(ref := _layer(0), ref.parameters())
    layer = _layer(0).to(device)
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opt = optimizers.create("rgd", layer.parameters() if given == "parameters" else layer, lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        (layer(x.to(device)) ** 2).sum().backward()
        opt.step()
    assert isinstance(layer.weight, geoopt.ManifoldParameter)
    assert layer.weight.device.type == torch.device(device).type
    got = layer.weight.detach().cpu()
    assert _err(got) < TOL
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_compiled_forward_keeps_the_manifold_hook():
    """``torch.compile(layer, fullgraph=True)``: the binding pre-hook traces without a break,
    and training the compiled layer gives the eager steps."""
    want = _train(ref := _layer(0), ref.parameters())
    layer = _layer(0)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = _train(compiled, layer.parameters())
    assert isinstance(layer.weight, geoopt.ManifoldParameter)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_a_point_loaded_off_its_manifold_is_refused_at_the_next_forward():
    # Note [A point loaded off its manifold]: a dense matrix in the state dict is no point
    torch.manual_seed(0)
    lin = orthogonalize(torch.nn.Linear(4, 10, dtype=torch.float64), method="riemannian")
    good = {k: v.clone() for k, v in lin.state_dict().items()}
    x = torch.randn(2, 4, dtype=torch.float64)
    lin.load_state_dict({"weight": torch.randn(10, 4, dtype=torch.float64), "bias": good["bias"]})
    for _ in range(2):  # refused until a point is there
        with pytest.raises(ValueError, match=r"weight was loaded off its manifold .* > 0.5"):
            lin(x)
    drifted = good["weight"] * (1 + 1e-4)  # rounding-sized drift: a point to the optimizers
    lin.load_state_dict({"weight": drifted, "bias": good["bias"]})
    assert torch.equal(lin(x), torch.nn.functional.linear(x, drifted, good["bias"]))
    lin.load_state_dict(good)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, good["weight"], good["bias"]))


def test_a_torch_optimizer_stepping_a_hand_made_manifold_parameter_is_warned_about():
    # the guard was registered only by orthogonalize: a point built by hand with this
    # package's manifold left it under torch's Adam without a word
    import subprocess
    import sys

    code = (
        "import warnings, torch, geoopt\n"
        "from stiefel.manifolds import Stiefel\n"
        "st = Stiefel(8, 3)\n"
        "w = geoopt.ManifoldParameter(st.random(), manifold=st)\n"
        "opt = torch.optim.Adam([w], lr=0.1)\n"
        "w.grad = torch.randn_like(w)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    opt.step()\n"
        "assert any('Adam is not a Riemannian optimizer' in str(x.message) for x in seen)\n"
    )
    # a fresh process: this one registered the guard long ago (orthogonalize in other tests)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_rebuilt_weights_are_restored_in_the_order_of_the_parameters(monkeypatch):
    # restoring a row-sharded weight runs collectives, which every rank must run in one
    # order: the modules were visited in the order of a weak set (object addresses), which
    # differed between processes, and FSDP2 ranks aborted on a collective mismatch
    from stiefel.manifolds import binding

    layers = [_rebuilt("to_empty") for _ in range(8)]
    seen = []
    monkeypatch.setattr(binding, "restore", lambda module: seen.append(module))
    params = [p for layer in reversed(layers) for p in layer.parameters()]
    binding.claim(params)
    assert [layers.index(m) for m in seen] == list(range(7, -1, -1))


def test_an_unhashable_torch_optimizer_steps_and_is_still_guarded():
    # the guard kept what it saw in a weak dictionary keyed by the optimizer: a torch
    # optimizer class with __eq__ and no __hash__ (no stiefel parameter in it) failed at
    # its first step once stiefel was imported; the reference is torch's SGD step
    class Compared(torch.optim.SGD):
        def __eq__(self, other):
            return self is other

    w = nn.Parameter(torch.randn(3))
    ref = w.detach().clone()
    w.grad = torch.ones(3)
    Compared([w], lr=0.1).step()
    torch.testing.assert_close(w.detach(), ref - 0.1, rtol=0, atol=0)
    lin = orthogonalize(nn.Linear(4, 6), method="riemannian")
    opt = Compared(lin.parameters(), lr=0.1)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning, match="not a Riemannian optimizer"):
        opt.step()


def test_a_hand_made_point_replaced_by_a_plain_parameter_is_left_plain():
    # the record made when the ManifoldParameter was registered outlived it: the user's
    # plain (8, 8) Parameter was re-classed and projected at the next forward (3.1 off);
    # load_state_dict(assign=True), which rebuilds the Parameter, keeps the record
    st = Stiefel(8, 4)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)

        def forward(self, x):
            return x @ self.w

    m = Holder()
    new = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    before = new.detach().clone()
    m.w = new
    m(torch.randn(2, 8, dtype=torch.float64))
    assert type(m.w) is torch.nn.Parameter and torch.equal(m.w.detach(), before)
    loaded = Holder()
    loaded.load_state_dict(
        {"w": st.random(dtype=torch.float64).as_subclass(torch.Tensor)}, assign=True
    )
    loaded(torch.randn(2, 8, dtype=torch.float64))
    assert isinstance(loaded.w, geoopt.ManifoldParameter) and loaded.w.manifold is st
