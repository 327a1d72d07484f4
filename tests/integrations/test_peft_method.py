"""The registered PEFT method "stiefel": PEFT's whole workflow on tiny local models.

References: the base model's own outputs (identity start, disable_adapter,
unmerge), the same adapter saved and loaded, a plain model after
merge_and_unload, dense float64 W·Q products, and PEFT's OFT (orthogonality).
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings

import pytest
import torch
from _models import tiny_llama
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft import OFTConfig, PeftModel, get_peft_model  # noqa: E402

from stiefel.integrations.peft import StiefelConfig, StiefelLayer  # noqa: E402

F32_EPS = torch.finfo(torch.float32).eps


def _llama(seed: int = 0):
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    return tiny_llama(seed, **sizes, num_attention_heads=4, max_position_embeddings=32).eval()


def _gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _tokens(seed: int = 1):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train(model, ids, steps: int = 5, lr: float = 1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _stiefel_layers(model):
    return [m for m in model.modules() if isinstance(m, StiefelLayer)]


def _close(a, b, dtype=torch.float32, scale=1.0):
    tol = 100 * torch.finfo(dtype).eps * scale
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max().item()


WORKFLOWS = {
    "llama": (
        _llama,
        lambda: StiefelConfig(
            method="cwy", reflections=4, blocks=2, target_modules=["q_proj", "v_proj", "up_proj"]
        ),
    ),
    "gpt2": (
        _gpt2,
        lambda: StiefelConfig(
            method="cayley",
            blocks=4,
            side="output",
            target_modules=["c_attn", "c_fc"],
            modules_to_save=["ln_f"],
        ),
    ),
}


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_workflow_train_save_load_merge(name, tmp_path):
    make, config = WORKFLOWS[name]
    ids = _tokens()
    base_logits = _logits(make(), ids)
    model = get_peft_model(make(), config())
    assert len(_stiefel_layers(model)) == 2 * len(model.peft_config["default"].target_modules)
    _close(_logits(model, ids), base_logits, scale=10)  # Q = I at the start
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}

    saved_modules = model.peft_config["default"].modules_to_save or []
    copies = {n: p.detach().clone() for n, p in model.named_parameters() if "modules_to_save" in n}
    assert len(copies) == 2 * len(saved_modules)  # LayerNorm weight and bias, trained in full
    assert all(model.get_parameter(n).requires_grad for n in copies)

    with torch.inference_mode():  # a forward in inference mode does not break training
        model(input_ids=ids)
    losses = _train(model, ids)
    assert losses[-1] < losses[0]
    assert all(not torch.equal(model.get_parameter(n), v) for n, v in copies.items())
    trained = _logits(model, ids)
    assert (trained - base_logits).abs().max() > 1e-3
    for n, p in model.named_parameters():  # W untouched, frozen
        if n in frozen:
            assert torch.equal(p, frozen[n]) and not p.requires_grad

    with model.disable_adapter():
        _close(_logits(model, ids), base_logits, scale=10)
    _close(_logits(model, ids), trained)

    buffer = io.BytesIO()  # the whole model pickles
    torch.save(model, buffer)
    buffer.seek(0)
    _close(_logits(torch.load(buffer, weights_only=False), ids), trained)

    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(make(), tmp_path)
    _close(_logits(loaded, ids), trained)

    loaded.merge_adapter()
    _close(_logits(loaded, ids), trained, scale=100)
    loaded.unmerge_adapter()
    for n, p in loaded.named_parameters():
        if n in frozen:
            _close(p, frozen[n], scale=10)
    _close(_logits(loaded, ids), trained, scale=10)

    plain = loaded.merge_and_unload()
    assert not _stiefel_layers(plain) and not any("stiefel" in n for n, _ in plain.named_modules())
    _close(_logits(plain, ids), trained, scale=100)


def test_two_named_adapters_and_set_adapter():
    ids = _tokens()
    base_logits = _logits(_llama(), ids)
    config = dict(target_modules=["q_proj", "v_proj"], init_weights=False)
    model = get_peft_model(_llama(), StiefelConfig(method="cwy", reflections=4, **config))
    model.add_adapter("other", StiefelConfig(method="exp", blocks=4, side="output", **config))
    first = _logits(model, ids)
    model.set_adapter("other")
    second = _logits(model, ids)
    assert (first - second).abs().max() > 1e-3
    assert (second - base_logits).abs().max() > 1e-3
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".stiefel_R.other." in n for n in trainable)
    # each adapter alone equals a model holding only that adapter
    alone = copy.deepcopy(model)
    alone.delete_adapter("default")
    _close(_logits(alone, ids), second)
    model.set_adapter("default")
    _close(_logits(model, ids), first)


def test_named_adapters_save_and_load_under_new_names(tmp_path):
    def base():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    model = get_peft_model(base(), StiefelConfig(target_modules=["0"], init_weights=False))
    model.add_adapter(
        "other",
        StiefelConfig(method="exp", blocks=2, target_modules=["0", "2"], init_weights=False),
    )
    x = torch.randn(3, 16)
    expected = {}
    for name in ("other", "default"):
        model.set_adapter(name)
        expected[name] = model(x)
    model.save_pretrained(tmp_path)  # "other" goes to tmp_path / "other"
    loaded = PeftModel.from_pretrained(base(), tmp_path)
    loaded.load_adapter(tmp_path / "other", adapter_name="second")
    _close(loaded(x), expected["default"])
    loaded.set_adapter("second")
    _close(loaded(x), expected["other"])


def test_several_active_adapters_merge_in_peft_order():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 8)).double()
    cfg = dict(target_modules=["0"], init_weights=False)
    model = get_peft_model(base, StiefelConfig(method="cwy", blocks=2, **cfg))
    model.add_adapter("b", StiefelConfig(method="cayley", blocks=3, **cfg))
    model.add_adapter("c", StiefelConfig(method="exp", side="output", **cfg))
    model.base_model.set_adapter(["default", "b", "c"])
    layer = model.base_model.model[0]
    w, bias = layer.base_layer.weight.detach().clone(), layer.base_layer.bias.detach()
    q = {a: layer.stiefel_R[a].matrix().detach().double() for a in ("default", "b", "c")}
    x = torch.randn(5, 12, dtype=torch.float64)
    dense = q["c"] @ w @ q["default"] @ q["b"]  # Note [Several adapters, in PEFT's order]
    expected = x @ dense.T + bias
    _close(model(x), expected, torch.float32)
    model.merge_adapter(["default", "b", "c"], safe_merge=True)
    _close(layer.base_layer.weight, dense, torch.float32)
    _close(model(x), expected, torch.float32)
    model.unmerge_adapter()
    _close(layer.base_layer.weight, w, torch.float32)
    w = layer.base_layer.weight.detach().clone()
    with torch.no_grad():  # a broken adapter: safe_merge refuses it and leaves W as it was
        layer.stiefel_R["b"].originals[0].fill_(float("nan"))
    with pytest.raises(ValueError, match="NaNs detected"):
        model.merge_adapter(["b"], safe_merge=True)
    assert torch.equal(layer.base_layer.weight, w) and not layer.merged


def test_print_trainable_parameters_counts():
    model = _llama()
    total = sum(p.numel() for p in model.parameters())
    # q_proj: 32 → 32, up_proj: 32 → 48 (input side: 32 features), 2 layers each
    config = StiefelConfig(
        method="cwy", reflections=3, blocks=4, target_modules=["q_proj", "up_proj"]
    )
    peft_model = get_peft_model(model, config)
    expected = 2 * 2 * (4 * 8 * 3)  # layers × targets × (blocks · block size · reflections)
    trainable, every = peft_model.get_nb_trainable_parameters()
    assert trainable == expected and every == total + expected


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("kind", ["conv1d", "conv2d", "hf_conv1d"])
def test_convolutions_equal_dense_product(kind, side):
    torch.manual_seed(0)
    if kind == "conv1d":
        layer, x = nn.Conv1d(6, 4, 3, padding=1), torch.randn(2, 6, 7)
    elif kind == "conv2d":
        layer, x = nn.Conv2d(6, 4, 3, padding=1), torch.randn(2, 6, 5, 5)
    else:
        layer, x = transformers.pytorch_utils.Conv1D(4, 6), torch.randn(2, 3, 6)  # (nf, nx)
    base = nn.Sequential(layer).double()
    x = x.double()
    model = get_peft_model(base, StiefelConfig(side=side, target_modules=["0"], init_weights=False))
    stl = model.base_model.model[0]
    q = stl.stiefel_R["default"].matrix().detach()
    w = stl.base_layer.weight.detach()
    if kind == "hf_conv1d":
        merged = (w.T @ q).T if side == "input" else (q @ w.T).T
        expected = x @ merged + stl.base_layer.bias
    else:
        eq = "oi...,ij->oj..." if side == "input" else "po,oi...->pi..."
        merged = torch.einsum(eq, w, q) if side == "input" else torch.einsum(eq, q, w)
        conv = nn.functional.conv1d if kind == "conv1d" else nn.functional.conv2d
        expected = conv(x, merged, stl.base_layer.bias, padding=1)
    _close(model(x), expected, torch.float64, scale=10)
    plain = model.merge_and_unload()
    _close(plain(x), expected, torch.float64, scale=10)


def test_bfloat16_base_weights_stay_untouched():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    originals = list(base.parameters())  # the base's own Parameter objects
    weights = [p.detach().clone() for p in originals]
    model = get_peft_model(base, StiefelConfig(method="cwy", reflections=4, target_modules=["0"]))
    rot = model.base_model.model[0].stiefel_R["default"]
    assert all(p.dtype == torch.float32 for p in rot.parameters())
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        y = model(x)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()
        opt.step()
    assert all(
        torch.equal(a, b) and a.dtype == torch.bfloat16
        for a, b in zip(originals, weights, strict=True)
    )
    q = rot.matrix().detach().double()
    expected = nn.functional.linear(x.double() @ q.T, weights[0].double(), weights[1].double())
    expected = base[2](torch.tanh(expected.to(torch.bfloat16)))
    assert torch.allclose(model(x).float(), expected.float(), atol=0.05)


def _orthogonality_error(q):
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    q = q.detach().double()
    return (q.mT @ q - eye).abs().amax().item()


def test_exactly_orthogonal_after_training_unlike_peft_oft():
    """100 AdamW steps at lr 1e-2: every Q within 10·n·eps(float32); PEFT's OFT is not."""
    n, block = 64, 16

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(n, n, bias=False))

    torch.manual_seed(1)
    x = torch.randn(128, n)
    target = x @ torch.linalg.qr(torch.randn(n, n))[0]  # far from the identity

    def train(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(100):
            opt.zero_grad()
            (model(x) - make()(target)).pow(2).mean().backward()
            opt.step()

    ours = get_peft_model(
        make(), StiefelConfig(method="cayley", blocks=n // block, target_modules=["0"])
    )
    train(ours)
    q_ours = ours.base_model.model[0].stiefel_R["default"].matrix()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oft = get_peft_model(make(), OFTConfig(oft_block_size=block, r=0, target_modules=["0"]))
    train(oft)
    q_oft = oft.base_model.model[0].oft_R["default"].get_weight()
    tol = 10 * n * F32_EPS
    assert _orthogonality_error(q_ours) <= tol
    assert _orthogonality_error(q_oft) > tol


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"method": "nope"}, ["method='nope'", "cwy"]),
        ({"method": "cwy", "bogus": 1}, ["bogus", "reflections"]),
        ({"side": "left"}, ["side='left'", "input, output"]),
        ({"blocks": 0}, ["blocks=0"]),
        ({"bias": "some"}, ["bias='some'", "stiefel_only"]),
    ],
)
def test_config_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as err:
        StiefelConfig(target_modules=["0"], **kwargs)
    assert all(w in str(err.value) for w in words)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_config_init_weights_must_be_a_bool(value):
    # a truthy string ("no") started Q at the identity as if True had been given
    with pytest.raises(TypeError, match=f"init_weights={value!r} is not allowed; allowed: True"):
        StiefelConfig(target_modules=["0"], init_weights=value)


