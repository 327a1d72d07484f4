"""Every kernel dispatcher's other paths against its reference path, one property test each.

For each registered dispatcher (`stiefel.dispatch.dispatchers`) a case function builds
inputs on which the policy picks each non-reference path that can run here (the test
asserts that it does, by calling the dispatcher), runs the operation, and compares it
with the same operation under `stiefel.dispatch.policy(reference=True)`, where the
dispatcher answers its reference path: values and, where the operation is
differentiable, gradients for one random cotangent, in float64, within ~100·n·eps.
A dispatcher without a case fails `test_every_dispatcher_has_a_case` (the cases of the
optimizer kernels' dispatchers live in tests/manifolds/test_kernel_dispatch.py, named
in ``COVERED_ELSEWHERE``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from stiefel import dispatch
from stiefel.parametrizations import _cayley
from stiefel.parametrizations import kernels as K
from stiefel.parametrizations._spectral import SPECTRAL_THRESHOLD, LazyNorm

#: dispatchers whose property cases are written in another test file
#: tested in tests/manifolds/test_kernel_dispatch.py
COVERED_ELSEWHERE: set[str] = {"near_identity_solve", "wide_gram", "minus_adjoint"}

EPS = torch.finfo(torch.float64).eps
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@dataclass
class Case:
    """One input on which the policy picks ``path``.

    ``choose()`` calls the dispatcher on the inputs; ``run(*inputs)`` is the operation;
    ``tol`` the largest entry difference allowed, relative to the largest entry.
    """

    path: str
    choose: Callable[[], str]
    run: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    grad: bool = True
    tol: float = 0.0
    compiled: bool = False


CASES: dict[str, Callable[[str], Iterator[Case]]] = {}


def case(name: str):
    def register(fn: Callable[[str], Iterator[Case]]):
        CASES[name] = fn
        return fn

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _skew(n: int, norm1: float, seed: int, device: str, dtype=torch.float64) -> torch.Tensor:
    """A random skew-Hermitian n×n A with ‖A‖₁ = norm1."""
    x = torch.randn(n, n, generator=_gen(seed), dtype=dtype)
    a = x - x.mH
    return (a * (norm1 / float(torch.linalg.matrix_norm(a, ord=1)))).to(device)


def _from_raw(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op`` of A = `skew_from_raw` (raw), as the maps call it: gradients along skew A only."""
    return lambda raw, *rest: op(K.skew_from_raw(raw), *rest)


def _compiled_path(dispatch, fn: Callable[..., torch.Tensor]) -> tuple[Callable, Callable]:
    """(choose, run) of ``fn`` under torch.compile: the dispatcher's answer while traced."""
    seen: list[str] = []

    def traced(raw, *rest):
        a = K.skew_from_raw(raw)
        seen.append(dispatch(a, LazyNorm(a)))
        return fn(a, *rest)

    compiled = torch.compile(traced, backend="eager", fullgraph=True)

    def choose() -> str:
        return seen[-1] if seen else "not traced"

    return choose, compiled


@case("skew_from_raw")
def _skew_from_raw(device: str) -> Iterator[Case]:
    if device != "cpu":
        return
    for dtype in (torch.float64, torch.complex128):
        x = torch.randn(K.PANELS_FROM + 3, K.PANELS_FROM + 3, generator=_gen(0), dtype=dtype)
        yield Case("panels", lambda x=x: K.skew_from_raw_path(x), K.skew_from_raw, (x,), tol=0.0)


@case("exp_map")
def _exp_map(device: str) -> Iterator[Case]:
    n = 8
    base = torch.linalg.qr(torch.randn(n, n, generator=_gen(1), dtype=torch.float64))[0]
    base = base.to(device)
    pade = "pade_cholesky" if device == "cuda" else "pade"
    exp, raw = _from_raw(K.exp_map), K.raw_from_skew
    for norm1 in (0.1, 2.0, 30.0):  # Padé degree 5, 9, 13 with three squarings
        a = _skew(n, norm1, 2, device)
        yield Case(pade, lambda a=a: K.exp_path(a, LazyNorm(a)), exp, (raw(a), base))
    # eigh above max(64, 4n): the reference's squarings are the error here
    big = 1.5 * SPECTRAL_THRESHOLD
    a = _skew(n, big, 3, device)
    yield Case("eigh", lambda: K.exp_path(a, LazyNorm(a)), exp, (raw(a), base), tol=big)
    a = _skew(n, 1.0, 4, device)
    choose, run = _compiled_path(K.exp_path, K.exp_map)
    yield Case("traced", choose, run, (raw(a), base), compiled=True)


