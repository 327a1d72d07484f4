"""rotate / merge / rotation: orthogonal fine-tuning against dense W·Q references.

``test_linear_matches_dense`` runs on every device of the ``device`` fixture (cuda
when visible); its dense reference is built on the CPU in float64.
"""

from __future__ import annotations

import copy

import geoopt
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stiefel
from stiefel import merge, optimizers, rotate, rotation
from stiefel.parametrizations import available

F64 = torch.float64
TOL = 1e3 * torch.finfo(F64).eps


def _perturb(module: nn.Module, scale: float = 0.3, seed: int = 0) -> None:
    """Move Q away from the identity (parameters of every map; projected points for riemannian)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.rotation.originals:
            step = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
            if isinstance(p, geoopt.ManifoldParameter):  # riemannian: the blocks themselves
                p.copy_(torch.linalg.qr(p + scale * step)[0])
            else:
                p.add_(scale * step)


def _perm_matrix(perm: list[int]) -> torch.Tensor:
    """PEFT's perm2mat: P[i, perm[i]] = 1 (an explicit dense permutation matrix)."""
    p = torch.zeros(len(perm), len(perm), dtype=F64)
    for i, j in enumerate(perm):
        p[i, j] = 1
    return p


def _peft_perm(n: int, blocks: int, size: int, level: int, factors: int) -> list[int]:
    """PEFT BOFT's own permutation (an independent implementation)."""
    from peft.tuners.boft.layer import BOFTLayer

    perm = BOFTLayer.block_butterfly_perm(None, n, blocks // 2**level, size // 2, factors - 1)
    return perm.tolist()


def _dense_q(module: nn.Module) -> torch.Tensor:
    """Q built explicitly: block_diag of each factor's blocks, dense P_i B P_iᵀ, product."""
    rot = module.rotation
    n, b, k = rot.features, rot.blocks, max(rot.butterfly, 1)
    q = torch.eye(n, dtype=F64)
    for i in range(k):
        blk = rot.maps[i](rot.originals[i])
        blk = blk if b > 1 else blk.unsqueeze(0)
        f = torch.block_diag(*blk.detach().cpu().unbind(0)).to(F64)
        if rot.butterfly:
            p = _perm_matrix(_peft_perm(n, b, n // b, i, k))
            f = p @ f @ p.T
        q = f @ q
    return q


@pytest.mark.parametrize("method", available())
@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("layout", [(1, 0), (4, 0), (4, 3)], ids=["full", "blocks", "butterfly"])
def test_linear_matches_dense(method, side, layout, device):
    blocks, butterfly = layout
    torch.manual_seed(0)
    lin = nn.Linear(16, 8 if side == "input" else 16, dtype=F64)
    x = torch.randn(2, 3, 16, dtype=F64)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.to(device)
    xd = x.to(device)
    rotate(lin, method, side=side, blocks=blocks, butterfly=butterfly)
    start = lin(xd).detach()
    assert start.device.type == device
    assert torch.allclose(start.cpu(), F.linear(x, w0, b0), atol=TOL)  # identity at start
    _perturb(lin)
    q = _dense_q(lin)
    assert torch.allclose(q.T @ q, torch.eye(q.shape[0], dtype=F64), atol=TOL)
    assert torch.allclose(rotation(lin).detach().cpu(), q, atol=TOL)
    ref = F.linear(x, w0 @ q if side == "input" else q @ w0, b0)
    assert torch.allclose(lin(xd).detach().cpu(), ref, atol=TOL)
    assert torch.equal(lin.weight.cpu(), w0) and not lin.weight.requires_grad
    out = lin(xd).detach()
    merge(lin)
    assert lin.weight.device.type == device
    assert torch.allclose(lin(xd).detach(), out, atol=TOL)
    assert not hasattr(lin, "rotation") and lin.weight.requires_grad


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("dim", [1, 2])
def test_conv_matches_dense(side, dim):
    torch.manual_seed(1)
    conv_cls, fn = (nn.Conv1d, F.conv1d) if dim == 1 else (nn.Conv2d, F.conv2d)
    conv = conv_cls(8, 8, 3, padding=1, dtype=F64)
    x = torch.randn(2, 8, *([5] * dim), dtype=F64)
    w0 = conv.weight.detach().clone()
    rotate(conv, "cayley", side=side, blocks=2)
    _perturb(conv)
    q = _dense_q(conv)
    if side == "input":
        wq = torch.einsum("oj...,ji->oi...", w0, q)
    else:
        wq = torch.einsum("oj,j...->o...", q, w0)
    ref = fn(x, wq, conv.bias, padding=1)
    assert torch.allclose(conv(x), ref, atol=TOL)
    out = conv(x)
    merge(conv)
    assert torch.allclose(conv(x), out, atol=TOL)


class Int8Linear(nn.Module):
    """A quantized base: int8 weight and a scale, dequantized in forward (linear in x)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        scale = w.abs().amax(1, keepdim=True) / 127
        self.register_buffer("weight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype))


def test_quantized_and_bf16_base_untouched():
    torch.manual_seed(2)
    q8 = Int8Linear(torch.randn(6, 12))
    stored = q8.weight.clone()
    rotate(q8, "cwy", reflections=4)
    _perturb(q8)
    x = torch.randn(4, 12)
    deq = q8.weight.float() * q8.scale
    assert torch.allclose(q8(x), F.linear(x, deq @ rotation(q8)), atol=1e-5)
    assert torch.equal(q8.weight, stored) and q8.weight.dtype == torch.int8
    with pytest.raises(TypeError, match="int8"):
        merge(q8)
    assert hasattr(q8, "rotation")  # nothing removed by the failed merge

    lin = nn.Linear(12, 6, dtype=torch.bfloat16)
    w = lin.weight.detach().clone()
    rotate(lin, "cayley", blocks=3)
    assert lin.rotation.dtype == torch.float32 and lin.weight.dtype == torch.bfloat16
    _perturb(lin)
    xb = torch.randn(4, 12, dtype=torch.bfloat16)
    y = lin(xb)
    assert y.dtype == torch.bfloat16 and torch.equal(lin.weight, w)
    ref = F.linear(xb.float(), w.float() @ rotation(lin), lin.bias.float())
    assert torch.allclose(y.float(), ref, atol=0.1, rtol=0.05)


def test_training_gradients_state_dict_and_merge():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    net.requires_grad_(False)  # the pretrained model is frozen, as with PEFT
    base = copy.deepcopy(net)
    rotate(net[0], "cwy", reflections=4)
    rotate(net[2], "cayley", side="output", blocks=2)
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all(".rotation." in n for n in trainable)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.05)
    x, t = torch.randn(16, 8, dtype=F64), torch.randn(16, 4, dtype=F64)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(net(x), t).backward()
        assert all(p.grad is None for n, p in net.named_parameters() if not p.requires_grad)
        opt.step()
    out = net(x)
    assert not torch.allclose(out, base(x))  # training moved Q
    fresh = copy.deepcopy(base)
    rotate(fresh[0], "cwy", reflections=4)
    rotate(fresh[2], "cayley", side="output", blocks=2)
    fresh.load_state_dict(net.state_dict())
    assert torch.allclose(fresh(x), out, atol=TOL)
    for layer in (net[0], net[2]):
        merge(layer)
    assert torch.allclose(net(x), out, atol=TOL)
    assert not net[0].weight.requires_grad  # frozen before rotate, frozen after merge
    assert set(net.state_dict()) == set(base.state_dict())


def test_riemannian_q_trained_by_rgd():
    torch.manual_seed(4)
    lin = nn.Linear(8, 8, dtype=F64)
    rotate(lin, "riemannian", blocks=2)
    (point,) = lin.rotation.originals
    opt = optimizers.create("rgd", [point], lr=0.1)
    x = torch.randn(10, 8, dtype=F64)
    for _ in range(3):
        opt.zero_grad()
        lin(x).pow(2).sum().backward()
        opt.step()
    q = rotation(lin)
    assert not torch.allclose(q, torch.eye(8, dtype=F64))
    assert torch.allclose(q.T @ q, torch.eye(8, dtype=F64), atol=TOL)


def test_bad_input_leaves_module_untouched():
    lin = nn.Linear(12, 6)
    before = {k: v.clone() for k, v in lin.state_dict().items()}

    def untouched():
        assert not hasattr(lin, "rotation") and lin.weight.requires_grad
        assert not lin._forward_pre_hooks and not lin._forward_hooks
        assert all(torch.equal(before[k], v) for k, v in lin.state_dict().items())

    with pytest.raises(ValueError, match="weight"):
        rotate(nn.ReLU())
    with pytest.raises(ValueError, match="blocks=5.*allowed: 1, 2, 3, 4, 6, 12"):
        rotate(lin, blocks=5)
    untouched()
    with pytest.raises(ValueError, match="butterfly=3"):
        rotate(lin, "cayley", blocks=6, butterfly=3)  # block size 2, 6 not divisible by 4
    untouched()
    with pytest.raises(ValueError, match="butterfly=2"):
        rotate(lin, "cayley", blocks=4, butterfly=2)  # odd block size 3
    untouched()
    with pytest.raises(ValueError, match="reflections=8"):
        rotate(lin, "cwy", blocks=4, reflections=8)  # 8 reflections cannot act on 3×3 blocks
    untouched()
    with pytest.raises(ValueError, match="method='nope'.*cwy"):
        rotate(lin, "nope")
    with pytest.raises(ValueError, match="side='left'"):
        rotate(lin, side="left")
    with pytest.raises(TypeError, match="unknown option"):
        rotate(lin, "cayley", reflections=2)
    untouched()
    with pytest.raises(ValueError, match="not rotated"):
        merge(lin)
    with pytest.raises(ValueError, match="not rotated"):
        rotation(lin)
    with pytest.raises(ValueError, match="groups=2"):
        rotate(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(TypeError, match="ConvTranspose2d"):
        rotate(nn.ConvTranspose2d(4, 4, 3))
    rotate(lin)
    with pytest.raises(TypeError, match="positionally"):
        lin(input=torch.randn(2, 12))
    with pytest.raises(ValueError, match="already rotated"):
        rotate(lin)
    assert stiefel.rotate is rotate


@pytest.mark.parametrize("method", available())
def test_complex_weight_unitary_q(method):
    torch.manual_seed(5)
    lin = nn.Linear(8, 4, dtype=torch.complex128)
    x = torch.randn(3, 8, dtype=torch.complex128)
    w0 = lin.weight.detach().clone()
    rotate(lin, method, blocks=2)
    assert lin.rotation.dtype == torch.complex128
    _perturb(lin)
    q = rotation(lin)
    assert torch.allclose(q.mH @ q, torch.eye(8, dtype=q.dtype), atol=TOL)
    assert torch.allclose(lin(x), F.linear(x, w0 @ q, lin.bias), atol=TOL)


@pytest.mark.parametrize("method", available())
@pytest.mark.parametrize("cast", [lambda m: m.to("cpu"), lambda m: m.to(torch.complex128)])
def test_a_complex_rotation_moved_or_cast_still_maps_by_its_unitary_q(method, cast):
    # every Module._apply (PEFT moves each adapter to its device) took Q's dtype from
    # the first parameter, the real phases of a complex reflection map: Q was then
    # taken as real and the forward failed on the dtypes; the reference is the dense
    # x (W Q)ᵀ + b of the cast weights
    torch.manual_seed(1)
    lin = nn.Linear(6, 6, dtype=torch.complex64)
    rotate(lin, method)
    _perturb(lin)
    cast(lin)
    assert lin.rotation.dtype == lin.weight.dtype
    x = torch.randn(3, 6, dtype=lin.weight.dtype)
    q = rotation(lin)
    eye = torch.eye(6, dtype=q.dtype)
    # as built (riemannian's Q is its parameter: cast up, it keeps complex64's accuracy)
    assert torch.dist(q.mH @ q, eye) < 50 * torch.finfo(torch.complex64).eps
    ref = F.linear(x, lin.weight @ q, lin.bias)
    assert torch.allclose(lin(x), ref, atol=50 * torch.finfo(q.dtype).eps)


@pytest.mark.parametrize(
    "options", [dict(method="cwy", reflections=2), dict(method="cayley", blocks=3)]
)
@pytest.mark.parametrize(
    ("cast", "q_dtype", "x_dtype"),
    [
        (lambda m: m.double(), torch.float64, torch.float64),
        (lambda m: m.to(torch.bfloat16), torch.float32, torch.bfloat16),
        (lambda m: m.half(), torch.float32, torch.float16),
    ],
)
def test_a_cast_of_the_rotated_module_keeps_q_in_its_precision(options, cast, q_dtype, x_dtype):
    # Note [Q keeps its precision]: after rotate, module.double() or .to(bf16) cast Q's
    # tensors while the rotation computed in its build dtype (a dtype-mismatch error at
    # the forward); the reference is the float64 product x (W Q)ᵀ + b of the cast weights
    torch.manual_seed(0)
    lin = nn.Linear(12, 12)
    lin.requires_grad_(False)
    rotate(lin, **options)
    with torch.no_grad():  # Q away from the identity
        for p in lin.rotation.parameters():
            p.add_(0.1 * torch.randn_like(p))
    cast(lin)
    rot = lin.rotation
    assert rot.dtype == q_dtype and all(p.dtype == q_dtype for p in rot.parameters())
    x = torch.randn(4, 12).to(x_dtype)
    y = lin(x)
    assert y.dtype == x_dtype
    q = rotation(lin).double()
    assert torch.dist(q.T @ q, torch.eye(12, dtype=torch.float64)) < 50 * torch.finfo(q_dtype).eps
    ref = x.double() @ (lin.weight.double() @ q).T + lin.bias.double()
    tol = 4 * torch.finfo(x_dtype).eps * ref.abs().max()
    assert (y.double() - ref).abs().max() <= tol


@pytest.mark.parametrize(
    ("built", "cast", "kept"),
    [
        (torch.complex64, torch.float64, torch.complex128),
        (torch.complex128, torch.float16, torch.complex64),
        (torch.float32, torch.complex128, torch.float64),
        (torch.float64, torch.complex64, torch.float32),
    ],
)
def test_a_cast_across_kinds_keeps_q_in_its_kind_at_the_precision_asked(built, cast, kept):
    # Note [Q keeps its precision]: the kind of Q is kept and the precision follows the
    # cast (a complex64 Q stayed complex64 under .to(torch.float64)); the reference is
    # the Q built in the kept dtype from the same values: Q of the cast original
    torch.manual_seed(0)
    lin = nn.Linear(6, 6, dtype=built)
    rotate(lin, method="cayley", blocks=2)
    with torch.no_grad():
        for p in lin.rotation.parameters():
            p.add_(0.1 * torch.randn_like(p))
    before = {name: p.detach().clone() for name, p in lin.rotation.named_parameters()}
    lin.rotation.to(cast)
    assert lin.rotation.dtype == kept
    for name, p in lin.rotation.named_parameters():
        assert p.dtype == kept
        assert torch.equal(p.detach(), before[name].to(kept))
    q = rotation(lin)
    assert q.dtype == kept
    eye = torch.eye(6, dtype=kept)
    assert torch.dist(q.mH @ q, eye) < 50 * torch.finfo(kept).eps


@pytest.mark.parametrize("cls", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_is_refused_and_left_as_it_was(cls):
    # it was accepted: Q rotated the integer indices, which then looked up other rows (or
    # raised IndexError), and merge wrote a third table
    emb = cls(12, 6)
    table = emb.weight.detach().clone()
    with pytest.raises(TypeError, match=f"{cls.__name__} is not supported .its input is indices"):
        rotate(emb, method="cayley")
    assert torch.equal(emb.weight.detach(), table) and emb.weight.requires_grad
    assert not hasattr(emb, "rotation")


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("method", ["riemannian", "cwy"])
def test_a_rotated_module_is_saved_whole_and_merges_after_loading(method, side):
    # rotate's hooks were local closures: torch.save(model) and pickle failed ("Can't
    # pickle local object"); the reference is the module before saving
    import io

    torch.manual_seed(0)
    lin = nn.Linear(8, 8, dtype=torch.float64)
    rotate(lin, method, side=side)
    with torch.no_grad():
        for p in lin.rotation.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(3, 8, dtype=torch.float64)
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), lin(x), rtol=0, atol=0)
    merge(loaded)
    assert not hasattr(loaded, "rotation")
    torch.testing.assert_close(loaded(x), lin(x), rtol=0, atol=1e-13)


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize(("nf", "nx"), [(32, 32), (96, 32)])
def test_transformers_conv1d_is_rotated_and_merged_in_its_layout(side, nf, nx):
    # Conv1D (GPT-2) stores Wᵀ, (in, out): rotate sized Q by the wrong axis (a square layer
    # merged 0.34 off its rotated forward, a non-square one failed at the forward); the
    # reference is the dense x (W Q)ᵀ + b, or x (Q W)ᵀ + b, with W = weightᵀ
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = Conv1D(nf, nx).double()
    rotate(layer, method="cayley", blocks=4, side=side)
    _perturb(layer)
    x = torch.randn(5, nx, dtype=F64)
    q, w = rotation(layer), layer.weight.detach().T
    ref = x @ (w @ q if side == "input" else q @ w).T + layer.bias
    assert torch.allclose(layer(x), ref, atol=TOL)
    merge(layer)
    assert torch.allclose(layer(x), ref, atol=TOL)


@pytest.mark.parametrize("method", available())
@pytest.mark.parametrize("side", ["input", "output"])
def test_an_empty_batch_goes_through_a_rotated_layer(method, side):
    # a batch of 0 tokens (an idle expert, an uneven shard) failed in every map on a
    # reshape of 0 elements; nn.Linear and PEFT's adapters return an empty output
    lin = nn.Linear(32, 32)
    rotate(lin, method, blocks=4, side=side)
    for shape in [(0, 32), (2, 0, 32)]:
        y = lin(torch.randn(*shape))
        assert y.shape == shape and y.dtype == torch.float32
        y.sum().backward()  # Q's parameters are used, with zero gradients (DDP needs both)
        grads = [p.grad for p in lin.rotation.parameters() if p.requires_grad]
        assert grads and all(g is not None and not g.any() for g in grads)