def _snapshot(model):
    return [(type(m), n) for n, m in model.named_modules()], {
        n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()
    }


def _same(model, snap):
    modules, params = snap
    assert [(type(m), n) for n, m in model.named_modules()] == modules
    now = dict(model.named_parameters())
    assert set(now) == set(params)
    for n, (value, flag) in params.items():
        assert torch.equal(now[n], value) and now[n].requires_grad == flag


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"blocks": 5}, ["blocks=5", "allowed: 1, 2, 3, 4, 6, 12"]),
        ({"blocks": 3, "butterfly": 2}, ["butterfly=2", "allowed: butterfly <= 1"]),
        ({"target_modules": ["0", "emb"]}, ["target_modules", "Embedding", "nn.Linear"]),
    ],
)
def test_bad_targets_raise_before_any_change(kwargs, words):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 12), nn.Linear(12, 12))
    base.emb = nn.Embedding(5, 12)
    snap = _snapshot(base)
    config = {"target_modules": ["0", "1"], **kwargs}
    with pytest.raises(ValueError) as err:
        get_peft_model(base, StiefelConfig(**config))
    assert all(w in str(err.value) for w in words), str(err.value)
    _same(base, snap)


def test_all_linear_targets_are_checked_before_any_change():
    # PEFT expands "all-linear" after the check of the targets: the first layer was
    # replaced, the second refused, and a retry with a valid config trained the whole model
    base = nn.Sequential(nn.Linear(12, 12), nn.Linear(12, 4))
    snap = _snapshot(base)
    with pytest.raises(
        ValueError, match=r"blocks=3 does not divide the output features \(4\) of 1"
    ):
        get_peft_model(base, StiefelConfig(target_modules="all-linear", side="output", blocks=3))
    _same(base, snap)


