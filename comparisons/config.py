"""Options of the harness: the presets, TOML merging and validation, in one place.

Each subcommand's options come, later winning, from its defaults
(``configs/defaults.toml``), the quick preset (``configs/quick.toml``,
``quick`` only), the ``--config`` file's top-level keys, its table named after
the subcommand (and ``[quick]`` under ``quick``), then the command-line flags.
Every value of every layer is checked here, and only here, before any
training: a wrong type, an out-of-range number or an unknown key raises naming
the option and what is allowed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from .. import optimizers, parametrizations
from .._core import checks as _checks
from . import strategies as strategies_mod
from . import task as tasks_mod
from .cost import GEOOPT_STEPS, optimizer_steps
from .precision import PRECISIONS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["SECTIONS", "TASK_SHORTCUTS", "preset", "resolve", "parse_shape", "load_toml"]
__all__ += ["task_options_for", "task_lr", "task_option_values"]

SECTIONS = ("drift", "convergence", "complexity")
#: flags kept as shortcuts for task options of the same name (applied to the tasks that take them)
TASK_SHORTCUTS = ("n", "m", "T", "batch", "k", "permute")
#: the presets: configs/defaults.toml and configs/quick.toml (Note [Quick preset] there)
PRESETS = pathlib.Path(__file__).resolve().parent.parent / "configs"
#: the checkout's experiments package: the only modules a config may import (Note [A config
#: is data])
EXPERIMENTS = PRESETS.parent / "experiments"


def _int(lo: int) -> Callable[[str, Any], Any]:
    return lambda name, v: _checks.int_at_least(name, v, lo)


def _number(**bounds: Any) -> Callable[[str, Any], Any]:
    return lambda name, v: _checks.number(name, v, low_open=True, **bounds)


def _str(name: str, v: Any) -> Any:
    if not isinstance(v, str):
        raise TypeError(f"{name}={v!r} ({type(v).__name__}); allowed: a string")
    return v


def _list(item: Callable[[str, Any], Any], nonempty: bool = True, unique: bool = True):
    """A list of ``item``s; with ``unique``, each given once (`_once`)."""

    def check(name: str, v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            e_g = f", e.g. [{v!r}]" if isinstance(v, str) else ""
            raise TypeError(f"{name}={v!r} ({type(v).__name__}); allowed: a list{e_g}")
        if nonempty and not v:
            raise ValueError(f"{name}=[]; allowed: a non-empty list")
        out = [item(f"{name}[{i}]", x) for i, x in enumerate(v)]
        return _once(name, out, out) if unique else out

    return check


def _once(name: str, values: list, keys: list) -> list:
    """``values``, refused when two have equal ``keys``: a duplicate task, strategy or dtype
    would be trained twice and counted twice in its row (or print its table twice)."""
    for j, key in enumerate(keys):
        if key in keys[:j]:
            i = keys.index(key)
            alike = " (they parse alike)" if values[i] != values[j] else ""
            raise ValueError(f"{name}[{j}]={values[j]!r} repeats {name}[{i}]={values[i]!r}"
                             f"{alike}; allowed: each once")  # fmt: skip
    return values


def _strategies(name: str, v: Any) -> Any:
    """Strategy strings, parsed (names, option syntax, lr > 0); two that parse alike (``cwy+adam
    (lr=0.01)``, ``cwy+adam(lr=1e-2)``) are one strategy given twice."""
    v = _list(_str, unique=False)(name, v)
    methods = [*parametrizations.available(), *tasks_mod.extra_methods()]
    known = [strategies_mod.parse(s, methods, optimizers.available()) for s in v]
    keys = [(s.method, s.optimizer, s.method_options, s.optimizer_options) for s in known]
    return _once(name, v, keys)


def _device(name: str, v: Any) -> Any:
    """A device this machine has: ``cpu``, or ``cuda`` / ``cuda:<k>`` where CUDA is available."""
    allowed = "cpu, cuda, cuda:<k>" if torch.cuda.is_available() else "cpu (no CUDA device here)"
    try:
        device = torch.device(_str(name, v))
    except RuntimeError:
        raise ValueError(f"{name}={v!r} is not a device; allowed: {allowed}") from None
    cuda = device.type == "cuda" and (device.index or 0) < torch.cuda.device_count()
    if device.type == "cpu" or cuda:
        return v
    raise ValueError(f"{name}={v!r} is not a device of this machine; allowed: {allowed}")


def _dtype(name: str, v: Any) -> Any:
    if v not in PRECISIONS:
        raise ValueError(f"{name}={v!r}; allowed: {', '.join(PRECISIONS)}")
    return v


def _shape(name: str, v: Any) -> Any:
    if isinstance(v, str):
        v = parse_shape(v)
    refused = ValueError(f"{name}={v!r}; allowed: [N, M] with integers N >= M >= 1")
    try:
        n, m = (_checks.positive_int(name, k) for k in _checks.pair(name, v))
    except (TypeError, ValueError):
        raise refused from None
    if n < m:
        raise refused
    return [n, m]


def _dict(name: str, v: Any) -> Any:
    if not isinstance(v, dict):
        raise TypeError(f"{name}={v!r} ({type(v).__name__}); allowed: a table of key = value")
    return dict(v)


def _limits(name: str, v: Any) -> Any:
    """Largest n (or N) per map or optimizer label: the dense anchors (``exp``'s backward,
    geoopt's N×N canonical step) would take minutes or gigabytes beyond it."""
    v = _dict(name, v)
    known = [*parametrizations.maps(), *optimizer_steps(), *GEOOPT_STEPS]
    for k, size in v.items():
        if k not in known:
            raise ValueError(f"{name}: unknown name {k!r}; available: {', '.join(known)}")
        _int(1)(f"{name}[{k!r}]", size)
    return v


def _any(name: str, v: Any) -> Any:
    return v


def _jobs(name: str, v: Any) -> Any:
    """Worker processes: 1 to 4 × the cores (more only queue up and spoil the times)."""
    most = 4 * (os.cpu_count() or 1)
    if _int(1)(name, v) > most:
        raise ValueError(f"{name}={v} is not allowed; allowed: 1 to {most} (4 × the cores)")
    return v


def _names(allowed: Callable[[], list[str]], why: Callable[[str], str]):
    """A list of names from ``allowed()``; ``why(name)`` says why another is refused."""

    def check(name: str, v: Any) -> Any:
        for x in _list(_str)(name, v):
            if x not in allowed():
                raise ValueError(f"{name}: {x!r} {why(x)}; available: {', '.join(allowed())}")
        return v

    return check


def _stepped() -> list[str]:
    """The optimizers whose steps complexity measures, and geoopt (its anchors)."""
    return [n for n in optimizers.available() if optimizers.info(n).riemannian] + ["geoopt"]


def _not_stepped(name: str) -> str:
    if name in optimizers.available():
        return "is not declared riemannian=True (no step of it is measured)"
    return "is not a registered optimizer"


#: modules imported before the run, which register tasks or complexity parts (e.g.
#: ``experiments.lipschitz`` from a checkout); ``try_imports`` only where they are there
COMMON: dict[str, Callable[[str, Any], Any]] = {
    "out": _any,
    "device": _device,
    "imports": _list(_str, nonempty=False, unique=False),
    "try_imports": _list(_str, nonempty=False, unique=False),
}
TRAINING: dict[str, Callable[[str, Any], Any]] = {
    "tasks": _list(_str),
    "strategies": _strategies,
    "dtypes": _list(_dtype),
    "seeds": _int(1),
    "steps": _int(1),
    "record_every": _int(1),
    "jobs": _jobs,
    "others": _str,
    "lr": _number(),
    "task_options": _dict,
    **{k: _any for k in TASK_SHORTCUTS},  # checked against each task's signature
}
SCHEMA: dict[str, dict[str, Callable[[str, Any], Any]]] = {
    "drift": {**COMMON, **TRAINING},
    "convergence": {**COMMON, **TRAINING},
    "complexity": {
        **COMMON,
        "sizes": _list(_int(2)),
        "fractions": _list(_number(high=1.0, closed_high=True)),
        "repeats": _int(1),
        "shapes": _list(_shape),
        "limits": _limits,
        "methods": _names(lambda: list(parametrizations.maps()), lambda _: "is not a map"),
        "optimizers": _names(_stepped, _not_stepped),
    },
    "report": dict(COMMON),
    "quick": dict(COMMON),
}


def parse_shape(text: str) -> list[int]:
    """``"4096x64"`` → ``[4096, 64]`` (ValueError otherwise); the one shape parser.

    Example:
        ```python
        from stiefel.comparisons.config import parse_shape

        assert parse_shape("4096x64") == [4096, 64]
        ```
    """
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {text!r}; allowed: NxM with integers, e.g. 4096x64")
    return [int(p) for p in parts]


def load_toml(path: pathlib.Path | None) -> dict:
    """The TOML file at ``path`` ({} for None), its tables and keys checked."""
    if path is None:
        return {}
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        cfg = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    every = set().union(*(SCHEMA[s] for s in SCHEMA))
    tables = tuple(SCHEMA)  # quick is one of them
    for key, value in cfg.items():
        if key in tables:
            if not isinstance(value, dict):
                raise TypeError(f"--config {path}: [{key}] must be a table, got {value!r}")
            known = every if key == "quick" else set(SCHEMA[key])
            for k in set(value) - known:
                raise ValueError(f"--config {path}: unknown option {k!r} in [{key}]; "
                                 f"available: {', '.join(sorted(known))}")  # fmt: skip
        elif key not in every:
            listing = f"options: {', '.join(sorted(every))}; tables: {', '.join(tables)}"
            raise ValueError(f"--config {path}: unknown option or table {key!r}; {listing}")
    return cfg


@functools.cache
def _learning_rates() -> dict[str, dict[str, float]]:
    path = PRESETS / "learning_rates.toml"  # a wheel without it: the declared lrs
    return tomllib.loads(path.read_text()) if path.exists() else {}


def task_lr(task: str, optimizer: str) -> float | None:
    """The lr of ``optimizer`` on ``task`` that a short sweep chose, or None: a strategy's
    default before the declared one (``configs/learning_rates.toml``, its sweep's command)."""
    return _learning_rates().get(task, {}).get(optimizer)


def task_options_for(task: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The options of ``task`` in ``opts``: its shortcuts and its ``task_options`` it takes."""
    takes = tasks_mod.options(task)
    return {k: v for k, v in (opts.get("task_options") or {}).items() if k in takes}


def task_option_values(task: str, given: dict[str, Any]) -> str:
    """A task's options as ``k=v``, with the values a run takes (``given`` over the task's)."""
    return ", ".join(f"{k}={given.get(k, d)!r}" for k, d in tasks_mod.options(task).items())


def _check_task_options(opts: dict[str, Any]) -> None:
    given = opts.get("task_options") or {}
    for k in given:
        if not any(k in tasks_mod.options(t) for t in opts["tasks"]):
            listing = "; ".join(f"{t}: {task_option_values(t, given)}" for t in opts["tasks"])
            raise ValueError(f"task option {k!r} is taken by none of the tasks; options: {listing}")
    for t in opts["tasks"]:
        tasks_mod.check_options(t, task_options_for(t, opts))


def _layer(schema: dict, values: dict, where: str) -> dict:
    out = {}
    for k, v in values.items():
        if k not in schema:
            continue
        try:
            out[k] = schema[k](k, v)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
    shortcuts = {k: out.pop(k) for k in TASK_SHORTCUTS if k in out}
    for k, v in shortcuts.items():  # one layer giving two values: neither is silently dropped
        if k in out.get("task_options", {}) and out["task_options"][k] != v:
            given = (f"--{k} {v}", f"--task-option {k}={out['task_options'][k]}")
            if where != "option":
                given = (f"{k} = {v!r}", f"task_options {{ {k} = {out['task_options'][k]!r} }}")
            raise ValueError(f"{where}: {given[0]} and {given[1]} conflict; give one of them")
    if shortcuts:  # a layer's shortcut flags are its task options of that name
        out["task_options"] = {**out.get("task_options", {}), **shortcuts}
    return out


def _merge(opts: dict, layer: dict) -> None:
    """``opts`` updated by ``layer``; task options and limits add up key by key."""
    for k, v in layer.items():
        opts[k] = {**opts[k], **v} if k in ("task_options", "limits") and k in opts else v


def _config_import(name: str, key: str, where: str) -> bool:
    """Note [A config is data]

    A TOML file is read as data: importing a module runs its code, and Python's
    path holds the working directory, so a config's ``imports`` could run a file
    lying beside it. A config may import only modules of the checkout's own
    ``experiments`` package (found without running anything first); another
    module is refused naming it, the file and ``--trust-config``, which lifts
    the rule. ``--import`` on the command line is the user's own choice and is
    not restricted. A ``try_imports`` module outside the checkout is skipped.
    """
    spec = None
    if name.partition(".")[0] == "experiments":
        try:
            spec = importlib.util.find_spec("experiments")  # locates, runs nothing
        except (ImportError, ValueError):
            pass
    ours = spec is not None and [str(EXPERIMENTS)] == [
        str(pathlib.Path(p).resolve()) for p in spec.submodule_search_locations or []
    ]
    if ours or (key == "try_imports" and spec is None):  # absent: skipped at import
        return True
    if key == "try_imports":
        print(f"not imported (not this checkout's experiments package): {name}", flush=True)
        return False
    raise ValueError(
        f"{where}: imports names {name!r}, which is not a module of this checkout's "
        f"experiments package ({EXPERIMENTS}); a config may import only those: pass "
        f"--trust-config to import it anyway, or name it with --import {name}"
    )


def preset(name: str) -> dict:
    """The preset file ``configs/<name>.toml`` (``defaults`` or ``quick``), checked."""
    return load_toml(PRESETS / f"{name}.toml")


def resolve(
    command: str,
    flags: dict[str, Any],
    config: pathlib.Path | None = None,
    quick: bool = False,
    trust: bool = False,
) -> dict[str, Any]:
    """The checked options of section ``command`` from its layers (module docstring).

    The modules named by ``imports`` are imported first, so the tasks, maps and
    optimizers they register are known when the other options are checked; those a
    TOML file names must be modules of the checkout's ``experiments`` package unless
    ``trust`` (``--trust-config``; Note [A config is data]).
    """
    schema = SCHEMA[command]
    flags = {k: v for k, v in flags.items() if v is not None}
    cfg, where = load_toml(config), f"--config {config}"
    top = {k: v for k, v in cfg.items() if k not in (*SCHEMA, "quick")}
    raw = [(preset("defaults").get(command, {}), "configs/defaults.toml")]
    raw += [(preset("quick").get(command, {}), "configs/quick.toml")] if quick else []
    raw += [(top, where), (cfg.get(command, {}), where)]
    raw += [(cfg.get("quick", {}), where)] if quick else []
    raw.append((flags, "option"))
    imports: dict[str, list[str]] = {"imports": [], "try_imports": []}
    for values, where in raw:
        layer = _layer(schema, {k: values[k] for k in imports if k in values}, where)
        if where != "option" and not trust:  # Note [A config is data]
            layer = {k: [m for m in v if _config_import(m, k, where)] for k, v in layer.items()}
        imports.update(layer)
    tasks_mod.import_modules(imports["imports"])
    tasks_mod.import_modules(imports["try_imports"], required=False)
    opts: dict[str, Any] = {}
    preset_options: set[str] = set()  # the task options only the presets set
    for values, where in raw:
        layer = _layer(schema, values, where)
        _merge(opts, layer)
        given = set(layer.get("task_options") or {})
        preset_options = (
            preset_options | given if where.startswith("configs/") else preset_options - given
        )
    opts.setdefault("device", "cpu")
    if "tasks" in schema:  # Note [Trusted times]: a worker of one thread per core
        opts.setdefault("jobs", os.cpu_count() or 1)
    opts["out"] = pathlib.Path(opts.get("out") or "results")
    if "tasks" in opts:
        # a preset's task option that none of the chosen tasks takes is dropped (e.g.
        # drift's n = 64 under tasks = ["finetune"]); one the user gave is an error
        for k in preset_options:
            if not any(k in tasks_mod.options(t) for t in opts["tasks"]):
                del opts["task_options"][k]
        for t in opts["tasks"]:
            tasks_mod.get(t)  # unknown task: ValueError listing them
        _check_task_options(opts)
    return opts
