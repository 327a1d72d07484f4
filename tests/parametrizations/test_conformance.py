"""Conformance of every registered map (read from the registry, never a hand list).

For each map and each shape it serves: the weight is on the manifold in every
dtype, ``module.weight = Q`` maps back to Q, the map passes gradcheck in
float64, a batch equals its slices, and a state_dict round trip restores the
weight. The first, second, batch and state_dict tests run on every device of
the ``device`` fixture (cuda when visible; references in float64 on the CPU);
gradcheck stays on the CPU in float64. A map added with ``register`` or through
the entry-point group ``stiefel.parametrizations`` is collected here with no edit
(``test_plugin_map_is_collected_by_this_suite`` proves it in a subprocess).
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.func import functional_call

from stiefel.manifolds.kernels import haar, orthogonality_error, polar
from stiefel.parametrizations import maps, orthogonalize

CASES = {  # name: (shape, complex)
    "square_real": ((4, 4), False),
    "square_complex": ((4, 4), True),
    "tall_real": ((6, 3), False),
    "tall_complex": ((6, 3), True),
    "wide_real": ((3, 6), False),
    "wide_complex": ((3, 5), True),
    "batch": ((2, 4, 4), False),
    "batch_tall_complex": ((2, 5, 2), True),
}
DTYPES = {False: (torch.float32, torch.float64), True: (torch.complex64, torch.complex128)}
LOW = (torch.bfloat16, torch.float16)  # real maps store low precision, compute in float32
MAPS = maps()


def served(name, case):
    return not (MAPS[name].real_only and CASES[case][1])


PAIRS = [pytest.param(n, c, id=f"{n}-{c}") for n in MAPS for c in CASES if served(n, c)]


def tall(w):
    return w.mT if w.shape[-2] < w.shape[-1] else w


def tol(dtype, shape, factor=20):
    return factor * max(shape[-2:]) * torch.finfo(dtype).eps


def module_for(name, shape, dtype, seed=0, init=None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same numbers everywhere
    w = torch.randn(*shape, dtype=dtype, generator=gen).to(device)
    opts = {} if init is None else {"init": init, "generator": gen}
    return orthogonalize(w, method=name, **opts), w


@pytest.mark.parametrize(("name", "case"), PAIRS)
def test_on_the_manifold_in_every_dtype(name, case, device):
    shape, cplx = CASES[case]
    high = torch.complex128 if cplx else torch.float64
    for dtype in DTYPES[cplx] + (() if cplx else LOW):
        W, w = module_for(name, shape, dtype, device=device)
        q = W()
        assert q.shape == shape and q.dtype == dtype and q.device.type == device
        q = tall(q.detach()).cpu().to(high)
        err = float(orthogonality_error(q).max())
        assert err <= tol(dtype, shape), (dtype, err)
        if W.map.reaches_every_point:  # default init: the nearest point (polar factor)
            ref = polar(tall(w).cpu().to(high))
            assert (q - ref).abs().max() <= 10 * tol(dtype, shape)


@pytest.mark.parametrize(("name", "case"), PAIRS)
def test_assignment_maps_back(name, case, device):
    shape, cplx = CASES[case]
    for dtype in DTYPES[cplx]:
        W, _ = module_for(name, shape, dtype, device=device)
        gen = torch.Generator().manual_seed(5)
        n, m = max(shape[-2:]), min(shape[-2:])
        q = haar(n, m, *shape[:-2], dtype=dtype, generator=gen)
        target = q.mT if shape[-2] < shape[-1] else q
        W.weight = target.to(device)
        assert W().device.type == device
        assert (W().detach().cpu() - target).abs().max() <= 10 * tol(dtype, shape)
        W.weight = W.weight  # what the map produced is assignable back (geotorch's update_base)
        assert (W().detach().cpu() - target).abs().max() <= 10 * tol(dtype, shape)


@pytest.mark.parametrize(("name", "case"), PAIRS)
def test_gradcheck_float64(name, case):
    shape, cplx = CASES[case]
    dtype = torch.complex128 if cplx else torch.float64
    W, _ = module_for(name, shape, dtype)
    fmap = W.map
    gen = torch.Generator().manual_seed(2)
    original = W.parametrizations.weight.original.detach()
    original = original + 0.3 * torch.randn(original.shape, dtype=dtype, generator=gen)
    params = {k: p.detach().clone().requires_grad_() for k, p in fmap.named_parameters()}
    buffers = dict(fmap.named_buffers())
    keys = list(params)

    def f(x, *ps):
        return functional_call(fmap, {**dict(zip(keys, ps, strict=True)), **buffers}, (x,))

    assert torch.autograd.gradcheck(f, (original.requires_grad_(), *params.values()))


@pytest.mark.parametrize(("name", "case"), [p for p in PAIRS if p.values[1].startswith("batch")])
def test_batch_equals_its_slices(name, case, device):
    shape, cplx = CASES[case]
    dtype = torch.complex128 if cplx else torch.float64
    W, w = module_for(name, shape, dtype, device=device)
    if not W.map.reaches_every_point:
        pytest.skip("the default init of this map is random, slices cannot be compared")
    for i in range(shape[0]):
        Wi = orthogonalize(w[i].clone(), method=name)
        assert (W()[i] - Wi()).abs().max().cpu() <= tol(dtype, shape)


@pytest.mark.parametrize(("name", "case"), PAIRS)
def test_state_dict_round_trip(name, case, device):
    shape, cplx = CASES[case]
    dtype = torch.complex128 if cplx else torch.float64
    W, _ = module_for(name, shape, dtype, seed=0, init="haar", device=device)
    V, _ = module_for(name, shape, dtype, seed=1, init="haar", device=device)
    assert (W() - V()).abs().max() > 1e-3
    V.load_state_dict(W.state_dict())
    assert torch.equal(W(), V())


ENTRY_POINTS_TXT = "[stiefel.parametrizations]\nplugin_polar = polar_map:PolarMap\n"


def test_plugin_map_is_collected_by_this_suite(tmp_path):
    """A map declared only as an entry point runs through every test of this file."""
    plugin = pathlib.Path(__file__).parent / "plugin_polar"
    dist = tmp_path / "plugin_polar-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-polar\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS_TXT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(plugin)]))
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "plugin_polar",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # four tests over every case, one over the two batch cases; on a GPU three of the four and
    # the batch one run once more (device "cuda")
    expected = 4 * len(CASES) + 2
    if torch.cuda.is_available():
        expected += 3 * len(CASES) + 2
    assert f"{expected} passed" in out.stdout, out.stdout[-2000:]
