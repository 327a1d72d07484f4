"""``orthogonalize(param, method=...)`` constrains the model that holds ``param``, in place.

References: the orthogonality error ‖QᵀQ − I‖_F is computed here in float64
from the weight read back from the model (each gate of an LSTM weight, the
kernel matrix √k·reshape(W, (out, in·k)) of a convolution), the starting point
against the polar factor U Vᴴ of torch's SVD, and each trained model against an
unconstrained twin (a deep copy whose weight is a plain Parameter holding the
same starting point) trained on the same data: the twin's error is large, the
constrained model's is at rounding level.
"""

import copy
import gc
import warnings

import geoopt
import pytest
import torch
from _models import tiny_llama
from torch import nn
from torch.nn.utils import parametrize

from stiefel import optimizers
from stiefel.manifolds import binding
from stiefel.parametrizations import OrthogonalMatrix, available, orthogonalize
from stiefel.parametrizations.holders import holders


def orth_err(q: torch.Tensor) -> float:
    """max over a batch of ‖QᵀQ − I‖_F (QQᵀ for a wide Q), in float64."""
    q = q.detach().to(torch.float64)
    q = q.mT if q.shape[-2] < q.shape[-1] else q
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    return float(torch.linalg.matrix_norm(q.mT @ q - eye).max())


