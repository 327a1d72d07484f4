"""``reversible`` is True where the default retraction is Cayley
(the manifolds' documented contract): the Cayley ``retr_transp`` is reversible (its property
is checked on this branch in test_geoopt_manifold_basic.py::test_reversibility_of_retr_transp),
so geoopt's samplers and its test_manifold_basic reversibility check accept our manifolds.
Today: ``reversible = False`` on every Stiefel manifold here.
"""

from __future__ import annotations

import geoopt
import pytest
from _interop_cases import MANIFOLDS, manifold, shape_of


@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("case", list(MANIFOLDS))
def test_reversible(case, metric):
    man = manifold(case, metric)
    assert man.reversible is True
    assert geoopt.Scaled(man, 2.0).reversible is True
    assert geoopt.ProductManifold((man, shape_of(case)), (geoopt.Euclidean(), 3)).reversible
