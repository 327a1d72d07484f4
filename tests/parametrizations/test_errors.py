"""Bad input: clear ValueError / TypeError naming argument, value and allowed values; no change."""

import pytest
import torch
from torch.nn.utils import parametrize

from stiefel.parametrizations import (
    OrthogonalMap,
    available,
    get,
    maps,
    orthogonalize,
    register,
)
from stiefel.parametrizations import base as base_module


def snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}, type(module)


def assert_unchanged(module, snap):
    state, cls = snap
    assert type(module) is cls and not parametrize.is_parametrized(module)
    now = module.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.allclose(now[k], state[k], rtol=0, atol=0, equal_nan=True)


def test_unknown_method_lists_available():
    lin = torch.nn.Linear(3, 3)
    snap = snapshot(lin)
    with pytest.raises(ValueError, match="method='qr'.*householder, cwy, tcwy, exp"):
        orthogonalize(lin, method="qr")
    assert_unchanged(lin, snap)
    with pytest.raises(ValueError, match="method=3"):
        orthogonalize(torch.randn(3, 3), method=3)


@pytest.mark.parametrize(
    ("L", "error"),
    [(0, ValueError), (6, ValueError), (-1, ValueError)]
    + [(2.5, TypeError), (True, TypeError), ("3", TypeError)],  # not an int: the wrong type
)
def test_reflections_out_of_range(L, error):
    lin = torch.nn.Linear(5, 5)
    snap = snapshot(lin)
    with pytest.raises(error, match=r"reflections=.*1 <= reflections <= 5"):
        orthogonalize(lin, method="cwy", reflections=L)
    assert_unchanged(lin, snap)


def test_tensor_must_be_at_least_2d():
    with pytest.raises(ValueError, match=r"tensor must have at least 2 dimensions.*\(5,\)"):
        orthogonalize(torch.randn(5), method="cwy")
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match="module.weight must have at least 2 dimensions"):
        orthogonalize(m)


def test_bad_dtype_and_type():
    with pytest.raises(TypeError, match="dtype torch.int64; allowed: torch.float32"):
        orthogonalize(torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="module_or_tensor must be an nn.Module"):
        orthogonalize([[1.0, 0.0], [0.0, 1.0]])


def test_complex_with_real_only_option_and_method():
    with pytest.raises(ValueError, match="negatives=1 is a real-only option"):
        orthogonalize(
            torch.randn(3, 3, dtype=torch.complex128), method="scaled_cayley", negatives=1
        )

    saved = base_module.MAPS.snapshot()

    @register("_real_only_test")
    class RealOnly(OrthogonalMap):
        real_only = True

        def matrix(self, x):
            return x

        def inverse(self, q):
            return q

    try:
        w = torch.randn(3, 3, dtype=torch.complex64)
        with pytest.raises(ValueError, match="cannot serve a complex weight.*householder, cwy"):
            orthogonalize(w, method="_real_only_test")
        assert "_real_only_test" in available()
        assert orthogonalize(torch.eye(3), method="_real_only_test").method == "_real_only_test"
    finally:
        base_module.MAPS.restore(saved)


def test_non_finite_at_registration():
    lin = torch.nn.Linear(3, 3)
    with torch.no_grad():
        lin.weight[0, 1] = float("nan")
    snap = snapshot(lin)
    with pytest.raises(ValueError, match="module.weight has 1 non-finite entries"):
        orthogonalize(lin)
    assert_unchanged(lin, snap)


def test_right_inverse_off_manifold_gives_distance_and_projx():
    w = orthogonalize(torch.randn(4, 4, dtype=torch.float64), method="householder")
    before = w().detach().clone()
    with pytest.raises(ValueError, match=r"‖QᴴQ − I‖_F = 2\.000e\+00 .*projx"):
        w.weight = 2**0.5 * torch.eye(4, dtype=torch.float64)  # QᴴQ − I = I, norm √4
    assert torch.equal(w(), before)
    with pytest.raises(ValueError, match="shape"):
        w.weight = torch.eye(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="real dtype"):
        w.weight = torch.eye(4, dtype=torch.complex128)
    with pytest.raises(ValueError, match="non-finite"):
        w.weight = torch.full((4, 4), float("inf"), dtype=torch.float64)
    assert torch.equal(w(), before)


@pytest.mark.parametrize("method", list(maps()))  # "riemannian"'s weight is a Parameter
@pytest.mark.parametrize(
    ("weight", "value"),
    [
        (torch.float64, torch.float32),
        (torch.float32, torch.float64),
        (torch.complex128, torch.complex64),
        (torch.bfloat16, torch.float32),
    ],
)
def test_a_point_of_another_precision_is_assigned_in_the_weights(method, weight, value):
    # Note [A point assigned in another precision]: torch refused the original only
    # after the map's inverse had set its base, signs or phases, and the weight was
    # left 3.3 from the old point and 1.0 from Q; the reference is Q itself, to the
    # coarser of the two precisions
    torch.manual_seed(0)
    w = orthogonalize(torch.randn(5, 5, dtype=weight), method=method)
    with torch.no_grad():  # away from the start, as after training
        for p in w.parameters():
            p.add_(0.3)
    q = torch.linalg.qr(torch.randn(5, 5, dtype=value))[0]
    w.weight = q
    assert w().dtype == weight
    tol = 10 * 5 * max(torch.finfo(weight).eps, torch.finfo(value).eps)  # bf16: 0.39, |Q − Q'| ≈ 3
    assert torch.dist(w().to(value), q) < tol


def test_bad_options_and_names():
    lin = torch.nn.Linear(3, 3)
    snap = snapshot(lin)
    with pytest.raises(
        TypeError, match="unknown option.*foo.*allowed: init, generator, reflections"
    ):
        orthogonalize(lin, method="cwy", foo=1)
    with pytest.raises(ValueError, match="init='zeros'.*nearest, haar, identity, random"):
        orthogonalize(lin, init="zeros")
    with pytest.raises(ValueError, match="name='bias2'.*allowed: weight, bias"):
        orthogonalize(lin, "bias2")
    with pytest.raises(ValueError, match="block=0"):
        orthogonalize(lin, method="householder", block=0)
    with pytest.raises(ValueError, match=r"negatives=4.*0 <= negatives <= 3"):
        orthogonalize(lin, method="scaled_cayley", negatives=4)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        orthogonalize(lin, generator=0)
    with pytest.raises(TypeError, match="unknown option.*reflections.*riemannian"):
        orthogonalize(lin, method="riemannian", reflections=2)
    assert_unchanged(lin, snap)
    orthogonalize(lin)
    with pytest.raises(ValueError, match="already parametrized"):
        orthogonalize(lin)


def test_riemannian_refuses_wide_and_names_the_methods_that_can():
    lin = torch.nn.Linear(6, 3)  # weight (3, 6): wide
    snap = snapshot(lin)
    with pytest.raises(ValueError, match="riemannian.*wide.*householder, cwy, tcwy") as err:
        orthogonalize(lin, method="riemannian")
    assert_unchanged(lin, snap)
    # every registered map can (the registry, not a hand list)
    named = str(err.value).rpartition("methods that can: ")[2].split(", ")
    assert named == [m for m in available() if m != "riemannian"]


def test_register_errors():
    with pytest.raises(TypeError, match="OrthogonalMap subclasses"):
        register("_x")(object)
    with pytest.raises(ValueError, match="already registered"):
        register("cwy")(type("Other", (OrthogonalMap,), {}))
    with pytest.raises(ValueError, match="non-empty str"):
        register("")
    with pytest.raises(ValueError, match="method='nope'"):
        get("nope")
