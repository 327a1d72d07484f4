"""Tasks of the comparison harness, by name."""

from __future__ import annotations

import torch

from .base import Task
from .matrix import Brockett, Procrustes
from .sequence import Adding, Copying, Digits

TASKS: dict[str, type[Task]] = {
    "procrustes": Procrustes,
    "brockett": Brockett,
    "copying": Copying,
    "adding": Adding,
    "digits": Digits,
}


def available() -> list[str]:
    return sorted(TASKS)


def make(name: str, dtype: torch.dtype, device: torch.device, seed: int, **options) -> Task:
    """Instantiate the task ``name`` (options are the task's keyword arguments)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(available())}")
    try:
        return TASKS[name](dtype, device, seed, **options)
    except TypeError as exc:
        raise ValueError(f"task {name!r}: bad options {options}: {exc}") from exc


__all__ = [
    "TASKS",
    "Task",
    "available",
    "make",
    "Procrustes",
    "Brockett",
    "Copying",
    "Adding",
    "Digits",
]
