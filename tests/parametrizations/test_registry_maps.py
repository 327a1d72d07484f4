"""The map registry is an instance of the one `Registry` class: its names, options, entry points."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

from stiefel.parametrizations import OrthogonalMap, available, base, get, maps, register


@pytest.fixture
def scratch():
    saved = base.MAPS.snapshot()
    yield
    base.MAPS.restore(saved)


class Polar(OrthogonalMap):
    def __init__(self, shape, dtype, device=None, *, iterations: int = 3):
        super().__init__(shape, dtype, device)
        self.iterations = iterations

    def matrix(self, a):
        u, _, vh = torch.linalg.svd(a, full_matrices=False)
        return u @ vh

    def inverse(self, q):
        return q


def test_options_are_the_keyword_only_arguments_of_every_map():
    for name, cls in maps().items():
        assert list(base.MAPS.options(name)) == cls.options(), name
    assert base.MAPS.options("householder") == {"reflections": None, "block": None}
    assert base.MAPS.options("exp") == {}


def test_names_follow_the_registry_policy(scratch):
    with pytest.raises(ValueError, match="method='riemannian' is reserved"):
        register("riemannian")
    with pytest.raises(ValueError, match="method='a-b'.*Python identifier"):
        register("a-b")
    assert register("polar_r")(Polar) is Polar and Polar.method == "polar_r"
    assert register("polar_r")(Polar) is Polar  # again: nothing changes
    assert available()[-2:] == ["polar_r", "riemannian"]
    with pytest.raises(ValueError, match="method='polar_r'.*taken: householder, cwy"):
        register("polar_r")(type("Other", (Polar,), {}))
    with pytest.raises(ValueError, match="method=3 is not supported: method must be a str"):
        get(3)
    with pytest.raises(ValueError, match="method='riemannian' is not a map"):
        get("riemannian")


def test_unknown_map_options_are_refused_listing_the_accepted(scratch):
    register("polar_r")(Polar)
    base.MAPS.check_options("polar_r", {"iterations": 2, "init": "haar"}, extra=("init",))
    for error in (ValueError, TypeError):
        with pytest.raises(error, match=r"'iters'.*allowed: init, iterations=3"):
            base.MAPS.check_options("polar_r", {"iters": 2}, extra=("init",))


def test_a_plugin_map_is_imported_when_first_needed(scratch, monkeypatch, tmp_path):
    module = "stiefel_lazy_polar_plugin"
    (tmp_path / f"{module}.py").write_text(
        "import torch\nfrom stiefel.parametrizations import OrthogonalMap\n\n"
        "class LazyPolar(OrthogonalMap):\n"
        "    def matrix(self, a):\n"
        "        u, _, vh = torch.linalg.svd(a, full_matrices=False)\n"
        "        return u @ vh\n\n"
        "    def inverse(self, q):\n"
        "        return q\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    ep = importlib.metadata.EntryPoint("lazy_polar", f"{module}:LazyPolar", base.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [ep])
    assert base.load_entry_points(force=True) == ["lazy_polar"]
    assert available()[-2:] == ["lazy_polar", "riemannian"] and module not in sys.modules
    cls = get("lazy_polar")
    assert module in sys.modules and cls.method == "lazy_polar" and maps()["lazy_polar"] is cls
    q = cls((5, 3), torch.float64)(torch.randn(5, 3, dtype=torch.float64))
    assert torch.allclose(q.mT @ q, torch.eye(3, dtype=torch.float64), atol=1e-13)
