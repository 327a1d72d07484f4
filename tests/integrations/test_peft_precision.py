"""The "stiefel" PEFT method under the standard dtype, input-shape and config recipes.

References: dense float64 products (x·Qᵀ, W·Q as a convolution), Q's own
orthogonality to 10·n·eps, the adapter's values before a cast (bit for bit),
and the base model's parameters and outputs after a refused ``get_peft_model``.
"""

from __future__ import annotations

import pytest
import torch
from _models import tiny_llama
from torch import nn
from torch.nn import functional as F

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
from peft import get_peft_model  # noqa: E402

from stiefel.integrations.peft import StiefelConfig, StiefelLayer  # noqa: E402

CONFIGS = [
    dict(method="cwy", reflections=8),
    dict(method="cayley", blocks=4),
    dict(method="exp", blocks=4, butterfly=2),
]


def _adapted(config: dict, n: int = 64, side: str = "input"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(n, n))
    stiefel = StiefelConfig(target_modules=["0"], init_weights=False, side=side, **config)
    return get_peft_model(model, stiefel)


def _q64(layer: StiefelLayer) -> torch.Tensor:
    return layer.get_delta_weight("default").detach().double()


def _orthogonality(q: torch.Tensor) -> float:
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return float((q.mT @ q - eye).abs().max())


@pytest.mark.parametrize("config", CONFIGS)
def test_q_stays_float32_under_bfloat16_autocast(config):
    model = _adapted(config)
    layer = model.base_model.model[0]
    seen = []
    layer.get_base_layer().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    eye = torch.eye(64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(eye)
    rotated = seen[0].double()  # the rows e_i·Qᵀ: Qᵀ itself
    assert seen[0].dtype == torch.float32
    tol = 10 * 64 * torch.finfo(torch.float32).eps
    assert _orthogonality(rotated) < tol  # bfloat16 products gave about 3e-3
    assert torch.allclose(rotated, _q64(layer).T, atol=tol)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casting_the_model_keeps_q_in_float32(config, dtype):
    model = _adapted(config)
    layer = model.base_model.model[0]
    before = {k: v.detach().clone() for k, v in layer.stiefel_R.state_dict().items()}
    q = _q64(layer)
    model.to(dtype)
    after = layer.stiefel_R.state_dict()
    for key, value in before.items():  # moved, not cast: the same values, bit for bit
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    x = torch.randn(5, 64).to(dtype)
    base = layer.get_base_layer()
    expected = F.linear((x.double() @ q.T).to(dtype), base.weight, base.bias)
    out = model(x)
    assert out.dtype == dtype
    tol = 4 * torch.finfo(dtype).eps * float(expected.abs().max())
    assert float((out.double() - expected.double()).abs().max()) <= tol
    model.float()  # and back: the adapter lost nothing
    for key, value in before.items():
        assert torch.equal(layer.stiefel_R.state_dict()[key], value), key


@pytest.mark.parametrize("config", CONFIGS)
def test_a_float64_model_computes_q_in_float64(config):
    model = _adapted(config)
    model.double()
    layer = model.base_model.model[0]
    q = _q64(layer)
    assert {p.dtype for p in layer.stiefel_R.parameters()} == {torch.float64}
    assert _orthogonality(q) < 10 * 64 * torch.finfo(torch.float64).eps
    x = torch.randn(5, 64, dtype=torch.float64)
    base = layer.get_base_layer()
    expected = x @ (base.weight @ q).T + base.bias
    assert torch.allclose(model(x), expected, atol=1e-12)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("side", ["input", "output"])
def test_a_model_cast_to_complex_keeps_a_real_q_and_the_imaginary_part(config, side):
    # a real Q is unitary: Q(a + ib) = Qa + iQb; casting the input to Q's real dtype had
    # dropped the imaginary part of the input (forward) and of W (merge), with a warning only
    model = _adapted(config, side=side)
    layer = model.base_model.model[0]
    q = _q64(layer)
    with pytest.warns(UserWarning, match="Complex modules"):  # torch's, on any complex cast
        model.to(torch.complex64)
    w = layer.get_base_layer().weight.detach().to(torch.complex128)
    b = layer.get_base_layer().bias.detach().to(torch.complex128)
    x = torch.randn(5, 64, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    q = q.to(torch.complex128)
    merged = w @ q if side == "input" else q @ w
    reference = x.to(torch.complex128) @ merged.T + b
    tol = 10 * 64 * torch.finfo(torch.float32).eps
    with torch.no_grad():
        assert (model(x).to(torch.complex128) - reference).abs().max() < tol
        model.merge_adapter()
        assert (layer.get_base_layer().weight.to(torch.complex128) - merged).abs().max() < tol
        assert (model(x).to(torch.complex128) - reference).abs().max() < tol


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (lambda: nn.Conv2d(8, 8, 3, padding=1), (8, 8, 8)),  # H = C: the wrong axis fits
        (lambda: nn.Conv2d(8, 8, 3, padding=1), (8, 5, 5)),
        (lambda: nn.Conv1d(8, 8, 3), (8, 10)),
    ],
)
def test_unbatched_convolution_input_rotates_the_channels(conv, shape, side):
    torch.manual_seed(0)
    model = nn.Sequential(conv())
    stiefel = StiefelConfig(
        method="cayley", blocks=2, side=side, target_modules=["0"], init_weights=False
    )
    model = get_peft_model(model, stiefel)
    layer = model.base_model.model[0]
    base = layer.get_base_layer()
    q, w = _q64(layer), base.weight.detach().double()
    if side == "input":
        merged = torch.einsum("oi...,ij->oj...", w, q)
    else:
        merged = torch.einsum("po,oi...->pi...", q, w)
    x = torch.randn(*shape)
    conv_fn = F.conv2d if len(shape) == 3 else F.conv1d
    expected = conv_fn(x.double(), merged, base.bias.double(), padding=base.padding)
    with torch.no_grad():
        out = model(x)
    assert out.shape == expected.shape
    assert torch.allclose(out.double(), expected, atol=1e-5)


def _llama():
    return tiny_llama(0, vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32).eval()  # fmt: skip


def test_options_that_do_not_fit_a_later_target_raise_before_any_change():
    # q_proj has 32 output features, v_proj 16: reflections=20 fits the first only
    base = _llama()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = base(input_ids=ids).logits
    flags = [p.requires_grad for p in base.parameters()]
    config = StiefelConfig(reflections=20, side="output", target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"reflections=20.*v_proj.*16 output features"):
        get_peft_model(base, config)
    assert not any(isinstance(m, StiefelLayer) for m in base.modules())
    assert [p.requires_grad for p in base.parameters()] == flags
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, reference)


def test_add_adapter_whose_options_do_not_fit_leaves_no_trace():
    model = get_peft_model(_llama(), StiefelConfig(reflections=4, target_modules=["q_proj"]))
    bad = StiefelConfig(reflections=20, side="output", target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"reflections=20.*v_proj"):
        model.add_adapter("other", bad)
    assert list(model.peft_config) == ["default"]
    layers = [m for m in model.modules() if isinstance(m, StiefelLayer)]
    assert layers and all(list(m.stiefel_R) == ["default"] for m in layers)


def test_an_option_given_twice_with_two_values_is_refused():
    with pytest.raises(ValueError, match=r"reflections=8 and options\['reflections'\]=4"):
        StiefelConfig(options={"reflections": 4}, reflections=8)
    same = StiefelConfig(options={"reflections": 4}, reflections=4)
    assert same.options == {"reflections": 4}
