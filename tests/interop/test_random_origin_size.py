"""geoopt's size semantics for ``random``/``origin`` as geoopt's own
manifolds and ProductManifold call them.

``size`` is the whole shape (..., n, m), as separate ints or one tuple; empty means
(n, m); a trailing shape other than (n, m) raises ValueError; both return a
``geoopt.ManifoldTensor`` on the manifold; ``origin`` is [I; 0] and draws no random
numbers.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _interop_cases import MANIFOLDS, dtype_of, manifold, shape_of


@pytest.fixture(params=list(MANIFOLDS))
def case(request):
    return request.param


@pytest.mark.parametrize("how", ["empty", "ints", "tuple", "batch_ints", "batch_tuple"])
@pytest.mark.parametrize("fn", ["random", "origin"])
def test_size_is_the_whole_shape(case, fn, how):
    man, (n, m), dtype = manifold(case), shape_of(case), dtype_of(case)
    args, shape = {
        "empty": ((), (n, m)),
        "ints": ((n, m), (n, m)),
        "tuple": (((n, m),), (n, m)),
        "batch_ints": ((2, n, m), (2, n, m)),
        "batch_tuple": (((2, n, m),), (2, n, m)),
    }[how]
    x = getattr(man, fn)(*args, dtype=dtype)
    assert tuple(x.shape) == shape and x.dtype == dtype
    assert isinstance(x, geoopt.ManifoldTensor) and x.manifold is man
    man.assert_check_point_on_manifold(x.detach())
    if fn == "origin":
        eye = torch.eye(n, m, dtype=dtype).expand(shape)
        torch.testing.assert_close(x.detach().as_subclass(torch.Tensor), eye, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("fn", ["random", "origin"])
def test_wrong_trailing_shape_raises(case, fn):
    man, (n, m) = manifold(case), shape_of(case)
    for bad in ((n + 1, m), (2, n, m + 1), (n,)):
        with pytest.raises(ValueError, match=f"{n}"):
            getattr(man, fn)(*bad)


def test_origin_draws_no_random_numbers(case):
    man = manifold(case)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    man.origin(3, *shape_of(case))
    assert torch.equal(torch.get_rng_state(), state)
