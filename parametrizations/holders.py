r"""The modules that hold a Parameter: who registers this very object in ``_parameters``.

``orthogonalize(param)`` constrains the model that holds ``param`` in place;
`holders` finds that model's module(s) from the Parameter alone.

Note [Finding a Parameter's holders]
A module registers a Parameter as a value of its ``_parameters`` dict, and
that dict is the value of the module's own ``"_parameters"`` attribute. The
garbage collector knows every container that refers to an object
(``gc.get_referrers``, one pass over the objects it tracks): first the dicts
that hold the Parameter as a value. Most of the time the model is within
reach of the caller (a local or global variable of a frame on the stack, or a
submodule of one): the ``_parameters`` dicts of those modules are matched
against the dicts found, and nothing more is searched. A dict left unmatched
that could be a ``_parameters`` dict (string keys, tensor values) sends the
search on: the objects that refer to it (the module itself, or, depending on
the Python version, the module's ``__dict__`` and then the module). Each
candidate is confirmed by identity (``module._parameters is d`` and
``d[key] is param``), so a dict that merely contains the Parameter (a user's
own dict) is never taken for a holder.

A module found that way, out of the caller's reach, might be one that is no
longer reachable at all but not yet collected (in a reference cycle): the
Parameter would be constrained on a dead model, or refused as tied to it.
Then the collector runs once (``gc.collect()``) and the search is repeated,
so what is left is alive. A module reachable from a frame on the stack is
alive without that.

Each pass is proportional to the number of objects the collector tracks
(hundreds of thousands once ``transformers`` is imported); it is paid once
per call, never per step, and ``orthogonalize(model, name)`` pays none.
"""

from __future__ import annotations

import gc
import sys
from types import FrameType

import torch
from torch import nn

__all__ = ["holders", "holder_names"]


def _roots(frame: FrameType | None) -> list[nn.Module]:
    """The modules that are locals or globals of the frames on the stack from ``frame``."""
    roots: list[nn.Module] = []
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            roots.extend(v for v in list(scope.values()) if isinstance(v, nn.Module))
        frame = frame.f_back
    return roots


def _in_reach(frame: FrameType | None) -> dict[int, nn.Module]:
    """Modules reachable from the frames on the stack, by the id of their ``_parameters``."""
    seen: set[int] = set()
    out: dict[int, nn.Module] = {}
    stack = _roots(frame)
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out[id(m.__dict__.get("_parameters"))] = m
        stack.extend(m.__dict__.get("_modules", {}).values())
    return out


def _could_be_parameters(d: dict) -> bool:
    return all(
        isinstance(k, str) and (v is None or isinstance(v, torch.Tensor)) for k, v in d.items()
    )


def _owners(dicts: list[dict]) -> list[nn.Module]:
    """The modules whose ``_parameters`` is one of ``dicts`` (two or three referrer passes)."""
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
    return list(modules.values())


def _scan(param: torch.Tensor, frame: FrameType | None) -> tuple[list[nn.Module], bool]:
    """(the modules holding ``param``, whether some were found out of the caller's reach)."""
    dicts = [
        d
        for d in gc.get_referrers(param)
        if isinstance(d, dict) and any(v is param for v in d.values())
    ]
    if not dicts:
        return [], False
    reach = _in_reach(frame)
    modules = [reach[id(d)] for d in dicts if id(d) in reach]
    rest = [d for d in dicts if id(d) not in reach and _could_be_parameters(d)]
    far = _owners(rest) if rest else []
    return modules + far, bool(far)


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
    frame = sys._getframe(1)
    try:
        modules, far = _scan(param, frame)
        if far:  # Note [Finding a Parameter's holders]: only modules that are alive
            del modules  # held here, a dead holder would survive the collection
            gc.collect()
            modules, _ = _scan(param, frame)
    finally:
        del frame  # a frame kept in a local is a reference cycle
    found = [(m, key) for m in modules for key, p in m._parameters.items() if p is param]
    return sorted(found, key=lambda mk: (type(mk[0]).__name__, mk[1]))


def _paths(modules: set[int], frame: FrameType | None) -> dict[int, tuple[str, str]]:
    """``{id(module): ("0", "Sequential")}``: each module's dotted name in the largest model
    within the caller's reach (a local or global of a frame on the stack), and its class."""
    best: dict[int, tuple[int, str, str]] = {}
    for root in _roots(frame):
        names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        for i in modules & names.keys():
            if names[i] and len(names) > best.get(i, (0,))[0]:
                best[i] = (len(names), names[i], type(root).__name__)
    return {i: (path, root) for i, (_, path, root) in best.items()}


def holder_names(found: list[tuple[nn.Module, str]]) -> str:
    """``"Linear.weight (0.weight of a Sequential), Linear.weight (2.weight ...)"``.

    Each holder with its dotted name in the largest model within the caller's reach
    that contains it (its class name alone when none does).
    """
    frame = sys._getframe(1)
    try:
        paths = _paths({id(m) for m, _ in found}, frame)
    finally:
        del frame  # a frame kept in a local is a reference cycle
    return ", ".join(
        f"{type(m).__name__}.{key}"
        + (f" ({paths[id(m)][0]}.{key} of a {paths[id(m)][1]})" if id(m) in paths else "")
        for m, key in found
    )
