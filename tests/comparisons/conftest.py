"""Fixtures of the harness tests: the capability declarations of CONTRACT.md, faked.

The harness reads FLOP models, formulas, default learning rates and variants
from the registries (stiefel.comparisons.registry). Where the registered
classes do not declare them yet, ``capabilities`` declares them for a test.
"""

import pytest

from stiefel import optimizers, parametrizations


@pytest.fixture
def capabilities(monkeypatch):
    """Declare a FLOP model on every registered map and ``optimizers.info`` (if missing)."""
    from stiefel.comparisons import registry

    for name, cls in registry.maps().items():
        if "flops" not in vars(cls):
            refl = registry.map_info(name).reflections

            def flops(cls, n, m, reflections, refl=refl):
                return 2.0 * n * n * (reflections or n) if refl else 8.0 * n**3 / 3

            monkeypatch.setattr(cls, "flops", classmethod(flops), raising=False)
            monkeypatch.setattr(cls, "formula", f"{name} formula", raising=False)
    if not hasattr(optimizers, "info"):

        def info(name):
            i = registry.from_class(name)
            if name == "rgd":
                variants = [{"retraction": "cayley"}, {"retraction": "qr"}]
                return type(i)(
                    name, 0.05, True, lambda n, m, **h: 12.0 * n * m * m, "12NM²", variants
                )
            if i.riemannian and i.step_flops is None:
                return type(i)(name, i.default_lr, True, lambda n, m, **h: 8.0 * n * m * m, "8NM²")
            return i

        monkeypatch.setattr(optimizers, "info", info, raising=False)
    assert parametrizations  # imported for the registrations
    yield