def test_loading_into_mismatching_model_raises_and_leaves_it(tmp_path):
    torch.manual_seed(0)
    saved = get_peft_model(
        nn.Sequential(nn.Linear(16, 16)), StiefelConfig(blocks=2, target_modules=["0"])
    )
    saved.save_pretrained(tmp_path)
    other = nn.Sequential(nn.Linear(8, 8))  # blocks=2 divides 8, but the blocks are 4×4
    snap = _snapshot(other)
    with pytest.raises(ValueError) as err:
        PeftModel.from_pretrained(other, tmp_path)
    assert "blocks=2" in str(err.value) and "(2, 8, 8)" in str(err.value)
    _same(other, snap)
    # loaded as a second adapter into a PEFT model: the failure leaves the model as it was
    host = get_peft_model(nn.Sequential(nn.Linear(8, 8)), StiefelConfig(target_modules=["0"]))
    before = _snapshot(host)
    with pytest.raises(ValueError):
        host.load_adapter(tmp_path, adapter_name="other")
    _same(host, before)
    assert set(host.peft_config) == {"default"}


def test_registration_works_when_stiefel_is_imported_first(tmp_path):
    """This test module imported PEFT first; a fresh process imports this package first."""
    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(8, 8)), StiefelConfig(target_modules=["0"]))
    model.save_pretrained(tmp_path)
    imports = ["import stiefel.integrations.peft", "import peft"]
    code = "\n".join(
        [
            "import sys, torch, stiefel",
            "assert 'peft' not in sys.modules",  # import stiefel alone never imports peft
            *imports,
            "from peft import PeftConfig, PeftModel, PeftType",
            "from stiefel.integrations.peft import StiefelConfig",
            f"c = PeftConfig.from_pretrained({str(tmp_path)!r})",
            "assert isinstance(c, StiefelConfig) and c.peft_type == PeftType('STIEFEL')",
            "assert 'STIEFEL' in list(PeftType)",
            "base = torch.nn.Sequential(torch.nn.Linear(8, 8))",
            f"PeftModel.from_pretrained(base, {str(tmp_path)!r})",
        ]
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "options",
    [
        {"method": "cayley", "blocks": 4, "butterfly": 3},
        {"method": "householder", "blocks": 2},
        {"method": "cwy", "reflections": 5, "side": "output"},
    ],
)
def test_forward_equals_the_dense_product(options):
    """The operator forms (gathers, blocks, WY) against F.linear with the dense W·Q, float64."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16)).double()
    model = get_peft_model(base, StiefelConfig(target_modules=["0"], init_weights=False, **options))
    layer = model.base_model.model[0]
    q = layer.stiefel_R["default"].matrix().detach()
    assert torch.allclose(q.T @ q, torch.eye(16, dtype=torch.float64), atol=1e-12)
    w, b = layer.base_layer.weight.detach(), layer.base_layer.bias.detach()
    dense = w @ q if options.get("side", "input") == "input" else q @ w
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    _close(model(x), x @ dense.T + b, torch.float64, scale=10)


# ---------------------------------------------------------------------------- merge order
def _two_layer_adapters():
    """a on both layers, b on the second only, c on the output side of the first; float64."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    model = get_peft_model(
        base, StiefelConfig(method="cwy", target_modules=["0", "2"], init_weights=False), "a"
    )
    model.add_adapter("b", StiefelConfig(method="cayley", target_modules=["2"], init_weights=False))
    model.add_adapter(
        "c", StiefelConfig(method="exp", side="output", target_modules=["0"], init_weights=False)
    )
    model.base_model.set_adapter(["a", "b", "c"])
    return model