@case("cayley_map")
def _cayley_map(device: str) -> Iterator[Case]:
    n = 8
    d = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64, device=device)
    cayley, scaled, raw = _from_raw(K.cayley_map), _from_raw(K.scaled_cayley_map), K.raw_from_skew
    big = 1.5 * SPECTRAL_THRESHOLD
    a = _skew(n, big, 5, device)
    yield Case("eigh", lambda: K.cayley_path(a, LazyNorm(a)), cayley, (raw(a),), tol=big)
    yield Case("eigh", lambda: K.cayley_path(a, LazyNorm(a)), scaled, (raw(a), d), tol=big)
    chosen = _from_raw(lambda a: K.cayley_map(a, spectral=True))  # the caller's choice
    yield Case("eigh", lambda: K.cayley_path(a, None, True), chosen, (raw(a),), tol=big)
    a = _skew(n, 1.0, 6, device)
    choose, run = _compiled_path(K.cayley_path, K.cayley_map)
    yield Case("traced", choose, run, (raw(a),), compiled=True)
    # elimination without pivoting: n above the block, ‖A‖₁ within 4√n
    if device == "cpu":
        n, path = K.UNPIVOTED_BLOCKS_FROM + 5, "unpivoted_blocks"
    else:
        n, path = K.UNPIVOTED_LU_FROM, "unpivoted_lu"
    a = _skew(n, 0.9 * _cayley.UNPIVOTED_PER_ROOT * math.sqrt(n), 7, device)
    b = torch.randn(n, 3, generator=_gen(8), dtype=torch.float64).to(device)
    d = torch.ones(4, dtype=torch.float64, device=device)
    yield Case(path, lambda: K.cayley_path(a, LazyNorm(a)), cayley, (raw(a), b))
    yield Case(path, lambda: K.cayley_path(a, LazyNorm(a)), scaled, (raw(a), d))


def _names() -> list[str]:
    return sorted(dispatch.dispatchers())


def test_every_dispatcher_has_a_case():
    missing = [n for n in _names() if n not in CASES and n not in COVERED_ELSEWHERE]
    assert not missing, f"dispatchers without a property case: {missing}"


def test_every_non_reference_path_is_reached_or_device_bound():
    # each path other than the reference is picked by some case on this machine, or is
    # one that only another device takes
    device_only = {"pade_cholesky", "unpivoted_lu"}
    for name, fn in CASES.items():
        d = dispatch.dispatchers()[name]
        reached = {c.path for dev in DEVICES for c in fn(dev)}
        assert reached <= set(d.paths[1:]), (name, reached)
        left = set(d.paths[1:]) - reached - device_only
        assert not left, f"{name}: no case reaches {sorted(left)}"


def _outputs(c: Case, cotangent: torch.Tensor | None = None):
    inputs = [
        t.detach().clone().requires_grad_(c.grad and (t.is_floating_point() or t.is_complex()))
        for t in c.inputs
    ]
    if c.compiled:
        torch._dynamo.reset()
    out = c.run(*inputs)
    if not c.grad:
        return out.detach(), []
    w = torch.randn(out.shape, generator=_gen(10), dtype=out.dtype).to(out.device)
    leaves = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad((out * w).real.sum(), leaves)
    return out.detach(), list(grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", _names())
def test_each_path_equals_the_reference(name, device):
    if name not in CASES:
        pytest.skip(f"{name}: its cases are in another file (COVERED_ELSEWHERE)")
    d = dispatch.dispatchers()[name]
    for c in CASES[name](device):
        assert c.choose() == c.path or c.compiled, (name, c.path, c.choose())
        got, got_grads = _outputs(c)
        if c.compiled:  # the dispatcher's answer while traced
            assert c.choose() == c.path, (name, c.path, c.choose())
        with dispatch.policy(reference=True):
            if not c.compiled:
                assert c.choose() == d.reference
            want, want_grads = _outputs(c)
        n = max(t.shape[-1] for t in c.inputs)
        tol = 100 * n * EPS * max(1.0, c.tol)
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= tol * max(1.0, scale), (name, c.path)
        for g, r in zip(got_grads, want_grads, strict=True):
            gscale = max(1.0, float(r.abs().max()))
            assert float((g - r).abs().max()) <= tol * gscale, (name, c.path, "gradient")


def test_policy_refuses_a_non_bool():
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="reference="):
            with dispatch.policy(reference=bad):
                pass
    assert not dispatch.reference_forced()


def test_policy_is_restored_after_an_exception_and_nests():
    a = _skew(5, 1.0, 0, "cpu")
    assert K.exp_path(a, LazyNorm(a)) == "pade"
    with pytest.raises(RuntimeError, match="inside"):
        with dispatch.policy(reference=True):
            assert dispatch.reference_forced()
            assert K.exp_path(a, LazyNorm(a)) == "matrix_exp"
            raise RuntimeError("inside")
    assert not dispatch.reference_forced()
    assert K.exp_path(a, LazyNorm(a)) == "pade"
    with dispatch.policy(reference=True):
        with dispatch.policy(reference=False):
            assert K.exp_path(a, LazyNorm(a)) == "pade"
        assert K.exp_path(a, LazyNorm(a)) == "matrix_exp"
    assert not dispatch.reference_forced()


def test_the_reference_exp_reads_no_norm():
    # under the reference policy the path is torch's matrix_exp, chosen without a host read
    a = _skew(5, 1.0, 0, "cpu")
    norm = LazyNorm(a)
    with dispatch.policy(reference=True):
        assert K.exp_path(a, norm) == "matrix_exp"
    assert norm._read is False
    assert K.exp_path(a, norm) == "pade" and norm._read is True
