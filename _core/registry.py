r"""One registry class for everything registered by name: maps, optimizers, harness tasks.

A `Registry` maps names to objects (classes or factories) and has one policy
for each question every registry faces:

- **names**: a Python identifier, not reserved, not taken by another object
  (registering the same object again under its name is a no-op);
- **entry points**: the group given at construction is scanned once, on the
  first query (never at import), and each entry point is loaded on first use
  of its name (`get`, `items`, `options`); a registered name always wins;
- **options**: what a registered thing accepts is read from its signature
  (`options`, by `stiefel._core.options`), and an unknown option, or a value
  of a type the option does not take, is refused listing what is accepted
  (`check_options`).

`_core` is the package every other one imports, so the class lives here and
imports nothing from the rest of `stiefel`.

Example:
    ```python
    from stiefel._core.registry import Registry

    tasks = Registry("task", reserved={"all": "it selects every task"})

    @tasks.register("spiral")
    def spiral(dtype, turns: int = 3, noise: float = 0.1, tag: str | None = None):
        return turns, noise, tag

    assert tasks.available() == ["spiral"]
    assert tasks.options("spiral") == {"dtype": tasks.REQUIRED, "turns": 3, "noise": 0.1,
                                       "tag": None}
    tasks.check_options("spiral", {"turns": 5, "noise": 1e-2})
    try:
        tasks.check_options("spiral", {"turn": 5})
    except ValueError as exc:  # names the unknown option and the accepted ones
        assert "turn" in str(exc)
    ```
"""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from .options import REQUIRED, conforms, describe, option_types, signature_options

__all__ = ["Registry", "RegistryError", "REQUIRED", "signature_options"]

T = TypeVar("T")


class RegistryError(ValueError, TypeError):
    """A name that is not a str, an option a registered thing does not take, a mistyped value.

    Note [Registry errors are both ValueError and TypeError]
    A name of the wrong type is an unknown name, and a bad entry of an options
    dict a bad value (the package's convention: ValueError); both are also
    TypeErrors in Python's own convention (an argument of the wrong type, an
    unexpected keyword argument), which callers of ``orthogonalize`` and
    ``optimizers.create`` relied on before the registries were one class.
    Being both (as numpy's AxisError is a ValueError and an IndexError) breaks
    neither kind of caller.
    """


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f" (from distribution {dist.name!r})" if dist is not None else ""


