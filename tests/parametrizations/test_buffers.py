"""Every buffer a map reads is checked, at load and at first use (signs, scaling, base)."""

import pytest
import torch
from torch import nn

from stiefel.manifolds.kernels import orthogonality_error
from stiefel.nn import OrthoConv2d
from stiefel.parametrizations import orthogonalize

DT = torch.float64
BUFFER = {
    "cwy": "signs",
    "tcwy": "signs",
    "householder": "signs",
    "scaled_cayley": "scaling",
    "exp": "base",
    "cayley": "base",
}


def _linear(method):
    torch.manual_seed(0)
    return orthogonalize(nn.Linear(6, 6, dtype=DT), method=method)


def _err(w):
    w = w.detach().double()
    return float(orthogonality_error(w if w.shape[-2] >= w.shape[-1] else w.mT))


@pytest.mark.parametrize("method", list(BUFFER))
def test_a_state_dict_of_random_numbers_is_refused_at_load(method):
    """Reference: the map's formula on the random buffers, whose ‖WᵀW − I‖ (float64) is > 0.5."""
    lin = _linear(method)
    fmap = lin.parametrizations.weight[0]
    bad = {k: torch.randn_like(v) for k, v in lin.state_dict().items()}
    name = BUFFER[method]
    # what the old code computed silently with those buffers (the map's own formula)
    probe = _linear(method).parametrizations.weight[0]
    with torch.no_grad():
        getattr(probe, name).copy_(bad[f"parametrizations.weight.0.{name}"])
    assert _err(probe.matrix(bad["parametrizations.weight.original"])) > 0.5
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    for assign in (False, True):
        with pytest.raises(
            ValueError, match=rf"'{method}' map\): the state dict's buffer '{name}'"
        ):
            lin.load_state_dict(bad, assign=assign)
        assert torch.equal(getattr(fmap, name), before[f"parametrizations.weight.0.{name}"])
    assert _err(lin.weight) <= 100 * 6 * torch.finfo(DT).eps


@pytest.mark.parametrize("method", list(BUFFER))
def test_bad_buffers_are_refused_at_first_use(method):
    lin = _linear(method)
    fmap = lin.parametrizations.weight[0]
    with torch.no_grad():
        getattr(fmap, BUFFER[method]).mul_(3.0)  # finite, not ±1 / not a point
    fmap.changed_outside()  # what to(), to_empty() and load_state_dict() call
    with pytest.raises(ValueError, match=rf"Linear.weight \('{method}' map\) cannot be computed"):
        lin(torch.zeros(1, 6, dtype=DT))


@pytest.mark.parametrize("method", ["cwy", "tcwy", "scaled_cayley", "exp"])
def test_to_empty_without_reset_is_refused_then_reset_gives_a_point(method):
    with torch.device("meta"):
        lin = orthogonalize(nn.Linear(8, 8 if method != "tcwy" else 3, dtype=DT), method=method)
    lin.to_empty(device="cpu")
    fmap = lin.parametrizations.weight[0]
    with torch.no_grad():  # uninitialised memory, made deterministic: finite garbage
        getattr(fmap, BUFFER[method]).fill_(0.37)
    with pytest.raises(ValueError, match=r"reset_parameters\(\)") as info:
        lin(torch.zeros(1, 8, dtype=DT))
    assert "initialize(model)" in str(info.value)
    lin.reset_parameters()
    assert _err(lin.weight) <= 100 * 8 * torch.finfo(DT).eps


def test_orthoconv_after_to_empty_is_refused_until_reset():
    """Reference: the dense-free check ‖y‖ = ‖x‖ after reset (float64)."""
    with torch.device("meta"):
        conv = OrthoConv2d(4, 4, 3, bias=False, dtype=DT)
    conv.to_empty(device="cpu")
    for _, b in conv.named_buffers():
        b.fill_(2.0)  # finite garbage in the sign buffers
    x = torch.randn(2, 4, 6, 6, dtype=DT)
    with pytest.raises(ValueError, match="reset_parameters"):
        with torch.no_grad():
            conv(x)
    conv.reset_parameters()
    assert torch.allclose(conv(x).norm(), x.norm())


def test_a_bfloat16_rounded_base_is_still_accepted_and_repaired():
    bf16 = orthogonalize(nn.Linear(16, 16, dtype=torch.bfloat16), method="exp", init="haar")
    target = orthogonalize(nn.Linear(16, 16), method="exp")
    target.load_state_dict(bf16.state_dict())
    assert _err(target.weight) <= 10 * 16 * torch.finfo(torch.float32).eps
