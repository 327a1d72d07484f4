"""One way to build: `build` serves orthogonalize, conv kernels and rotate; no import circle;
initialize finds every constrained weight; a plain function as a map (geotorch's ``triv``)."""

from __future__ import annotations

import ast
import pathlib

import geoopt
import pytest
import torch
from torch import nn

import stiefel
from stiefel.parametrizations import (
    CWY,
    FunctionMap,
    ManifoldPoint,
    available,
    build,
    initialize,
    kernels,
    orthogonalize,
)

F64 = torch.float64
PKG = pathlib.Path(stiefel.__file__).parent / "parametrizations"


def err64(q: torch.Tensor) -> float:
    q = q.detach().to(F64)
    q = q.mT if q.shape[-2] < q.shape[-1] else q
    eye = torch.eye(q.shape[-1], dtype=F64)
    return float(torch.linalg.matrix_norm(q.mT @ q - eye).max())


def kernel_matrix(conv: nn.Conv2d) -> torch.Tensor:
    """√k·K̂ from the weight, written out (independent of ConvKernel.kernel_matrix)."""
    w = conv.weight.detach().to(F64)
    k = w[0, 0].numel()
    return w.reshape(w.shape[0], -1).T * k**0.5


def test_no_import_circle_in_parametrizations():
    """Every relative import (also inside functions) of parametrizations/: an acyclic graph."""
    graph = {}
    for path in PKG.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module.split(".")[0])
        graph[path.stem] = deps & {p.stem for p in PKG.glob("*.py")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            assert state.get(dep) != 1, f"import circle: {' -> '.join([*trail, node, dep])}"
            if dep not in state:
                visit(dep, [*trail, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_build_is_the_constructor_of_every_constrained_weight():
    lin = orthogonalize(nn.Linear(6, 6), method="cwy", reflections=3, init="random")
    conv = orthogonalize(nn.Conv2d(2, 3, 3, bias=False), method="cwy", conv_kernel=True)
    rot = stiefel.rotate(nn.Linear(6, 4), method="cwy", reflections=3)
    assert type(lin.parametrizations.weight[0]) is CWY
    assert type(conv.parametrizations.weight[0].map) is CWY
    assert type(rot.rotation.maps[0]) is CWY and rot.rotation.maps[0].reflections == 3
    fmap = build("cwy", (6, 6), torch.float32, options={"reflections": 3})
    assert fmap.reflections == 3 and not fmap.reaches_every_point
    point = build("riemannian", (5, 3), F64)
    assert isinstance(point, ManifoldPoint) and point.manifold.n == 5
    with pytest.raises(ValueError, match="method.*allowed.*householder"):
        build("nope", (4, 4), torch.float32)
    with pytest.raises(TypeError, match="unknown option.*bogus.*allowed.*reflections"):
        build("cwy", (4, 4), torch.float32, options={"bogus": 1})
    with pytest.raises(ValueError, match="wide"):
        build("riemannian", (3, 5), torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        build("cwy", (4, 4), torch.int64)
    assert "riemannian" in available()


@pytest.mark.parametrize("method", ["cwy", "exp", "riemannian"])
def test_initialize_writes_conv_kernels(method):
    """The bug: initialize skipped conv_kernel=True weights (and refused a model of one)."""
    with torch.device("meta"):
        conv = orthogonalize(nn.Conv2d(2, 3, 3, bias=False), method=method, conv_kernel=True)
    conv.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*conv.parameters(), *conv.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else 0)
    initialize(conv, generator=torch.Generator().manual_seed(0))
    assert err64(kernel_matrix(conv)) <= 100 * 18 * torch.finfo(torch.float32).eps
    if method == "riemannian":
        assert isinstance(conv.parametrizations.weight.original, geoopt.ManifoldParameter)


def test_riemannian_conv_kernel_keeps_the_parameter_object():
    conv = nn.Conv2d(2, 3, 3, bias=False)
    w = conv.weight
    orthogonalize(conv, method="riemannian", conv_kernel=True)
    original = conv.parametrizations.weight.original
    assert original is w and isinstance(original, geoopt.ManifoldParameter)
    assert original.shape == (18, 3) and err64(original) < 1e-5


def test_plain_function_as_a_map_matches_exp():
    torch.manual_seed(0)
    q0 = torch.linalg.qr(torch.randn(5, 5, dtype=F64))[0]
    w = orthogonalize(q0.clone(), method=torch.linalg.matrix_exp)
    assert isinstance(w.map, FunctionMap) and torch.allclose(w(), q0, atol=1e-12)
    raw = torch.randn(5, 5, dtype=F64)
    with torch.no_grad():
        w.parametrizations.weight.original.copy_(raw)
    ref = w.map.base @ torch.linalg.matrix_exp(kernels.skew_from_raw(raw))  # the formula
    assert torch.allclose(w(), ref, atol=1e-12) and err64(w()) < 1e-12
    w().sum().backward()  # gradients reach the free parameter
    assert w.parametrizations.weight.original.grad is not None


def test_plain_function_with_an_inverse_and_its_errors():
    def cayley(a):  # an involution: its own inverse
        eye = torch.eye(a.shape[-1], dtype=a.dtype)
        return torch.linalg.solve(eye + a, eye - a)

    torch.manual_seed(1)
    q = torch.linalg.matrix_exp(kernels.skew_from_raw(torch.randn(6, 6, dtype=F64)))  # det +1
    lin = orthogonalize(nn.Linear(6, 6, dtype=F64), method=cayley, inverse=cayley, init="identity")
    lin.weight = q
    assert torch.allclose(lin.weight, q, atol=1e-10)
    fmap = lin.parametrizations.weight[0]
    assert torch.equal(fmap.base, torch.eye(6, dtype=F64))  # A carries Q: the base stays I

    def minus(a):  # f(0) = −I: no base point trick
        return -torch.linalg.matrix_exp(a)

    with pytest.raises(ValueError, match=r"function\(0\) is not the identity.*inverse="):
        orthogonalize(nn.Linear(4, 4), method=minus)
    with pytest.raises(TypeError, match="unknown option.*allowed.*inverse"):
        orthogonalize(nn.Linear(4, 4), method=cayley, inverse_map=cayley)
