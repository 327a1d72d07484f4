"""stiefel.integrations.peft.accelerate against PEFT's own forward (tiny local models)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _models import tiny_llama
from torch import nn

peft = pytest.importorskip("peft")
from peft import BOFTConfig, HRAConfig, LoraConfig, OFTConfig, get_peft_model  # noqa: E402

from stiefel.integrations.peft import accelerate, cayley_neumann, restore  # noqa: E402

F64 = torch.float64

CONFIGS = {
    "hra": lambda: HRAConfig(r=4, target_modules=["0", "2"], init_weights=False),
    "oft": lambda: OFTConfig(r=0, oft_block_size=4, target_modules=["0", "2"], init_weights=False),
    "oft_exact": lambda: OFTConfig(
        r=0,
        oft_block_size=4,
        target_modules=["0", "2"],
        init_weights=False,
        use_cayley_neumann=False,
    ),
    "boft": lambda: BOFTConfig(
        boft_block_size=4, boft_n_butterfly_factor=1, target_modules=["0", "2"], init_weights=False
    ),
}


def _model(kind: str, seed: int = 0, dtype=F64):
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BOFT's CUDA-extension notice on CPU
        model = get_peft_model(base, CONFIGS[kind]())
    with torch.no_grad():  # move every adapter away from its initial value
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if p.requires_grad and "boft_s" not in n:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _grads(model, x):
    model.zero_grad()
    out = model(x)
    out.pow(2).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_outputs_gradients_state_dict_match_peft(kind):
    ref = _model(kind)
    fast = copy.deepcopy(ref)
    keys = {k: v.clone() for k, v in fast.state_dict().items()}
    accelerate(fast)
    swapped = [m for m in fast.modules() if "forward" in m.__dict__]
    assert len(swapped) == 2  # both adapted layers run the accelerated forward
    assert {k: v.clone() for k, v in fast.state_dict().items()}.keys() == keys.keys()
    assert all(torch.equal(keys[k], v) for k, v in fast.state_dict().items())
    x = torch.randn(3, 5, 16, dtype=F64)
    y_ref, g_ref = _grads(ref, x)
    y, g = _grads(fast, x)
    assert torch.allclose(y, y_ref, atol=1e-10, rtol=0)
    assert g.keys() == g_ref.keys()
    for n in g:
        assert torch.allclose(g[n], g_ref[n], atol=1e-10, rtol=0), n
    merged = fast.merge_and_unload()
    assert torch.allclose(merged(x), y_ref, atol=1e-10, rtol=0)


def test_exact_cayley_option_is_orthogonal_where_neumann_drifts():
    ref = _model("oft")
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "oft_R" in n:
                p.mul_(8)  # large skew parameters: the series is far from orthogonal
    fast = accelerate(copy.deepcopy(ref), exact_cayley=True)
    x = torch.randn(4, 16, dtype=F64)
    # exact Cayley blocks reproduce PEFT's own exact Cayley (use_cayley_neumann=False)
    exact = copy.deepcopy(ref)
    for layer in exact.modules():
        if hasattr(layer, "use_cayley_neumann"):
            layer.use_cayley_neumann = False
    assert torch.allclose(fast(x), exact(x), atol=1e-10, rtol=0)
    assert not torch.allclose(fast(x), ref(x), atol=1e-3)
    rot = ref.base_model.model[0].oft_R["default"]
    from stiefel.integrations.peft.acceleration import _cayley, _skew

    a = _skew(rot.weight.detach(), rot.block_size)
    eye = torch.eye(4, dtype=F64)
    r_series = cayley_neumann(a, 5)
    r_exact = _cayley(a)
    assert torch.allclose(r_series, rot._cayley_batch(rot.weight.detach(), 4), atol=1e-12)
    assert (r_exact.mT @ r_exact - eye).norm() < 1e-12
    assert (r_series.mT @ r_series - eye).norm() > 1e-2


@pytest.mark.slow
def test_llama_compile_and_restore():
    base = tiny_llama().eval()
    model = get_peft_model(base, HRAConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "hra_u" in n:
                p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 32, (2, 8))
    ref = model(input_ids=ids).logits
    accelerate(model)
    assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-5)
    compiled = torch.compile(model.base_model.model.model.layers[0].self_attn.q_proj)
    x = torch.randn(2, 8, 16)
    # compiled and eager differ by float32 rounding (Inductor's fused order differs by CPU)
    tol = 10 * base.config.hidden_size * torch.finfo(torch.float32).eps
    eager = model.base_model.model.model.layers[0].self_attn.q_proj(x)
    torch.testing.assert_close(compiled(x), eager, atol=tol, rtol=0.0)
    restore(model)
    assert "forward" not in model.base_model.model.model.layers[0].self_attn.q_proj.__dict__
    assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-6)


def test_warnings_and_errors(monkeypatch):
    torch.manual_seed(0)
    lora = get_peft_model(nn.Sequential(nn.Linear(8, 8)), LoraConfig(r=2, target_modules=["0"]))
    with pytest.warns(UserWarning, match=r"no supported layer.*found: .*lora\.layer\.Linear"):
        accelerate(lora)
    assert "forward" not in lora.base_model.model[0].__dict__
    with pytest.warns(UserWarning, match="no PEFT layer at all"):
        accelerate(nn.Linear(3, 3))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        accelerate("model")
    with pytest.raises(TypeError, match="exact_cayley='yes' is not allowed; allowed: True, False"):
        accelerate(nn.Linear(3, 3), exact_cayley="yes")
    monkeypatch.setattr(peft, "__version__", "0.6.0")
    with pytest.raises(ImportError, match=r"PEFT 0\.6\.0 is not supported.*allowed"):
        accelerate(_model("hra"))


# ---------------------------------------------------------------------------- standard recipes
def _accelerated_pair(kind: str, dtype=F64):
    ref = _model(kind, dtype=dtype)
    return ref, accelerate(copy.deepcopy(ref))


@pytest.mark.parametrize("kind", ["oft", "boft", "hra"])
def test_training_after_an_inference_mode_forward(kind, monkeypatch):
    """Index caches made under torch.inference_mode() must not break later training."""
    from stiefel.integrations.peft import acceleration

    monkeypatch.setattr(acceleration, "_TRIU", {})  # empty caches: the first use fills them
    ref, fast = _accelerated_pair(kind)
    x = torch.randn(3, 16, dtype=F64)
    late = copy.deepcopy(ref)
    with torch.inference_mode():
        fast(x)
        accelerate(late)  # accelerated inside inference mode too
        late(x)
    for model in (fast, late):
        y, g = _grads(model, x)
        y_ref, g_ref = _grads(ref, x)
        assert torch.allclose(y, y_ref, atol=1e-10, rtol=0)
        assert all(torch.allclose(g[n], g_ref[n], atol=1e-10, rtol=0) for n in g_ref)


@pytest.mark.parametrize("kind", ["oft", "boft", "hra"])
def test_accelerated_model_pickles_whole(kind):
    import io
    import pickle

    ref, fast = _accelerated_pair(kind)
    x = torch.randn(3, 16, dtype=F64)
    buffer = io.BytesIO()
    torch.save(fast, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    again = pickle.loads(pickle.dumps(fast))
    for model in (loaded, again):
        assert all("forward" in m.__dict__ for m in model.modules() if hasattr(m, "base_layer"))
        assert torch.allclose(model(x), ref(x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", ["hra", "boft", "oft_exact"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_adapters_run_as_in_peft(kind, dtype):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_peft_model(base, CONFIGS[kind](), autocast_adapter_dtype=False)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if p.requires_grad and "boft_s" not in n:
                assert p.dtype == dtype
                p.add_(0.2 * torch.randn_like(p))
    fast = accelerate(copy.deepcopy(ref))
    x = torch.randn(4, 16, dtype=dtype)
    y_ref, y = ref(x), fast(x)
    assert y.dtype == y_ref.dtype == dtype
    assert torch.allclose(y.float(), y_ref.float(), atol=0.05, rtol=0.05)
    y.float().sum().backward()


@pytest.mark.parametrize("kind", ["hra", "oft", "boft"])
def test_adapters_added_after_accelerate_are_accelerated(kind):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)).to(F64)
    first = CONFIGS[kind]()
    first.target_modules = ["0"]  # layer 2 gets its PEFT layer only from add_adapter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_peft_model(base, first)
    fast = accelerate(copy.deepcopy(ref))
    for model in (ref, fast):
        torch.manual_seed(3)
        config = CONFIGS[kind]()
        config.target_modules = ["2"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.add_adapter("second", config)
        model.base_model.set_adapter(["default", "second"])
    assert "forward" in fast.base_model.model[2].__dict__
    x = torch.randn(3, 16, dtype=F64)
    assert torch.allclose(fast(x), ref(x), atol=1e-10, rtol=0)
    restore(fast)
    assert "inject_adapter" not in fast.base_model.__dict__


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_peft_workflows_give_peft_results(kind, tmp_path):
    """merge, unmerge, safe_merge, disable_adapter, several adapters, save/load (PEFT's tests)."""
    from safetensors.torch import load_file

    ref, fast = _accelerated_pair(kind)
    x = torch.randn(3, 16, dtype=F64)

    def same():
        assert torch.allclose(fast(x), ref(x), atol=1e-10, rtol=0)

    for model in (ref, fast):
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.add_adapter("other", CONFIGS[kind]())
    same()
    for model in (ref, fast):
        model.set_adapter("other")
    same()
    for model in (ref, fast):
        model.base_model.set_adapter(["default", "other"])
    same()
    for model in (ref, fast):
        with model.disable_adapter():
            pass
    with fast.disable_adapter(), ref.disable_adapter():
        same()
    for safe in (False, True):
        for model in (ref, fast):
            model.merge_adapter(safe_merge=safe)
        same()
        for model in (ref, fast):
            model.unmerge_adapter()
        same()
    fast.save_pretrained(tmp_path / "fast")
    ref.save_pretrained(tmp_path / "ref")
    for name in ("default", "other"):
        sub = "" if name == "default" else name
        saved = load_file(tmp_path / "fast" / sub / "adapter_model.safetensors")
        expected = load_file(tmp_path / "ref" / sub / "adapter_model.safetensors")
        assert saved.keys() == expected.keys()
        assert all(torch.equal(saved[k], expected[k]) for k in saved)
