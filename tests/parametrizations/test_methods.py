"""What `orthogonalize` adds over the maps' conformance (test_conformance.py here).

The conformance suite checks every registered map for the manifold in every dtype,
assignment of a Haar point, gradcheck, batches and state_dict; this file checks, for
every method (the maps and "riemannian"), the manifold object and method the module
reports, `W.linear` and `W.operator()` against the dense product, the round trip of
special points (det −1, −I, a rotation by π), reflections, inits and the methods'
own options.
"""

import pytest
import torch

from stiefel.manifolds import Orthogonal, Stiefel, Unitary
from stiefel.parametrizations import available, maps, orthogonalize

MAPS = list(maps())  # the registry, never a hand list
METHODS = available()
REFLECTION_MAPS = [name for name, cls in maps().items() if cls.takes_reflections()]
CASES = {  # name: (shape, complex)
    "square_real": ((5, 5), False),
    "square_complex": ((5, 5), True),
    "tall_real": ((7, 3), False),
    "tall_complex": ((7, 3), True),
    "wide_real": ((3, 7), False),
    "batched": ((2, 4, 4), False),
    "batched_tall_complex": ((2, 6, 2), True),
}
PRECISIONS = {"low": (torch.float32, torch.complex64), "high": (torch.float64, torch.complex128)}


def dtype_of(case, precision):
    real, cplx = PRECISIONS[precision]
    return cplx if CASES[case][1] else real


def tall(w):
    return w.mT if w.shape[-2] < w.shape[-1] else w


def orth_err(w):
    w = tall(w.detach())
    eye = torch.eye(w.shape[-1], dtype=w.dtype)
    return float(torch.linalg.matrix_norm(w.mH @ w - eye).max())


def tol(dtype, n):
    """10·n·eps of the dtype (the contract's bound for a freshly computed point)."""
    return 10 * n * torch.finfo(dtype).eps


def skip_if_unsupported(method, case):
    if method == "riemannian" and case.startswith("wide"):
        pytest.skip("riemannian weights must be tall (tested in test_errors)")


