"""torch's deferred-initialisation recipe (FSDP2's): meta, to_empty, reset_parameters on every
module; never-initialised or unusable free parameters are refused at first use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stiefel
from stiefel.parametrizations import initialize, maps, orthogonalize

F32 = torch.float32
METHODS = [*maps(), "riemannian"]


def err64(q: torch.Tensor) -> float:
    q = q.detach().double()
    q = q.mT if q.shape[-2] < q.shape[-1] else q
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return float(torch.linalg.matrix_norm(q.mT @ q - eye).max())


def kernel_matrix(conv: nn.Conv2d) -> torch.Tensor:
    w = conv.weight.detach().double()
    return w.reshape(w.shape[0], -1).T * w[0, 0].numel() ** 0.5


class Net(nn.Module):
    def __init__(self, method: str):
        super().__init__()
        plain = method != "riemannian"  # riemannian linear weights: the lead's part
        self.square = orthogonalize(nn.Linear(6, 6), method=method) if plain else nn.Linear(6, 6)
        self.wide = orthogonalize(nn.Linear(6, 4), method=method) if plain else nn.Linear(6, 4)
        self.conv = orthogonalize(nn.Conv2d(2, 3, 3, padding=1), method=method, conv_kernel=True)
        self.rot = stiefel.rotate(nn.Linear(6, 4), method=method, blocks=2)


def _hostile(net: nn.Module) -> None:
    """What to_empty leaves: uninitialised memory, here made NaN."""
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))


@pytest.mark.parametrize("method", METHODS)
def test_torch_recipe_gives_a_valid_point(method):
    with torch.device("meta"):
        net = Net(method)
    net.to_empty(device="cpu")
    _hostile(net)
    with pytest.raises(ValueError, match=r"not finite.*initialize\(model\).*reset_parameters"):
        _ = net.conv.weight  # first use of garbage is refused, naming the fix
    with pytest.raises(ValueError, match="initialize"):
        net.rot(torch.randn(2, 6))
    torch.manual_seed(0)
    for module in net.modules():  # FSDP2's documented recipe
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    tol = 100 * 18 * torch.finfo(F32).eps
    assert err64(kernel_matrix(net.conv)) <= tol
    if method != "riemannian":
        assert err64(net.square.weight) <= tol and err64(net.wide.weight) <= tol
        assert torch.isfinite(net.square.bias).all()  # the module's own reset ran too
    x = torch.randn(3, 6)
    rot = net.rot
    assert torch.isfinite(rot.weight).all()
    assert torch.allclose(stiefel.rotation(rot), torch.eye(6), atol=1e-6)  # Q = I again
    assert torch.allclose(rot(x), F.linear(x, rot.weight, rot.bias), atol=1e-5)


def test_rotate_under_meta_then_base_weights_loaded():
    torch.manual_seed(0)
    ref = nn.Linear(8, 5)
    with torch.device("meta"):
        layer = stiefel.rotate(nn.Linear(8, 5), method="cwy", reflections=4)
    layer.to_empty(device="cpu")
    _hostile(layer)
    with torch.no_grad():  # the base weights come from a checkpoint
        layer.weight.copy_(ref.weight)
        layer.bias.copy_(ref.bias)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="initialize"):
        layer(x)
    initialize(layer)
    assert torch.allclose(layer(x), ref(x), atol=1e-5)


def test_reset_parameters_draws_fresh_points_and_keeps_the_given_init():
    lin = orthogonalize(nn.Linear(5, 5), method="cwy", init="identity")
    with torch.no_grad():
        lin.parametrizations.weight.original.add_(1.0)
    lin.reset_parameters()
    assert torch.allclose(lin.weight, torch.eye(5), atol=1e-6)
    lin2 = orthogonalize(nn.Linear(5, 5), method="exp")
    before = lin2.weight.detach().clone()
    lin2.reset_parameters()  # "nearest": a fresh random point (Haar), like torch's reset
    assert not torch.allclose(lin2.weight, before) and err64(lin2.weight) < 1e-5


@pytest.mark.parametrize("method", ["householder", "cwy", "tcwy"])
@pytest.mark.parametrize("zeros", ["column", "all"])
def test_checkpoint_with_a_zero_reflection_is_refused(method, zeros):
    lin = orthogonalize(nn.Linear(4, 6), method=method)
    state = lin.state_dict()
    v = state["parametrizations.weight.original"]
    if zeros == "column":
        v[:, 1] = 0
    else:
        v.zero_()
    fresh = orthogonalize(nn.Linear(4, 6), method=method)
    _ = fresh.weight  # verified once: the load must make it check again
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match=r"Linear\.weight.*reflection vectors.*are zero"):
        fresh(torch.randn(2, 4))


@pytest.mark.parametrize("method", ["exp", "cayley"])
def test_low_precision_round_trip_of_the_base(method):
    torch.manual_seed(0)
    n = 16
    lin = orthogonalize(nn.Linear(n, n), method=method, init="haar")
    lin.bfloat16().float()
    bound = 10 * n * torch.finfo(F32).eps
    assert err64(lin.weight) <= bound
    bf16 = orthogonalize(nn.Linear(n, n, dtype=torch.bfloat16), method=method, init="haar")
    target = orthogonalize(nn.Linear(n, n), method=method)
    target.load_state_dict(bf16.state_dict())  # a bf16 checkpoint into a float32 module
    assert err64(target.weight) <= bound
    assert (target.weight - bf16.weight.float()).abs().max() < 2e-2  # the same point


def test_reset_of_a_module_writing_into_an_identity_maps_original():
    """nn.LSTM's own reset writes uniform_ into weight_hh_l0, a view of a riemannian original."""
    lstm = orthogonalize(nn.LSTM(4, 4), "weight_hh_l0", method="riemannian", gates=True)
    lstm.reset_parameters()
    gates = lstm.weight_hh_l0.detach().double().reshape(4, 4, 4)
    assert err64(gates) <= 100 * 4 * torch.finfo(F32).eps


@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU])
def test_a_recurrent_layer_built_on_meta_takes_to_empty_and_the_torch_recipe(cls):
    # Note [Weights computed inside _apply]: RNNBase computes its weights in _apply
    gates = {} if cls is nn.RNN else {"gates": True}
    with torch.device("meta"):
        rnn = cls(4, 6, dtype=torch.float64)
    orthogonalize(rnn, "weight_hh_l0", **gates)
    rnn.to_empty(device="cpu")  # raised: the first-use check refused the new memory
    x = torch.randn(3, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="initialize"):  # still refused at first use
        rnn(x)
    rnn.reset_parameters()  # torch's recipe
    y = rnn(x)[0]
    w = rnn.weight_hh_l0.detach().reshape(-1, 6, 6)  # one block per gate
    assert torch.isfinite(y).all()
    eye = torch.eye(6, dtype=torch.float64)
    assert float((w.mT @ w - eye).norm()) < 100 * 6 * torch.finfo(torch.float64).eps
    rnn.to(torch.float32)  # an ordinary _apply: the moved weight is checked at its next use
    assert torch.isfinite(rnn(x.float())[0]).all()
