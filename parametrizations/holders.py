r"""The modules that hold a Parameter: who registers this very object in ``_parameters``.

``orthogonalize(param)`` constrains the model that holds ``param`` in place;
`holders` finds that model's module(s) from the Parameter alone.

Note [Finding a Parameter's holders]
A module registers a Parameter as a value of its ``_parameters`` dict, and
that dict is the value of the module's own ``"_parameters"`` attribute. The
garbage collector knows every container that refers to an object
(``gc.get_referrers``): the dicts that hold the Parameter, then the objects
that hold those dicts. Depending on the Python version an instance's
attributes are a separate ``__dict__`` (one more step to the module) or are
visited by the module object itself; both are followed, and each candidate is
confirmed by identity (``module._parameters is d`` and ``d[key] is param``),
so a dict that merely contains the Parameter (an optimizer's state, a user's
own dict) is never taken for a holder. Each search is a pass over the
objects the collector tracks, once per call, not per step.

A module that is no longer reachable but not yet collected (one in a
reference cycle) would still hold the Parameter; ``param`` would then be
constrained on a dead model, or refused as tied to it. So when a holder is
found, the collector runs once (``gc.collect()``) and the search is repeated:
what is left is reachable.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

__all__ = ["holders", "holder_names"]


def _scan(param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    dicts = [
        d
        for d in gc.get_referrers(param)
        if isinstance(d, dict) and any(v is param for v in d.values())
    ]
    if not dicts:
        return []
    wanted = {id(d) for d in dicts}
    modules: dict[int, nn.Module] = {}
    attribute_dicts = []
    for r in gc.get_referrers(*dicts):
        if isinstance(r, nn.Module):
            if id(r.__dict__.get("_parameters")) in wanted:
                modules[id(r)] = r
        elif isinstance(r, dict) and id(r.get("_parameters")) in wanted:
            attribute_dicts.append(r)  # a module's __dict__, or a look-alike: confirmed below
    if attribute_dicts:
        ids = {id(d) for d in attribute_dicts}
        for r in gc.get_referrers(*attribute_dicts):
            if isinstance(r, nn.Module) and id(r.__dict__) in ids:
                modules[id(r)] = r
    return [
        (m, key)
        for m in modules.values()
        for key, p in m.__dict__["_parameters"].items()
        if p is param
    ]


def holders(param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """Every ``(module, name)`` with ``module._parameters[name] is param``.

    Only modules that are still reachable count (Note [Finding a Parameter's
    holders]). The list is ordered by the holder's class name and the
    parameter's name; a module holding ``param`` under two names appears twice.

    Args:
        param: the Parameter (any tensor; one that no module holds gives ``[]``).

    Returns:
        The holders, ``[]`` when none.

    Example:
        ```python
        import torch
        from stiefel.parametrizations.holders import holders

        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight  # tied
        assert sorted(k for _, k in holders(emb.weight)) == ["weight", "weight"]
        assert holders(torch.nn.Parameter(torch.zeros(2))) == []
        ```
    """
    found = _scan(param)
    if found:
        gc.collect()  # Note [Finding a Parameter's holders]: only reachable holders
        found = _scan(param)
    return sorted(found, key=lambda mk: (type(mk[0]).__name__, mk[1]))


def holder_names(found: list[tuple[nn.Module, str]]) -> str:
    """``"Embedding.weight, Linear.weight"``: the holders as the messages name them."""
    return ", ".join(f"{type(m).__name__}.{key}" for m, key in found)
