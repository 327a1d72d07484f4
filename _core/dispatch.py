r"""One dispatcher per kernel operation: which named path an operation takes.

A kernel operation with more than one implementation (a faster path for a
device, a size or a tracer beside the plain formula) chooses in one visible
place, as torch's ``adam()`` chooses among its single-tensor, foreach and fused
paths. A `Dispatcher` names the operation, its paths (the first is the
*reference*: the plain formula every other path must equal) and the policy that
picks one from the inputs; the kernel asks it and branches on the name it
returns. Device and compile tests live in these policies only.

`policy(reference=True)` forces every dispatcher onto its reference path, so
one property test per dispatcher (`tests/test_dispatch.py`) checks each other
path against the reference on inputs for which the policy picks that path.
The registry of dispatchers is the single list of what exists: that test fails
when a dispatcher has no case.

Example:
    ```python
    import torch
    from stiefel._core.dispatch import dispatcher, policy

    @dispatcher("double", paths=("add", "mul"), why="mul: one kernel instead of two reads")
    def double_path(x: torch.Tensor) -> str:
        return "mul" if x.is_floating_point() else "add"

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if double_path(x) == "mul" else x + x

    x = torch.ones(3)
    assert double_path(x) == "mul"
    with policy(reference=True):
        assert double_path(x) == "add"
    assert double_path(x) == "mul"
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["Dispatcher", "dispatcher", "policy", "reference_forced", "DISPATCHERS"]


class _Forced:
    """Whether `policy(reference=True)` holds (an attribute read, so that a
    compiled kernel guards on it as torch's backend flags are guarded)."""

    reference = False


_FORCED = _Forced()
_ALL: dict[str, Dispatcher] = {}

#: Every dispatcher, by operation name (read-only): tests and docs read it.
DISPATCHERS = MappingProxyType(_ALL)


@dataclass(frozen=True)
class Dispatcher:
    """The choice among the named paths of one kernel operation.

    Attributes:
        name: the operation (e.g. ``"expm"``).
        paths: its paths; ``paths[0]`` is the reference.
        choose: the policy, ``(*inputs) -> path name``.
        why: where each non-reference path wins, in a line (its benchmark row
            is in docs/performance.md).
    """

    name: str
    paths: tuple[str, ...]
    choose: Callable[..., str]
    why: str

    @property
    def reference(self) -> str:
        """The plain path every other one is tested against."""
        return self.paths[0]

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        if _FORCED.reference:
            return self.paths[0]
        return self.choose(*args, **kwargs)


def dispatcher(name: str, paths: tuple[str, ...], why: str) -> Callable[[Callable], Dispatcher]:
    """Register ``choose`` as the policy of operation ``name`` with ``paths``.

    Raises:
        ValueError: ``name`` is taken, or ``paths`` has fewer than two names.
    """
    if name in _ALL:
        raise ValueError(f"dispatcher name={name!r} is taken; taken: {sorted(_ALL)}")
    if len(paths) < 2 or len(set(paths)) != len(paths):
        raise ValueError(
            f"dispatcher {name!r}: paths={paths!r}; expected two or more distinct names"
        )

    def register(choose: Callable[..., str]) -> Dispatcher:
        d = Dispatcher(name, tuple(paths), choose, why)
        _ALL[name] = d
        return d

    return register


def reference_forced() -> bool:
    """True while `policy(reference=True)` holds."""
    return _FORCED.reference


@contextmanager
def policy(*, reference: bool) -> Iterator[None]:
    """Within the block, every dispatcher takes its reference path (``reference=True``)
    or its policy's choice (``reference=False``); the previous setting comes back after.

    The setting is the process's, as torch's backend flags (``torch.backends.*.flags``)
    are, so that a compiled kernel guards on it: a block in one thread holds for every
    thread, and blocks of several threads that overlap restore each other's settings.

    Raises:
        TypeError: ``reference`` is not a bool.
    """
    if not isinstance(reference, bool):
        raise TypeError(f"policy: reference={reference!r}; expected True or False")
    old = _FORCED.reference
    _FORCED.reference = reference
    try:
        yield
    finally:
        _FORCED.reference = old