def test_available_lists_every_method():
    assert available() == [*maps(), "riemannian"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_on_manifold_and_linear(method, case, precision):
    skip_if_unsupported(method, case)
    shape, _ = CASES[case]
    dtype = dtype_of(case, precision)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(*shape, dtype=dtype, generator=gen)
    w = orthogonalize(x0, method=method)
    q = w()
    n = max(shape[-2:])
    assert q.shape == shape and q.dtype == dtype
    assert orth_err(q) < tol(dtype, n)
    man = w.manifold
    assert man.n == n and man.m == min(shape[-2:]) and man.complex == dtype.is_complex
    if n == man.m:
        assert isinstance(man, Unitary if dtype.is_complex else Orthogonal)
    else:
        assert type(man) is Stiefel
    assert w.method == method
    # it starts at the point nearest the tensor (the polar factor)
    hi = x0.to(torch.complex128 if dtype.is_complex else torch.float64)
    u, _, vh = torch.linalg.svd(hi, full_matrices=False)
    assert (q.to(hi.dtype) - u @ vh).abs().max() < 100 * tol(dtype, n)
    # W.linear(x) == F.linear(x, W())
    lead = shape[:-2] + (3,) if len(shape) > 2 else (3, 2)
    x = torch.randn(*lead, shape[-1], dtype=dtype, generator=gen)
    ref = x @ q.mT if len(shape) > 2 else torch.nn.functional.linear(x, q)
    assert (w.linear(x) - ref).abs().max() < 100 * tol(dtype, n)
    if len(shape) == 2:
        assert (w.linear(x[0, 0]) - ref[0, 0]).abs().max() < 100 * tol(dtype, n)


@pytest.mark.parametrize("case", ["square_real", "square_complex", "tall_real", "wide_real"])
@pytest.mark.parametrize("method", MAPS)
def test_operator_rollout_values_and_gradients_match_dense(method, case):
    """W.operator() applied three times ≡ three F.linear with W(); same gradients (float64)."""
    shape, cplx = CASES[case]
    if not orthogonalize_supports(method, shape, cplx):
        pytest.skip(f"{method} does not serve {case}")
    dtype = torch.complex128 if cplx else torch.float64
    gen = torch.Generator().manual_seed(3)
    square = shape[0] == shape[1]
    opts = {"reflections": 2} if method in REFLECTION_MAPS and square else {}
    w = orthogonalize(torch.randn(*shape, dtype=dtype, generator=gen), method=method, **opts)
    x = torch.randn(4, shape[-1], dtype=dtype, generator=gen)
    params = [p for p in w.parameters() if p.requires_grad]

    def rollout(apply):
        h = x
        for _ in range(3 if shape[0] == shape[1] else 1):
            h = apply(h)
        return h

    step = w.operator()
    fast = rollout(step)
    grads_fast = torch.autograd.grad(fast.abs().pow(2).sum(), params)
    q = w()
    dense = rollout(lambda h: torch.nn.functional.linear(h, q))
    grads_dense = torch.autograd.grad(dense.abs().pow(2).sum(), params)
    n = max(shape)
    assert (fast - dense).abs().max() < 100 * tol(dtype, n)
    for a, b in zip(grads_fast, grads_dense, strict=True):
        assert (a - b).abs().max() < 1000 * tol(dtype, n) * (1 + b.abs().max())


def orthogonalize_supports(method, shape, cplx):
    try:
        orthogonalize(
            torch.randn(*shape, dtype=torch.complex128 if cplx else torch.float64), method=method
        )
    except ValueError:
        return False
    return True


def special_points(case, dtype, gen):
    """Haar, det −1, −I (or −[I; 0]) and a point with eigenvalue −1 (rotation by π)."""
    shape, _ = CASES[case]
    batch, (rows, cols) = shape[:-2], shape[-2:]
    n, m = max(rows, cols), min(rows, cols)
    man = Stiefel(n, m, complex=dtype.is_complex)
    haar = man.random(*batch, man.n, man.m, dtype=dtype, generator=gen)
    flip = torch.ones(n, dtype=dtype)
    flip[0] = -1
    det_minus = flip[:, None] * haar  # reflect the first row: det changes sign
    minus_eye = -torch.eye(n, m, dtype=dtype).expand(*batch, n, m)
    rot = torch.eye(n, dtype=dtype)
    rot[:2, :2] = torch.tensor([[-1.0, 0.0], [0.0, -1.0]], dtype=dtype)  # rotation by π
    rot = (rot @ torch.linalg.qr(torch.randn(n, n, dtype=dtype, generator=gen))[0])[:, :m]
    points = [haar, det_minus, minus_eye, rot.expand(*batch, n, m)]
    return [p.mT if rows < cols else p for p in points]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", MAPS)
def test_right_inverse_round_trip(method, case, precision):
    shape, _ = CASES[case]
    dtype = dtype_of(case, precision)
    gen = torch.Generator().manual_seed(2)
    w = orthogonalize(torch.randn(*shape, dtype=dtype, generator=gen), method=method)
    n = max(shape[-2:])
    for q in special_points(case, dtype, gen):
        w.weight = q.clone()
        assert (w() - q).abs().max() < 100 * tol(dtype, n), method
        assert orth_err(w()) < tol(dtype, n)


@pytest.mark.parametrize("method", REFLECTION_MAPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_fewer_reflections(method, dtype):
    gen = torch.Generator().manual_seed(3)
    n, L = 8, 3
    w = orthogonalize(torch.randn(n, n, dtype=dtype), method=method, reflections=L, generator=gen)
    assert w.parametrizations.weight.original.shape == (n, L)
    assert orth_err(w()) < tol(dtype, n)
    # a point made of L reflections (with the current buffer) round-trips
    with torch.no_grad():
        w.parametrizations.weight.original.normal_(generator=gen)
    q = w().detach().clone()
    w.weight = q
    assert (w() - q).abs().max() < 1e-12
    # a generic point is not reachable: ValueError, and nothing changes
    before = {k: v.clone() for k, v in w.state_dict().items()}
    with pytest.raises(ValueError, match="reflections=3"):
        w.weight = w.manifold.random(dtype=dtype, generator=gen)
    for k, v in w.state_dict().items():
        assert torch.equal(v, before[k])
    # init="haar" is refused for L < n; identity is reachable with any L
    with pytest.raises(ValueError, match="init='haar'"):
        orthogonalize(torch.randn(n, n, dtype=dtype), method=method, reflections=L, init="haar")
    w = orthogonalize(torch.randn(n, n, dtype=dtype), method=method, reflections=L, init="identity")
    assert (w() - torch.eye(n, dtype=dtype)).abs().max() < 1e-13


@pytest.mark.parametrize("method", REFLECTION_MAPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize(("shape", "L"), [((8, 3), 2), ((5, 4), 2), ((20, 6), 3), ((4, 7), 3)])
def test_a_tall_point_of_fewer_reflections_round_trips(method, dtype, shape, L):
    # a greedy choice of the diagonal refused the map's own points (6 of 20 real St(8, 3)
    # with L = 2, every complex one): they are found with the map's current diagonal
    # (Note [Fewer reflections on a tall point]); the reference is the point itself
    gen = torch.Generator().manual_seed(5)
    n = max(shape)
    for _ in range(4):
        w = orthogonalize(torch.randn(*shape, dtype=dtype, generator=gen), method=method,
                          reflections=L, generator=gen)  # fmt: skip
        with torch.no_grad():  # vectors, and a complex map's phases, away from the start
            for p in w.parameters():
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=gen))
        q = w().detach().clone()
        w.weight = q
        assert (w() - q).abs().max() < 10 * tol(dtype, n)
    before = {k: v.clone() for k, v in w.state_dict().items()}
    point = w.manifold.random(dtype=dtype, generator=gen)  # a generic point, tall
    with pytest.raises(ValueError, match=f"reflections={L}.*current"):
        w.weight = point.mT if shape[0] < shape[1] else point
    assert all(torch.equal(v, before[k]) for k, v in w.state_dict().items())


@pytest.mark.parametrize("method", MAPS)
def test_inits(method):
    gen = torch.Generator().manual_seed(4)
    eye = torch.eye(6, 4, dtype=torch.float64)
    w = orthogonalize(torch.randn(6, 4, dtype=torch.float64), method=method, init="identity")
    assert (w() - eye).abs().max() < 1e-13
    w1 = orthogonalize(
        torch.zeros(6, 4, dtype=torch.float64),
        method=method,
        init="haar",
        generator=torch.Generator().manual_seed(5),
    )
    w2 = orthogonalize(
        torch.zeros(6, 4, dtype=torch.float64),
        method=method,
        init="haar",
        generator=torch.Generator().manual_seed(5),
    )
    assert torch.equal(w1(), w2()) and orth_err(w1()) < 1e-13
    w3 = orthogonalize(
        torch.zeros(6, 4, dtype=torch.float64), method=method, init="random", generator=gen
    )
    assert orth_err(w3()) < 1e-13


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.float64])
def test_haar_init_is_drawn_in_the_weights_precision(dtype):
    """Note [Initialisation in the weight's precision]: the Haar point is the QR of a
    Gaussian drawn in the weight's dtype (the same draw as kernels.haar in that dtype)."""
    from stiefel.manifolds.kernels import haar

    w = orthogonalize(
        torch.zeros(7, 7, dtype=dtype),
        method="householder",
        init="haar",
        generator=torch.Generator().manual_seed(3),
    )
    ref = haar(7, 7, dtype=dtype, generator=torch.Generator().manual_seed(3))
    assert w().dtype == dtype
    assert float((w() - ref).abs().max()) < 100 * torch.finfo(dtype).eps


