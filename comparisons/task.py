"""The task interface and the task registry of the harness.

A task registers under a name with `register`; its options are the
keyword arguments of its ``__init__`` after ``dtype``, ``device`` and ``seed``
(with those of its base classes when it passes ``**kw`` on), so the command
line (``--task-option k=v``) and TOML configs reach them with no other edit.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Task", "register", "available", "get", "options", "make", "check_options", "import_modules",
    "extra_methods", "digits_split", "Classification",
]  # fmt: skip

_TASKS: dict[str, type[Task]] = {}
_FIXED = ("self", "dtype", "device", "seed")
T = TypeVar("T", bound=type)


def positive_int(task: str, name: str, value: Any) -> int:
    """``value`` as an int >= 1, or ValueError naming the task and option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"task {task!r}: {name}={value!r}; allowed: an integer >= 1")
    return value


def digits_split(task: str, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """scikit-learn's bundled 8×8 digits in [0, 1]: (x_train, y_train, x_test, y_test).

    The 1797 images (shape (n, 8, 8), offline) are split 1397 / 400 by one
    permutation drawn from ``generator``, so a task's seed fixes its split.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"the {task} task needs scikit-learn: pip install 'stiefel[compare]'"
        ) from exc
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=generator)
    test, train = order[:400], order[400:]
    return x[train], y[train], x[test], y[test]


class Task:
    """A learning problem on which strategies are compared.

    Subclasses build a model for a strategy, give its loss for a training step,
    the constrained matrix (for drift), and where known the optimum and the
    baseline of the loss (a run that ends above the baseline did no better than
    chance) and ``chance`` levels of held-out metrics (a run at or below them
    failed).
    """

    name = "task"
    #: "matrix" tasks train one constrained matrix; "sequence" tasks train an RNN;
    #: others ("video", "image", "finetune") name what their model is
    kind = "matrix"
    optimum: float | None = None
    baseline: float | None = None
    #: held-out metrics at chance level, e.g. {"test_accuracy": 0.1}
    chance: dict[str, float] = {}
    #: models this task builds itself besides the registered maps, name → what it is:
    #: baselines (``lstm`` on the sequence tasks, ``convlstm`` on ``moving_digits``)
    #: and other libraries' layers (the PEFT adapters of ``finetune``). Strategies may
    #: name them; they run only on the tasks that declare them, the strategy's
    #: optimizer trains every trainable weight of such a model, and they are real
    #: (a complex dtype skips them)
    extra_methods: dict[str, str] = {}
    #: metrics of `evaluate` shown as columns of the convergence table
    table_metrics: tuple[str, ...] = ("test_accuracy",)

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int):
        self.dtype, self.device, self.seed = dtype, device, seed
        self.generator = torch.Generator().manual_seed(seed)

    def build(self, method: str, method_options: dict) -> nn.Module:
        raise NotImplementedError

    def check_method(self, method: str, method_options: dict) -> None:
        """Raise for a method or options this task cannot build; called before any training.

        The default checks nothing (a map's options are checked when it is built).
        """

    def constrained(self, model: nn.Module) -> nn.Module:
        """The submodule that holds the constrained matrix (the strategy's optimizer trains it)."""
        return model.transition

    def weight(self, model: nn.Module) -> torch.Tensor:
        """The constrained matrix (for the drift metric)."""
        return self.constrained(model)()

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics (accuracy, test loss); empty by default."""
        return {}

    def describe(self) -> dict[str, Any]:
        """The option values of this instance (for reports)."""
        return {k: getattr(self, k) for k in options(self.name) if hasattr(self, k)}


class Classification:
    """Mixin of a classification task: tensors ``x_train``, ``y_train``, ``x_test``,
    ``y_test``, a ``batch`` size and the task's ``generator`` (listed before `Task`)."""

    def minibatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` training examples drawn with replacement from the task's generator."""
        idx = torch.randint(0, len(self.y_train), (self.batch,), generator=self.generator)
        return self.x_train[idx], self.y_train[idx]

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        x, y = self.minibatch()
        return F.cross_entropy(model(x), y)

    def test_metrics(self, logits: torch.Tensor) -> dict[str, float]:
        """Test accuracy and cross-entropy of the logits of ``x_test``."""
        return {
            "test_accuracy": float((logits.argmax(-1) == self.y_test).float().mean()),
            "test_loss": float(F.cross_entropy(logits, self.y_test)),
        }


def register(name: str) -> Callable[[T], T]:
    """Class decorator registering a `Task` subclass under ``name``.

    Example:
        ```python
        from stiefel.comparisons import tasks

        assert "procrustes" in tasks.available()
        assert tasks.options("procrustes")["n"] == 32
        ```
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"task name={name!r}; allowed: a Python identifier string")

    def decorator(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"task {name!r}: {cls!r} is not a Task subclass")
        if name in _TASKS and _TASKS[name] is not cls:
            raise ValueError(f"task {name!r} is already registered ({_TASKS[name]!r})")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return decorator


def available() -> list[str]:
    """Sorted names of the registered tasks."""
    return sorted(_TASKS)


def extra_methods() -> dict[str, list[str]]:
    """Methods that registered tasks build besides the maps, each with the tasks that do.

    Example:
        ```python
        from stiefel.comparisons import tasks

        assert "digits" in tasks.extra_methods()["lstm"]  # the LSTM baseline
        assert tasks.get("digits").extra_methods["lstm"] == "the LSTM baseline"
        ```
    """
    out: dict[str, list[str]] = {}
    for name in available():
        for method in _TASKS[name].extra_methods:
            out.setdefault(method, []).append(name)
    return out


def get(name: str) -> type[Task]:
    """The task class registered as ``name`` (ValueError listing the tasks)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(available())}")
    return _TASKS[name]


def options(name: str) -> dict[str, Any]:
    """The options of task ``name`` and their defaults, read from the signatures.

    Walks the class's ``__init__`` and, while it takes ``**kw``, its bases'.
    """
    out: dict[str, Any] = {}
    for klass in get(name).__mro__:
        if "__init__" not in vars(klass) or klass is Task:
            continue
        params = inspect.signature(klass.__init__).parameters
        for p in params.values():
            if p.name in _FIXED or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            out.setdefault(p.name, None if p.default is p.empty else p.default)
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return out


def _type_ok(value: Any, default: Any) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool) or (isinstance(value, str) and isinstance(default, str))
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, (str, bool))  # e.g. operator: bool | "auto"
    return True


def check_options(name: str, given: dict[str, Any]) -> None:
    """ValueError for an option task ``name`` does not take, TypeError for a wrong type."""
    known = options(name)
    listing = ", ".join(f"{k}={v!r}" for k, v in known.items())
    for k, v in given.items():
        if k not in known:
            raise ValueError(f"task {name!r}: unknown option {k!r}; its options: {listing}")
        if not _type_ok(v, known[k]):
            raise TypeError(
                f"task {name!r}: option {k}={v!r} ({type(v).__name__}); "
                f"allowed: a {type(known[k]).__name__} like the default {known[k]!r}"
            )


def make(name: str, dtype: torch.dtype, device: torch.device, seed: int, **opts: Any) -> Task:
    """Instantiate the task ``name`` with its options (checked against its signature)."""
    check_options(name, opts)
    return get(name)(dtype, device, seed, **opts)


def import_modules(names: list[str], required: bool = True) -> None:
    """Import the modules ``names`` (e.g. ``experiments.lipschitz``), which register tasks.

    The harness's ``--import MODULE`` and a config's ``imports = [...]``: the
    paper reproductions of a checkout's ``experiments/`` are not installed and
    register their tasks this way (run from the checkout's root). With
    ``required=False`` (a config's ``try_imports``) a module that is not there
    is skipped, with a note the first time.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if required or not (exc.name and name.startswith(exc.name)):
                raise ValueError(
                    f"imports: cannot import {name!r} ({exc}); allowed: an importable module, "
                    "e.g. experiments.lipschitz from the root of a checkout"
                ) from exc
            if name not in _SKIPPED:
                _SKIPPED.add(name)
                print(f"not imported (not in this installation): {name}", flush=True)


_SKIPPED: set[str] = set()