def test_merge_in_another_order_than_the_forward_is_refused():
    model = _two_layer_adapters()
    x = torch.randn(5, 8, dtype=torch.float64)
    expected = model(x)  # the adapters applied as the forward applies them
    first, second = model.base_model.model[0], model.base_model.model[2]
    q = {a: second.stiefel_R[a].matrix().detach() for a in ("a", "b")}
    dense = second.base_layer.weight.detach() @ q["a"] @ q["b"]  # active order a, b
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as err:  # W·Qb·Qa was written (output off by 0.6)
        model.merge_adapter(["b", "a"])
    assert "['b', 'a']" in str(err.value) and "['a', 'b']" in str(err.value)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert not first.merged and not second.merged  # the first layer (a only) untouched too
    model.merge_adapter(["b"])  # then a after b: refused as well
    with pytest.raises(ValueError, match=r"after the merged \['b'\]"):
        model.merge_adapter(["a"])
    model.unmerge_adapter()
    model.merge_adapter(["c", "a", "b"])  # c is on the other side: its place does not matter
    _close(second.base_layer.weight, dense, torch.float64, scale=10)
    _close(model(x), expected, torch.float64, scale=10)


# ---------------------------------------------------------------------------- saved map
def _edit_config(path, **changes):
    import json

    file = path / "adapter_config.json"
    saved = json.loads(file.read_text())
    saved.update(changes)
    file.write_text(json.dumps(saved))