def polar(w: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(w, full_matrices=False)
    return u @ vh


def tol(dtype: torch.dtype, n: int) -> float:
    return 10 * n * torch.finfo(dtype).eps


def _no_warnings(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return call()


# ------------------------------------------------------------- the card's call, trained
def _linear(g):
    model = nn.Linear(6, 6, dtype=torch.float64)
    x, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 6, generator=g)
    weight = lambda m: m.weight  # noqa: E731
    return model, weight, {}, weight, lambda m: (m(x) - y).pow(2).mean()


def _rnn(g):
    model = nn.RNN(4, 6, dtype=torch.float64)
    x = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randn(5, 3, 6, generator=g, dtype=torch.float64)
    weight = lambda m: m.weight_hh_l0  # noqa: E731
    return model, weight, {}, weight, lambda m: (m(x)[0] - y).pow(2).mean()


def _lstm(g):
    model = nn.LSTM(4, 5, dtype=torch.float64)
    x = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randn(5, 3, 5, generator=g, dtype=torch.float64)
    gates = lambda m: m.weight_hh_l0.reshape(4, 5, 5)  # noqa: E731 (i, f, g, o), each 5×5
    weight = lambda m: m.weight_hh_l0  # noqa: E731
    return model, weight, {"gates": True}, gates, lambda m: (m(x)[0] - y).pow(2).mean()


def _conv(g):
    model = nn.Conv2d(2, 4, 3, padding=1, dtype=torch.float64)
    x = torch.randn(2, 2, 5, 5, generator=g, dtype=torch.float64)
    y = torch.randn(2, 4, 5, 5, generator=g, dtype=torch.float64)
    kernel = lambda m: 3.0 * m.weight.reshape(4, 18)  # noqa: E731 √k·K̂ᵀ, k = 9 taps
    return (
        model,
        lambda m: m.weight,
        {"conv_kernel": True},
        kernel,
        lambda m: (m(x) - y).pow(2).mean(),
    )


def _embedding(g):
    model = nn.Embedding(10, 4, dtype=torch.float64)
    idx = torch.randint(0, 10, (12,), generator=g)
    y = torch.randn(12, 4, generator=g, dtype=torch.float64)
    weight = lambda m: m.weight  # noqa: E731
    return model, weight, {}, weight, lambda m: (m(idx) - y).pow(2).mean()


def _llama(g):
    model = tiny_llama()
    ids = torch.randint(0, 32, (2, 8), generator=g)

    def q_proj(m):
        return m.model.layers[0].self_attn.q_proj

    def loss(m):
        return m(input_ids=ids, labels=ids).loss

    return model, lambda m: q_proj(m).weight, {}, lambda m: q_proj(m).weight, loss


CASES = {
    "linear": _linear,
    "rnn": _rnn,
    "lstm_gates": _lstm,
    "conv2d_kernel": _conv,
    "embedding": _embedding,
    "llama_q_proj": _llama,
}


def _train(model, loss, steps=5, lr=0.05):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss(model).backward()
        opt.step()


@pytest.mark.parametrize("case", CASES)
def test_the_cards_call_keeps_the_models_weight_orthogonal_through_training(case):
    g = torch.Generator().manual_seed(1)
    model, weight, options, matrices, loss = CASES[case](g)
    p = weight(model)
    assert isinstance(p, nn.Parameter)

    twin = copy.deepcopy(model)  # before the call: its weight stays a plain Parameter
    returned = _no_warnings(lambda: orthogonalize(p, method="cwy", **options))

    assert returned is p
    ((module, key),) = holders(p)  # p is now the free parameter of the map
    assert isinstance(module, parametrize.ParametrizationList) and key == "original"
    start = matrices(model).detach().clone()
    dtype = start.dtype
    n = min(start.shape[-2:])
    assert orth_err(start) < tol(dtype, n)
    with torch.no_grad():
        weight(twin).copy_(weight(model))  # the same starting point, unconstrained
    assert not parametrize.is_parametrized(twin) and torch.equal(matrices(twin), start)

    _train(model, loss)
    _train(twin, loss)

    after, twin_after = matrices(model).detach(), matrices(twin).detach()
    assert (after - start).norm() > 1e-2  # it trained
    assert orth_err(after) < tol(dtype, n)
    assert orth_err(twin_after) > 0.1  # the same training without the constraint drifts


# ------------------------------------------------------------- every method, what comes back
@pytest.mark.parametrize("method", available())
def test_every_method_constrains_the_holder_and_returns_the_parameter(method):
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(4, 6, dtype=torch.float64)  # weight 6×4: tall, so "riemannian" serves it
    p = lin.weight
    before = p.detach().clone()
    assert _no_warnings(lambda: orthogonalize(p, method=method)) is p
    if method == "riemannian":
        assert lin.weight is p and isinstance(p, geoopt.ManifoldParameter)
        opt = optimizers.create("radam", lin.parameters(), lr=0.05)
    else:
        assert lin.parametrizations.weight.original is p
        opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    assert torch.allclose(lin.weight, polar(before), atol=tol(torch.float64, 6) * 10)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    y = torch.randn(16, 6, generator=g, dtype=torch.float64)
    for _ in range(5):
        opt.zero_grad()
        (lin(x) - y).pow(2).mean().backward()
        opt.step()
    assert (lin.weight.detach() - polar(before)).norm() > 1e-2
    assert orth_err(lin.weight) < tol(torch.float64, 6) * 10


def test_an_optimizer_built_before_the_call_trains_the_constrained_model():
    # exp on a wide 3×6 weight: the free parameter is 6×6, set into the same Parameter
    g = torch.Generator().manual_seed(3)
    first = nn.Linear(6, 3, dtype=torch.float64)
    second = copy.deepcopy(first)
    opt_first = torch.optim.Adam(first.parameters(), lr=0.05)
    orthogonalize(first.weight, method="exp")
    orthogonalize(second.weight, method="exp")
    opt_second = torch.optim.Adam(second.parameters(), lr=0.05)
    assert first.parametrizations.weight.original.shape == (6, 6)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    _trained_alike([(first, opt_first), (second, opt_second)], x, 4)


def _trained_alike(pairs: list, x: torch.Tensor, steps: int) -> None:
    """Train each (model, optimizer) on the same loss; the first two end equal, orthogonal."""
    for model, opt in pairs:
        for _ in range(steps):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    first, second = pairs[0][0], pairs[1][0]
    assert torch.equal(first.weight, second.weight)
    assert orth_err(first.weight) < tol(torch.float64, 6)


STEPPERS = {
    "torch Adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "torch SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "radam": lambda ps: optimizers.create("radam", ps, lr=0.05),
    "geoopt RiemannianAdam": lambda ps: geoopt.optim.RiemannianAdam(ps, lr=0.05),
}


@pytest.mark.parametrize("form", ["module", "parameter"])
@pytest.mark.parametrize("method", ["cayley", "cwy"])
@pytest.mark.parametrize("stepper", list(STEPPERS))
def test_an_optimizer_that_stepped_the_weight_starts_afresh_on_its_coordinates(
    stepper, method, form
):
    # Note [Coordinates are a new parameter to an optimizer]: the moments of the weight
    # moved a square weight's cayley coordinates (same shape, no error) and failed on
    # cwy's (another shape). The reference: the same weight constrained in a copy,
    # trained by an optimizer built after the call.
    g = torch.Generator().manual_seed(5)
    make = STEPPERS[stepper]
    first = nn.Linear(6, 6, bias=False, dtype=torch.float64)
    opt = make(first.parameters())
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        first(x).pow(2).sum().backward()
        opt.step()
    second = copy.deepcopy(first)
    with pytest.warns(RuntimeWarning, match=f"{type(opt).__name__} \\(.*(exp_avg|momentum)") as rec:
        if form == "module":
            orthogonalize(first, "weight", method=method)
        else:
            orthogonalize(first.weight, method=method)
    assert rec[0].filename == __file__  # the caller's line
    assert first.parametrizations.weight.original not in opt.state
    orthogonalize(second, "weight", method=method)
    _trained_alike([(first, opt), (second, make(second.parameters()))], x, 3)


@pytest.mark.parametrize("method", ["cwy", "exp"])
def test_a_gradient_left_on_the_weight_does_not_step_its_coordinates(method):
    # backward, then orthogonalize, then step: the gradient was the weight's (of another
    # shape for exp on a tall weight); SGD moved the coordinates by it (or raised a bare
    # shape error), where a model constrained before the backward has no gradient yet
    lin = nn.Linear(4, 6, dtype=torch.float64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
    p = orthogonalize(lin.weight, method=method)
    assert p.grad is None
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before)
    assert lin.bias.grad is not None  # the rest of the model keeps its gradients


def test_riemannian_keeps_the_weights_gradient_which_is_still_its_own():
    lin = nn.Linear(4, 6, dtype=torch.float64)
    lin(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
    grad = lin.weight.grad.clone()
    p = orthogonalize(lin.weight, method="riemannian")
    assert torch.equal(p.grad, grad)


def test_a_free_parameter_gets_a_holder_that_is_that_parameter_without_warning():
    g = torch.Generator().manual_seed(4)
    p = nn.Parameter(torch.randn(6, 3, generator=g, dtype=torch.float64))
    before = p.detach().clone()
    W = _no_warnings(lambda: orthogonalize(p, method="householder"))
    assert isinstance(W, OrthogonalMatrix)
    assert W.parametrizations.weight.original is p  # no copy: p is what trains W
    assert torch.allclose(W(), polar(before), atol=tol(torch.float64, 6))
    q = nn.Parameter(torch.randn(6, 3, generator=g, dtype=torch.float64))
    R = _no_warnings(lambda: orthogonalize(q, method="riemannian"))
    assert isinstance(R, OrthogonalMatrix) and R.weight is q
    assert isinstance(q, geoopt.ManifoldParameter)


def test_a_holder_out_of_the_callers_reach_is_found():
    box = {"layers": [nn.Linear(4, 4, dtype=torch.float64)]}  # no module in any frame
    p = box["layers"][0].weight
    assert orthogonalize(p, method="cwy") is p
    assert parametrize.is_parametrized(box["layers"][0], "weight")
    assert orth_err(box["layers"][0].weight) < tol(torch.float64, 4)


def test_a_dead_holder_in_a_reference_cycle_is_not_a_holder():
    enabled = gc.isenabled()
    gc.disable()  # keep the cycle uncollected until orthogonalize looks
    try:
        dead = nn.Linear(4, 4)
        dead.cycle = [dead]
        p = dead.weight
        del dead
        W = orthogonalize(p, method="cwy")
    finally:
        if enabled:
            gc.enable()
    assert isinstance(W, OrthogonalMatrix) and W.parametrizations.weight.original is p


def test_a_dict_that_merely_holds_the_parameter_is_not_a_holder():
    lin = nn.Linear(4, 4)
    mine = {"w": lin.weight}  # looks like a module's _parameters
    assert [(m, k) for m, k in holders(mine["w"])] == [(lin, "weight")]


# ------------------------------------------------------------- bad input
def _untouched(module, name, before):
    assert not parametrize.is_parametrized(module, name)
    assert type(getattr(module, name)) is nn.Parameter
    assert torch.equal(getattr(module, name), before)


def test_a_tied_parameter_is_refused_naming_its_holders():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"tied.*Embedding\.weight, Linear\.weight"):
        orthogonalize(emb.weight, method="cwy")
    _untouched(emb, "weight", before)
    _untouched(head, "weight", before)
    assert head.weight is emb.weight


def test_tied_holders_in_one_model_are_named_by_their_paths_in_it():
    # the message named both holders "Linear.weight": which modules, the user could not tell
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Sequential(nn.Linear(5, 5)))
    model[2][0].weight = model[0].weight
    with pytest.raises(ValueError, match=r"Linear\.weight \(0\.weight of a Sequential\), "
                       r"Linear\.weight \(2\.0\.weight of a Sequential\)"):  # fmt: skip
        orthogonalize(model[0].weight, method="cwy")
    assert not parametrize.is_parametrized(model[0])


