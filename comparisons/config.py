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

import pathlib
from collections.abc import Callable
from typing import Any

from .. import parametrizations
from ..manifolds import _checks
from . import task as tasks_mod
from .cost import GEOOPT_STEPS, optimizer_steps
from .precision import PRECISIONS

__all__ = ["SECTIONS", "TASK_SHORTCUTS", "preset", "resolve", "parse_shape", "load_toml"]
__all__ += ["task_options_for"]

SECTIONS = ("drift", "convergence", "complexity")
#: flags kept as shortcuts for task options of the same name (applied to the tasks that take them)
TASK_SHORTCUTS = ("n", "m", "T", "batch", "k", "permute")
#: the presets: configs/defaults.toml and configs/quick.toml (Note [Quick preset] there)
PRESETS = pathlib.Path(__file__).resolve().parent.parent / "configs"


# ----------------------------------------------------------------------------- validators
def _int(lo: int) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        return _checks.int_at_least(name, v, lo)

    return check


def _number(**bounds: Any) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        return _checks.number(name, v, low_open=True, **bounds)

    return check


def _str(name: str, v: Any) -> Any:
    if not isinstance(v, str):
        raise TypeError(f"{name}={v!r} ({type(v).__name__}); allowed: a string")
    return v


def _list(item: Callable[[str, Any], Any], nonempty: bool = True) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            raise TypeError(
                f"{name}={v!r} ({type(v).__name__}); allowed: a list, e.g. [{v!r}]"
                if isinstance(v, str)
                else f"{name}={v!r} ({type(v).__name__}); allowed: a list"
            )
        if nonempty and not v:
            raise ValueError(f"{name}=[]; allowed: a non-empty list")
        return [item(f"{name}[{i}]", x) for i, x in enumerate(v)]

    return check


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


#: modules imported before the run, which register tasks or complexity parts (e.g.
#: ``experiments.lipschitz`` from a checkout); ``try_imports`` only where they are there
COMMON: dict[str, Callable[[str, Any], Any]] = {
    "out": _any,
    "device": _str,
    "imports": _list(_str, nonempty=False),
    "try_imports": _list(_str, nonempty=False),
}
TRAINING: dict[str, Callable[[str, Any], Any]] = {
    "tasks": _list(_str),
    "strategies": _list(_str),
    "dtypes": _list(_dtype),
    "seeds": _int(1),
    "steps": _int(1),
    "record_every": _int(1),
    "jobs": _int(1),
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
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    cfg = tomllib.loads(path.read_text())
    every = set().union(*(SCHEMA[s] for s in SCHEMA))
    tables = (*SCHEMA, "quick")
    for key, value in cfg.items():
        if key in tables:
            if not isinstance(value, dict):
                raise TypeError(f"--config {path}: [{key}] must be a table, got {value!r}")
            known = every if key == "quick" else set(SCHEMA[key])
            for k in value:
                if k not in known:
                    raise ValueError(
                        f"--config {path}: unknown option {k!r} in [{key}]; "
                        f"available: {', '.join(sorted(known))}"
                    )
        elif key not in every:
            raise ValueError(
                f"--config {path}: unknown option or table {key!r}; options: "
                f"{', '.join(sorted(every))}; tables: {', '.join(tables)}"
            )
    return cfg


def task_options_for(task: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The options of ``task`` in ``opts``: its shortcuts and its ``task_options`` it takes."""
    takes = tasks_mod.options(task)
    return {k: v for k, v in (opts.get("task_options") or {}).items() if k in takes}


def _check_task_options(opts: dict[str, Any]) -> None:
    for k in opts.get("task_options") or {}:
        if not any(k in tasks_mod.options(t) for t in opts["tasks"]):
            listing = "; ".join(
                f"{t}: " + ", ".join(f"{o}={d!r}" for o, d in tasks_mod.options(t).items())
                for t in opts["tasks"]
            )
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
    if shortcuts:  # a layer's shortcut flags are its task options of that name
        out["task_options"] = {**out.get("task_options", {}), **shortcuts}
    return out


def _merge(opts: dict, layer: dict) -> None:
    """``opts`` updated by ``layer``; task options and limits add up key by key."""
    for k, v in layer.items():
        opts[k] = {**opts[k], **v} if k in ("task_options", "limits") and k in opts else v


def preset(name: str) -> dict:
    """The preset file ``configs/<name>.toml`` (``defaults`` or ``quick``), checked."""
    return load_toml(PRESETS / f"{name}.toml")


def resolve(
    command: str,
    flags: dict[str, Any],
    config: pathlib.Path | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """The checked options of section ``command`` from its layers (module docstring).

    The modules named by ``imports`` are imported first, so the tasks, maps and
    optimizers they register are known when the other options are checked.
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
        imports.update(_layer(schema, {k: values[k] for k in imports if k in values}, where))
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
