r"""The options of a registered thing, read from its signature.

What a map, an optimizer or a harness task accepts is the keyword arguments of
its ``__init__`` (or of its factory), so it is declared once, where it is
used. `signature_options` reads them; `option_types` says which types an
option takes (its annotation, else its default's); `conforms` checks a value.
`stiefel._core.registry.Registry` applies them to every registry.

Example:
    ```python
    from stiefel._core.options import conforms, option_types, signature_options

    def make(params, lr: float, mode: bool | str = "auto", *, steps: int | None = None):
        return params

    params, is_open = signature_options(make, fixed=("params",))
    assert list(params) == ["lr", "mode", "steps"] and not is_open
    assert conforms(1e-3, option_types(params["lr"]))
    assert conforms(False, option_types(params["mode"]))
    assert not conforms("3", option_types(params["steps"]))
    ```
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from .checks import integer

__all__ = ["REQUIRED", "signature_options", "option_types", "conforms", "describe"]


class _Required:
    """The default of an option that has none (it must be given)."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


def _signature(func: Callable) -> inspect.Signature:
    try:
        return inspect.signature(func, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: keep the strings
        return inspect.signature(func)


def option_types(param: inspect.Parameter) -> tuple[type, ...] | None:
    """The types an option accepts: its annotation, else its default's type, else None."""
    ann = param.annotation
    if not isinstance(ann, str) and ann is not inspect.Parameter.empty and ann is not Any:
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        args = typing.get_args(ann) if union else (ann,)
        out = tuple(typing.get_origin(a) or a for a in args)
        if all(isinstance(t, type) for t in out):
            return tuple(type(None) if t is None else t for t in out)
    default = param.default
    if default is inspect.Parameter.empty or default is None:
        return None
    return (type(default),)


def signature_options(
    obj: Any, fixed: Iterable[str] = (), stop: tuple[type, ...] = ()
) -> tuple[dict[str, inspect.Parameter], bool]:
    """The options ``obj`` takes, read from its signature, and whether more are accepted.

    A class is read from its ``__init__`` and, while that passes ``**kwargs``
    on, from its bases' (in method resolution order); a function (unwrapped
    through ``__wrapped__``) from its own signature. The names in ``fixed``
    (the arguments every registered thing takes, e.g. ``params``) and
    ``*args`` are not options.

    Note [Options behind **kwargs]
    ``**kwargs`` passed on to a base class are that base's keyword arguments,
    so the walk goes on; but a base in ``stop`` (an interface such as
    ``torch.optim.Optimizer``, whose subclasses pack their keywords into a
    ``defaults`` dict) and a function's ``**kwargs`` say nothing of what is
    accepted: the set is then open and unknown names are left to the object.

    Returns:
        (name → `inspect.Parameter`, open): open is True when names beyond
        these are accepted.
    """
    skip = {"self", *fixed}
    out: dict[str, inspect.Parameter] = {}
    obj = inspect.unwrap(obj)
    if inspect.isclass(obj):
        funcs = [k.__init__ for k in obj.__mro__ if "__init__" in vars(k) and k is not object]
        stops = [k for k in obj.__mro__ if "__init__" in vars(k) and k in stop]
    else:
        funcs, stops = [obj], []
    for func in funcs:
        if stops and func is stops[0].__init__:
            return out, True
        try:
            params = _signature(func).parameters.values()
        except (TypeError, ValueError):  # no Python signature (a C extension): nothing known
            return out, True
        for p in params:
            if p.name not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                out.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return out, False
    return out, True


def conforms(value: Any, types_: tuple[type, ...] | None) -> bool:
    if types_ is None:
        return True
    if isinstance(value, bool):
        return bool in types_
    if integer(value) and (int in types_ or float in types_):
        return True
    if isinstance(value, list) and tuple in types_:
        return True
    return isinstance(value, tuple(t for t in types_ if t is not bool))


def describe(types_: tuple[type, ...] | None) -> str:
    return "any value" if types_ is None else " or ".join(t.__name__ for t in types_)