def test_a_parameter_held_twice_by_one_module_is_refused():
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(4, 4))
    m.b = m.a
    with pytest.raises(ValueError, match=r"tied.*Module\.a, Module\.b"):
        orthogonalize(m.a, method="exp")
    assert not parametrize.is_parametrized(m)


def test_tied_transformers_embeddings_are_refused_and_riemannian_keeps_both_holders():
    model = tiny_llama(None, hidden_size=8, intermediate_size=16, tie_word_embeddings=True)
    emb, head = model.model.embed_tokens, model.lm_head
    assert head.weight is emb.weight
    before = emb.weight.detach().clone()
    names = r"Embedding\.weight \(model\.embed_tokens\.weight of a LlamaForCausalLM\), "
    with pytest.raises(ValueError, match=names + r"Linear\.weight \(lm_head\.weight of a"):
        orthogonalize(emb.weight, method="cwy")
    _untouched(emb, "weight", before)
    p = emb.weight
    assert orthogonalize(p, method="riemannian") is p  # one Parameter: both holders see it
    assert head.weight is p and isinstance(p, geoopt.ManifoldParameter)
    assert torch.allclose(p, polar(before.double()).float(), atol=tol(torch.float32, 32))
    assert "weight" in binding.records(emb) and "weight" in binding.records(head)