@pytest.mark.parametrize(
    ("saved", "edited"),
    [
        ({"method": "cayley"}, {"method": "exp"}),
        ({"method": "exp"}, {"method": "cayley"}),
        ({"method": "cayley"}, {"side": "output"}),
    ],
)
def test_folder_whose_config_names_another_map_is_refused(tmp_path, saved, edited):
    def base():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8))

    model = get_peft_model(
        base(), StiefelConfig(blocks=2, target_modules=["0"], init_weights=False, **saved)
    )
    x = torch.randn(4, 8)
    expected = model(x)
    model.save_pretrained(tmp_path)
    _close(PeftModel.from_pretrained(base(), tmp_path)(x), expected)  # the reference
    _edit_config(tmp_path, **edited)
    other = base()
    snap = _snapshot(other)
    with pytest.raises(ValueError) as err:  # loaded silently, other outputs (off by 0.3)
        PeftModel.from_pretrained(other, tmp_path)
    (key, value), *_ = edited.items()
    assert f"{key}={value!r}" in str(err.value) and f"{key}={saved.get(key, 'input')!r}" in str(
        err.value
    )
    _same(other, snap)


# ---------------------------------------------------------------------------- newer configs
def test_from_pretrained_forward_compatible(tmp_path, recwarn):
    """PEFT's own test of its configs (unknown keys of a newer config dropped with a warning)."""
    config = StiefelConfig(method="cwy", reflections=4, target_modules=["0"])
    config.save_pretrained(tmp_path)
    _edit_config(tmp_path, foobar="baz", spam=123)
    msg = (
        "Unexpected keyword arguments ['foobar', 'spam'] for class StiefelConfig, these are "
        "ignored."
    )
    loaded = StiefelConfig.from_pretrained(tmp_path)
    assert len(recwarn) == 1
    assert recwarn.list[0].message.args[0].startswith(msg)
    assert not hasattr(loaded, "foobar") and not hasattr(loaded, "spam")
    assert loaded.to_dict() == config.to_dict()
    assert isinstance(peft.PeftConfig.from_pretrained(tmp_path), StiefelConfig)