def test_householder_equals_cwy_through_orthogonalize():
    for dtype, bound in [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.complex128, 1e-12)]:
        x = torch.randn(2, 12, 12, dtype=dtype, generator=torch.Generator().manual_seed(6))
        h = orthogonalize(x, method="householder", init="haar")
        c = orthogonalize(x, method="cwy")
        c.load_state_dict(h.state_dict())
        assert (h() - c()).abs().max() < bound
        xs = torch.randn(5, 12, dtype=dtype)
        assert (h.linear(xs) - c.linear(xs)).abs().max() < 10 * bound


def test_scaled_cayley_negatives_and_default_scaling():
    d = torch.tensor([1.0, 1, 1, -1, -1], dtype=torch.float64)
    w = orthogonalize(torch.diag(d), method="scaled_cayley", negatives=2)
    assert w.map.scaling.tolist() == d.tolist()
    assert (w() - torch.diag(d)).abs().max() < 1e-13
    q = w.manifold.random(dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    w.weight = q  # a generic point is reachable with the fixed D
    assert (w() - q).abs().max() < 1e-12 and w.map.scaling.tolist() == d.tolist()
    with pytest.raises(ValueError, match="negatives=2"):  # K = D⁻¹ has eigenvalue −1
        w.weight = torch.eye(5, dtype=torch.float64)
    with pytest.raises(ValueError, match="init='random'"):
        orthogonalize(torch.eye(5), method="scaled_cayley", negatives=2)
    for seed in range(8):  # init="random" draws from the reachable half: det W = det D
        for n, neg in [(4, 1), (4, 2), (5, 3)]:
            torch.manual_seed(seed)
            eye = torch.eye(n, dtype=torch.float64)
            r = orthogonalize(eye, method="scaled_cayley", negatives=neg, init="random")
            assert orth_err(r()) < 100 * tol(torch.float64, n)
            assert float(torch.linalg.det(r())) == pytest.approx((-1) ** neg, abs=1e-12)
    v = orthogonalize(-torch.eye(5, dtype=torch.float64), method="scaled_cayley")
    assert (v() + torch.eye(5, dtype=torch.float64)).abs().max() < 1e-13
    assert v.map.scaling.tolist() == [-1] * 5  # chosen by right_inverse: A = 0


def test_riemannian_parameter():
    import geoopt

    lin = torch.nn.Linear(4, 6, bias=False)
    w0 = lin.weight.detach().clone()
    orthogonalize(lin, method="riemannian")
    assert isinstance(lin.weight, geoopt.ManifoldParameter)
    assert lin.weight.manifold == Stiefel(6, 4)
    u, _, vh = torch.linalg.svd(w0, full_matrices=False)
    assert (lin.weight.detach() - u @ vh).abs().max() < 1e-5
    assert lin.weight in list(lin.parameters())
