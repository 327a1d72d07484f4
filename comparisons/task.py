"""The task interface and the task registry of the harness.

A task registers under a name with `register`; its options are the
keyword arguments of its ``__init__`` after ``dtype``, ``device`` and ``seed``
(with those of its base classes when it passes ``**kw`` on), so the command
line (``--task-option k=v``) and TOML configs reach them with no other edit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .._core import checks as _checks
from .._core.registry import REQUIRED, Registry

__all__ = [
    "Task", "register", "available", "get", "options", "make", "check_options", "import_modules",
    "extra_methods", "digits_split", "Classification", "TASKS", "ENTRY_POINT_GROUP",
]  # fmt: skip

_FIXED = ("dtype", "device", "seed")
ENTRY_POINT_GROUP = "stiefel.tasks"
T = TypeVar("T", bound=type)


def positive_int(task: str, name: str, value: Any) -> int:
    """``value`` as an int >= 1, or ValueError naming the task and option."""
    try:
        return _checks.positive_int(name, value)
    except ValueError as exc:
        raise ValueError(f"task {task!r}: {exc}") from None


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


#: what a task's ``baseline`` is, as tables and figures name it
BASELINE = "baseline (a trivial predictor's loss)"


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
    #: a run whose final gap to a known optimum is above this fraction of its first did not
    #: converge (`stiefel.comparisons.runner.failure`)
    converged_fraction = 0.1
    #: held-out metrics at chance level, e.g. {"test_accuracy": 0.1}
    chance: dict[str, float] = {}
    #: models this task builds itself besides the maps, name → what it is (``lstm``, the PEFT
    #: adapters of ``finetune``): they run only on the tasks that declare them, the strategy's
    #: optimizer trains all their weights, and they are real (a complex dtype skips them)
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


def _check_task(name: str, obj: Any) -> None:
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise TypeError(f"task {name!r}: {obj!r} is not a Task subclass")


def _set_name(name: str, cls: type[Task]) -> None:
    cls.name = name


# The one registry of tasks (the class serves maps and optimizers too); third-party
# packages declare tasks in the entry-point group ``stiefel.tasks``.
TASKS: Registry[type[Task]] = Registry(
    "task",
    argument="task",
    group=ENTRY_POINT_GROUP,
    fixed=_FIXED,
    stop=(Task,),
    check=_check_task,
    on_register=_set_name,
    sort=True,
    typed=True,
)


def register(name: str) -> Callable[[T], T]:
    """Class decorator registering a `Task` subclass under ``name``.

    Example:
        ```python
        from stiefel.comparisons import tasks

        assert "procrustes" in tasks.available()
        assert tasks.options("procrustes")["n"] == 32
        ```
    """
    return TASKS.register(name)


def available() -> list[str]:
    """Sorted names of the registered tasks."""
    return TASKS.available()


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
    for name, cls in TASKS.items().items():
        for method in cls.extra_methods:
            out.setdefault(method, []).append(name)
    return out


def get(name: str) -> type[Task]:
    """The task class registered as ``name`` (ValueError listing the tasks)."""
    return TASKS.get(name)


def options(name: str) -> dict[str, Any]:
    """The options of task ``name`` and their defaults (None where none), from the signatures.

    Walks the class's ``__init__`` and, while it takes ``**kw``, its bases'.
    """
    return {k: None if v is REQUIRED else v for k, v in TASKS.options(name).items()}


def check_options(name: str, given: dict[str, Any]) -> None:
    """Refuse an option task ``name`` does not take, or a value of the wrong type.

    Raises:
        RegistryError: (a ValueError and a TypeError) naming the option and
            listing the task's options with their defaults.
    """
    takes = options(name)
    TASKS.check_options(name, {k: v for k, v in given.items() if k not in takes})
    for k, v in given.items():
        try:
            TASKS.check_options(name, {k: v})
        except (TypeError, ValueError) as exc:  # the registry's "allowed: int" alone: add an e.g.
            allowed = (str(exc).split("allowed: ", 1)[1:] or ["see --help"])[0]
            raise type(exc)(f"task {name!r}: option {k}={v!r} ({type(v).__name__}); allowed: "
                            f"{allowed}, e.g. its default {k}={takes[k]!r}") from None  # fmt: skip


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
        except SystemExit as exc:  # never a silent exit 0 of the harness having done nothing
            raise ValueError(f"imports: {name!r} exited at import ({exc!r})") from None
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