def test_adapter_folder_of_a_newer_version_loads(tmp_path):
    def base():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8))

    model = get_peft_model(base(), StiefelConfig(target_modules=["0"], init_weights=False))
    x = torch.randn(3, 8)
    expected = model(x)
    model.save_pretrained(tmp_path)
    _edit_config(tmp_path, a_field_of_a_later_version=True)
    with pytest.warns(UserWarning, match="a_field_of_a_later_version"):
        loaded = PeftModel.from_pretrained(base(), tmp_path)
    _close(loaded(x), expected)


def test_unknown_keyword_in_python_names_the_allowed_ones():
    assert StiefelConfig(reflections=8).options == {"reflections": 8}  # the sugar
    assert StiefelConfig(method="scaled_cayley", negatives=1).options == {"negatives": 1}
    with pytest.raises(TypeError) as err:
        StiefelConfig(method="cayley", reflections=8)  # not an option of cayley
    words = ["unexpected keyword argument 'reflections'", "method='cayley'", "target_modules"]
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(TypeError, match="'bogus'.*options of method='cwy': reflections"):
        StiefelConfig(bogus=1)


# ---------------------------------------------------------------------------- free values
@pytest.mark.parametrize("block", [8, 16])
def test_cayley_blocks_store_as_many_values_as_peft_oft(block):
    targets = ["q_proj", "v_proj", "up_proj"]
    ours = get_peft_model(
        _llama(), StiefelConfig(method="cayley", blocks=32 // block, target_modules=targets)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oft = get_peft_model(_llama(), OFTConfig(r=0, oft_block_size=block, target_modules=targets))
    layers = 2 * len(targets)
    expected = layers * (32 // block) * block * (block - 1) // 2  # b·s(s−1)/2 per layer
    assert ours.get_nb_trainable_parameters()[0] == expected
    assert oft.get_nb_trainable_parameters()[0] == expected


@pytest.mark.parametrize("method", ["cayley", "exp", "scaled_cayley"])
def test_free_values_give_the_map_of_the_full_block(method):
    """Q from the stored values equals the map applied to the full block they come from."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 12)).double()
    cfg = StiefelConfig(method=method, blocks=3, target_modules=["0"], init_weights=False)
    rot = get_peft_model(base, cfg).base_model.model[0].stiefel_R["default"]
    (values,) = rot.originals
    assert values.shape == (3, 6)
    full = torch.zeros(3, 4, 4, dtype=torch.float64)
    rows, cols = torch.triu_indices(4, 4, 1)
    full[:, rows, cols] = values.detach()
    full = full + torch.randn(3, 4, 4, dtype=torch.float64).tril()  # entries the map never reads
    dense = torch.block_diag(*rot.maps[0](full).unbind(0))
    _close(rot.matrix(), dense, torch.float64, scale=10)


def test_folder_with_full_blocks_of_an_older_version_loads(tmp_path):
    """An older folder (full s×s originals, no map tag) gives the outputs it was saved with."""
    from safetensors.torch import load_file, save_file

    def base():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))

    cfg = StiefelConfig(method="cayley", blocks=3, target_modules=["0", "2"], init_weights=False)
    model = get_peft_model(base(), cfg)
    x = torch.randn(4, 12)
    expected = model(x)
    model.save_pretrained(tmp_path)
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    old = {}
    for key, value in tensors.items():
        if key.endswith(".stiefel_R.map"):
            continue
        if ".originals." in key:  # the full block: the values above the diagonal, junk below
            full = torch.randn(3, 4, 4).tril()
            rows, cols = torch.triu_indices(4, 4, 1)
            full[:, rows, cols] = value
            value = full
        old[key] = value
    save_file(old, file, metadata={"format": "pt"})
    loaded = PeftModel.from_pretrained(base(), tmp_path)
    _close(loaded(x), expected, scale=10)


# ---------------------------------------------------------------------------- the start
def test_reflections_start_as_peft_hra():
    """cwy's default start is PEFT HRA's paired start: the same vectors at the same seed."""
    from peft import HRAConfig

    targets = ["q_proj", "v_proj", "up_proj"]
    torch.manual_seed(7)
    ours = get_peft_model(
        _llama(), StiefelConfig(method="cwy", reflections=8, target_modules=targets)
    )
    torch.manual_seed(7)
    hra = get_peft_model(_llama(), HRAConfig(r=8, target_modules=targets))
    ids = _tokens()
    _close(_logits(ours, ids), _logits(_llama(), ids), scale=10)  # Q = I
    v_ours = [p for n, p in ours.named_parameters() if p.requires_grad]
    v_hra = [p for n, p in hra.named_parameters() if p.requires_grad]
    assert len(v_ours) == len(v_hra) == 6
    for a, b in zip(v_ours, v_hra, strict=True):
        assert torch.equal(a, b)  # PEFT's kaiming_uniform_ pairs, drawn in the same order
    for model in (ours, hra):
        model(input_ids=ids, labels=ids).loss.backward()
    for a, b in zip(v_ours, v_hra, strict=True):  # the same map: the same gradient
        _close(a.grad, b.grad, scale=100 * max(1.0, b.grad.abs().max().item()))
        assert a.grad.abs().max() > 1e-6  # not degenerate


@pytest.mark.parametrize("reflections", [1, 3, 8])
@pytest.mark.parametrize("method", ["cwy", "householder", "tcwy"])
def test_paired_start_is_the_identity_for_odd_and_even_counts(method, reflections):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16)).double()
    cfg = StiefelConfig(method=method, reflections=reflections, blocks=2, target_modules=["0"])
    rot = get_peft_model(base, cfg).base_model.model[0].stiefel_R["default"]
    eye = torch.eye(16, dtype=torch.float64)
    _close(rot.matrix(), eye, torch.float64)
    (v,) = rot.originals
    norms = torch.linalg.vector_norm(v, dim=-2)
    assert bool((norms > 0).all())  # no zero reflection (H(0) undefined)