class Registry(Generic[T]):
    r"""Names → registered objects, with one entry-point policy and one options policy.

    Args:
        kind: what is registered, for messages ("map", "optimizer", "task").
        argument: the name of the argument users pass the name as ("method",
            "name", "task"), for messages.
        group: the entry-point group third-party packages declare in (None: none).
        reserved: names that cannot be registered, each with what it means
            instead (listed with the registered names when a name is unknown).
        fixed: the arguments every registered thing takes that are not options.
        stop: interface classes whose ``__init__`` ends the options walk
            (Note [Options behind **kwargs]).
        check: ``check(name, obj)`` raising TypeError for an object of the wrong
            kind; run on registration and on each loaded entry point.
        on_register: ``on_register(name, obj)``, run once the object is accepted
            (e.g. to record its name on the class).
        sort: `available` and `items` in name order (default: registration
            order, then entry points in the order they were found).
        typed: `check_options` also refuses a value whose type is not the
            option's annotated type (or its default's).

    Note [One entry-point policy]
    The group is scanned on the first query, never while the package is
    imported, so a broken plugin cannot break ``import stiefel``; an entry
    point is loaded (its module imported) only when its object is needed. A
    registered name always wins: an entry point whose name is taken (or
    reserved, or found twice) is ignored with a RuntimeWarning naming it and
    its distribution, and is never imported; `register` of a name an entry
    point declared drops that entry point with the same warning. An entry
    point that fails to load, or is of the wrong kind, is dropped with a
    RuntimeWarning naming it; asking for it by name then raises ValueError
    giving that reason. A plugin module that also registers itself under its
    entry-point name is accepted (the same object registered twice).

    Example:
        ```python
        import pytest
        from stiefel._core.registry import RegistryError, Registry

        shapes = Registry("shape", argument="shape", sort=True, typed=True)
        shapes.register("ring")(lambda n, radius=1.0: ("ring", n, radius))
        assert shapes.get("ring")(3) == ("ring", 3, 1.0)
        with pytest.raises(RegistryError, match="radius=1.0"):
            shapes.check_options("ring", {"radious": 2.0})
        with pytest.raises(ValueError, match="shape='star' is not supported; allowed: ring"):
            shapes.get("star")
        ```
    """

    REQUIRED = REQUIRED

    def __init__(
        self,
        kind: str,
        *,
        argument: str = "name",
        group: str | None = None,
        reserved: Mapping[str, str] | None = None,
        fixed: Iterable[str] = (),
        stop: tuple[type, ...] = (),
        check: Callable[[str, Any], None] | None = None,
        on_register: Callable[[str, Any], None] | None = None,
        sort: bool = False,
        typed: bool = False,
    ):
        self.kind, self.argument, self.group = kind, argument, group
        self.reserved = dict(reserved or {})
        self.fixed, self.stop = tuple(fixed), tuple(stop)
        self._check, self._on_register = check, on_register
        self.sort, self.typed = sort, typed
        self._items: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, importlib.metadata.EntryPoint] = {}
        self._broken: dict[str, str] = {}
        self._scanned = group is None

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r}, names={self.available()})"

    def __contains__(self, name: object) -> bool:
        return name in self.available()

    # ------------------------------------------------------------------ names
    def _check_name(self, name: object) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            # a ValueError as before, and the TypeError a name of the wrong type gets
            raise (ValueError if isinstance(name, str) else RegistryError)(
                f"{self.kind} {self.argument}={name!r} is not allowed; allowed: a non-empty str "
                "that is a Python identifier"
            )
        if name in self.reserved:
            raise ValueError(
                f"{self.kind} {self.argument}={name!r} is reserved ({self.reserved[name]}); "
                "choose another name"
            )

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        """Decorator adding ``obj`` under ``name`` (with ``meta``, read back by `meta`).

        Raises:
            ValueError: ``name`` is not an identifier, is reserved, or is taken by
                another object (the names taken are listed).
            TypeError: the ``check`` given at construction refuses the object.
        """
        self._check_name(name)

        def decorator(obj: T) -> T:
            if self._check is not None:
                self._check(name, obj)
            current = self._items.get(name)
            if current is not None and current is not obj:
                article = "an" if self.kind[:1] in "aeiou" else "a"
                raise ValueError(
                    f"{article} {self.kind} is already registered under {self.argument}={name!r} "
                    f"({current!r}); choose another name; taken: {', '.join(self.available())}"
                )
            if name in self._pending:
                self._warn(
                    self._pending.pop(name),
                    f"clashes with the {self.kind} registered "
                    "under that name; the registered one is used and the entry point "
                    "is ignored",
                )
            if self._on_register is not None:
                self._on_register(name, obj)
            self._items[name] = obj
            self._broken.pop(name, None)
            if meta:
                self._meta[name] = dict(meta)
            return obj

        return decorator

    def meta(self, name: str) -> dict[str, Any]:
        """The keywords ``name`` was registered with (a copy; empty when none)."""
        self.get(name)
        return dict(self._meta.get(name, {}))

    def available(self) -> list[str]:
        """The registered names and those of entry points not loaded yet."""
        self.load_entry_points()
        names = [*self._items, *self._pending]
        return sorted(names) if self.sort else names

    def items(self) -> dict[str, T]:
        """Name → object for every name, entry points loaded (broken ones dropped)."""
        self.load_entry_points()
        for name in list(self._pending):
            self._load(name)
        return {name: self._items[name] for name in self.available()}

    def get(self, name: str) -> T:
        """The object registered as ``name``; its entry point is loaded on first use.

        Raises:
            ValueError: an unknown name, or an entry point that could not be
                loaded (the reason and the available names are given).
            RegistryError: (a ValueError and a TypeError) ``name`` is not a str.
        """
        if not isinstance(name, str):
            raise RegistryError(
                f"{self.argument}={name!r} is not supported: {self.argument} must be a str; "
                f"allowed: {self._allowed()}"
            )
        if name in self.reserved:
            raise ValueError(
                f"{self.argument}={name!r} is not a {self.kind}: {self.reserved[name]}; "
                f"{self.kind}s: {', '.join(self.available())}"
            )
        self.load_entry_points()
        if name in self._pending:
            self._load(name)
        if name in self._items:
            return self._items[name]
        why = f" (its entry point could not be loaded: {self._broken.get(name)})"
        raise ValueError(
            f"{self.argument}={name!r} is not supported{why if name in self._broken else ''}; "
            f"allowed: {self._allowed()}"
        )

    def _allowed(self) -> str:
        text = f"{', '.join(self.available())} (the registered {self.kind}s)"
        for name, reason in self.reserved.items():
            text += f", {name} ({reason})"
        return text

    # ------------------------------------------------------------------ entry points
    def load_entry_points(self, force: bool = False) -> list[str]:
        """Scan the entry-point group (once, or again with ``force``).

        Returns:
            The names found and not loaded yet, sorted.
        """
        if self._scanned and not force:
            return sorted(self._pending)
        self._scanned = True
        self._pending.clear()
        try:
            found = list(importlib.metadata.entry_points(group=self.group))
        except Exception as exc:  # noqa: BLE001 - a broken environment must not break the registry
            warnings.warn(
                f"could not read entry points {self.group!r}: {exc}", RuntimeWarning, stacklevel=3
            )
            return []
        for ep in found:
            if ep.name in self.reserved:
                self._warn(ep, f"is a reserved name ({self.reserved[ep.name]}); it is ignored")
            elif ep.name in self._items or ep.name in self._pending:
                self._warn(
                    ep,
                    f"clashes with the {self.kind} registered under that name; the "
                    "registered one is used and the entry point is ignored",
                )
            elif not ep.name.isidentifier():
                self._warn(ep, "is not a Python identifier; the entry point is ignored")
            else:
                self._pending[ep.name] = ep
        return sorted(self._pending)

    def _warn(self, ep: importlib.metadata.EntryPoint, what: str) -> None:
        warnings.warn(
            f"entry point {ep.name!r} = {ep.value!r}{_origin(ep)} in group {self.group!r} {what}",
            RuntimeWarning,
            stacklevel=4,
        )

    def _load(self, name: str) -> None:
        ep = self._pending.pop(name)
        try:
            obj = ep.load()
            if self._items.get(name) is not obj:  # the module may register itself on import
                self.register(name)(obj)
        except Exception as exc:  # noqa: BLE001 - one bad plugin must not hide the others
            self._broken[name] = f"{type(exc).__name__}: {exc}"
            self._warn(ep, f"could not be loaded ({self._broken[name]}); it is ignored")

    # ------------------------------------------------------------------ options
    def _signature(self, name: str) -> tuple[dict[str, inspect.Parameter], bool]:
        return signature_options(self.get(name), self.fixed, self.stop)

    def options(self, name: str) -> dict[str, Any]:
        """The options of ``name`` and their defaults (`REQUIRED` where none), from its signature.

        Where ``**kwargs`` leave the set open (Note [Options behind **kwargs]),
        these are the options known by name.
        """
        params, _ = self._signature(name)
        return {k: REQUIRED if p.default is p.empty else p.default for k, p in params.items()}

    def check_options(self, name: str, given: Mapping[str, Any], extra: Iterable[str] = ()) -> None:
        """Refuse an option ``name`` does not take (and, if typed, a value of the wrong type).

        Args:
            name: a registered name.
            given: option → value.
            extra: options the caller handles itself (listed as accepted).

        Raises:
            RegistryError: (a ValueError and a TypeError) naming the option and
                listing the accepted ones with their defaults.
        """
        params, is_open = self._signature(name)
        extra = tuple(extra)
        unknown = [k for k in given if k not in params and k not in extra]
        if unknown and not is_open:
            listing = [*extra, *(_show(k, p) for k, p in params.items())]
            raise RegistryError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for {self.kind} "
                f"{self.argument}={name!r}; allowed: {', '.join(listing) or 'none'}"
            )
        if self.typed:
            for k, value in given.items():
                if k in params and not conforms(value, option_types(params[k])):
                    raise RegistryError(
                        f"{self.kind} {self.argument}={name!r}: option {k}={value!r} "
                        f"({type(value).__name__}); allowed: {describe(option_types(params[k]))}"
                    )

    # ------------------------------------------------------------------ state (for tests)
    def snapshot(self) -> tuple:
        """The registry's state, for `restore` (tests that register names use this)."""
        return (
            dict(self._items),
            {k: dict(v) for k, v in self._meta.items()},
            dict(self._pending),
            dict(self._broken),
            self._scanned,
        )

    def restore(self, state: tuple) -> None:
        """Put back a state taken by `snapshot` (names registered since are forgotten)."""
        items, meta, pending, broken, self._scanned = state
        for mine, saved in zip(
            (self._items, self._meta, self._pending, self._broken),
            (items, meta, pending, broken),
            strict=True,
        ):
            mine.clear()
            mine.update(saved)


def _show(name: str, param: inspect.Parameter) -> str:
    return name if param.default is param.empty else f"{name}={param.default!r}"