def test_a_computed_tensor_is_refused_as_not_a_leaf():
    lin = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"computed tensor.*shape \(4, 4\).*MulBackward0"):
        orthogonalize(lin.weight * 2, method="cwy")
    orthogonalize(lin.weight, method="cwy")
    with pytest.raises(TypeError, match="not a leaf.*already constrained"):
        orthogonalize(lin.weight, method="cwy")  # the parametrized weight, a second time


def test_a_parameter_that_is_not_floating_is_refused_naming_it():
    m = nn.Module()
    m.w = nn.Parameter(torch.ones(3, 3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"Module\.w, shape \(3, 3\).*torch\.int64; allowed"):
        orthogonalize(m.w, method="cwy")
    _untouched(m, "w", torch.ones(3, 3, dtype=torch.int64))
    free = nn.Parameter(torch.ones(3, 3, dtype=torch.int32), requires_grad=False)
    with pytest.raises(TypeError, match=r"free nn\.Parameter.*torch\.int32"):
        orthogonalize(free, method="cwy")
    assert free.dtype == torch.int32 and torch.equal(free, torch.ones(3, 3, dtype=torch.int32))


def test_an_already_constrained_parameter_is_refused():
    lin = nn.Linear(4, 4)
    p = orthogonalize(lin.weight, method="cwy")
    with pytest.raises(ValueError, match="already parametrized"):
        orthogonalize(p, method="cwy")
    r = nn.Linear(3, 5)
    q = orthogonalize(r.weight, method="riemannian")
    with pytest.raises(ValueError, match="already a manifold parameter"):
        orthogonalize(q, method="cwy")


def test_stacked_gates_without_the_option_are_refused_and_left_alone():
    lstm = nn.LSTM(3, 3)
    before = lstm.weight_hh_l0.detach().clone()
    with pytest.raises(ValueError, match="gates=True"):
        orthogonalize(lstm.weight_hh_l0, method="cwy")
    _untouched(lstm, "weight_hh_l0", before)


@pytest.mark.parametrize("free", [False, True])
def test_non_finite_values_are_refused_only_where_the_init_reads_them(free):
    # a free Parameter's refusal named "module.weight" (the holder's, not the caller's),
    # and init="haar" / "identity", which read no value, refused NaN entries too (as the
    # uninitialised memory of torch.empty can hold)
    t = torch.full((4, 3), float("nan"))
    t = nn.Parameter(t) if free else t
    name = r"module_or_tensor \(a free nn\.Parameter\)" if free else "tensor"
    with pytest.raises(ValueError, match=rf"^{name} has 12 non-finite entries"):
        orthogonalize(t, method="cwy")
    for init in ("haar", "identity"):
        w = orthogonalize(t, method="cwy", init=init)()
        assert torch.dist(w.mT @ w, torch.eye(3)) < 100 * 4 * torch.finfo(torch.float32).eps
