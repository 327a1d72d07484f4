"""Command line of the comparison harness: ``python -m stiefel.comparisons`` / ``stiefel-compare``.

Subcommands: ``drift``, ``convergence``, ``complexity``, ``report`` and ``quick``
(a small version of all of them plus the report, in a few minutes on 2 cores).
Options come from flags or from a TOML file (``--config``): its top-level keys
apply to every subcommand, a table named after the subcommand overrides them,
and flags given on the command line win over both.
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import sys
import time

import torch

from . import tasks as tasks_mod
from .complexity import GEOOPT_STEPS
from .report import write_report
from .sections import complexity_section, convergence_section, drift_section

DRIFT_STRATEGIES = [
    "householder+adam",
    "cwy+adam",
    "exp+adam",
    "cayley+adam",
    "riemannian+rgd(retraction=cayley)",
    "riemannian+rgd(retraction=qr)",
    "riemannian+radam",
    "riemannian+landing",
]
CONVERGENCE_STRATEGIES = [
    "cwy+adam",
    "exp+adam",
    "scaled_cayley+rmsprop",
    "riemannian+rgd(metric=canonical,retraction=cayley)",
    "riemannian+radam",
    "riemannian+landing",
    "lstm+rmsprop",
]

COMMANDS = ("drift", "convergence", "complexity", "report", "quick")
DEFAULTS = {
    "drift": dict(
        tasks=["procrustes"],
        strategies=DRIFT_STRATEGIES,
        steps=2000,
        seeds=1,
        dtypes=["float32", "float64"],
        n=64,
        m=None,
        record_every=20,
    ),
    "convergence": dict(
        tasks=["procrustes", "brockett", "copying", "adding", "digits"],
        strategies=CONVERGENCE_STRATEGIES,
        steps=2000,
        seeds=3,
        dtypes=["float32"],
        n=None,
        m=None,
        record_every=20,
    ),
    "complexity": dict(
        sizes=[128, 256, 512, 1024],
        fractions=[1 / 16, 1 / 4, 1.0],
        repeats=7,
        shapes=[[1024, 64], [2048, 64], [4096, 64]],
        # geoopt's canonical step forms an N×N matrix: 1 GiB and a minute at N = 16384
        limits={label: 16384 for label in GEOOPT_STEPS if "Canonical" in label},
    ),
}
QUICK = {
    "drift": dict(
        tasks=["procrustes"],
        steps=300,
        n=24,
        m=8,
        record_every=10,
        jobs=2,  # Note [Parallel runs]: the quick preset uses both cores
        strategies=[
            "cwy+adam",
            "exp+adam",
            "riemannian+rgd(retraction=cayley)",
            "riemannian+rgd(retraction=qr)",
            "riemannian+landing",
        ],
    ),
    "convergence": dict(
        tasks=["procrustes", "brockett", "copying", "digits"],
        steps=150,
        seeds=2,
        n=16,
        m=4,
        T=10,
        batch=32,
        record_every=10,
        jobs=2,
        strategies=[
            "cwy+adam",
            "scaled_cayley+rmsprop",
            "riemannian+rgd(metric=canonical,retraction=cayley)",
            "riemannian+landing",
            "lstm+rmsprop",
        ],
    ),
    "complexity": dict(
        sizes=[32, 64, 128],
        fractions=[1 / 4, 1.0],
        repeats=3,
        shapes=[[256, 16], [512, 16], [1024, 16]],
    ),
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=pathlib.Path, default=None, help="results folder (results/)")
    p.add_argument("--device", default=None, help="cpu or cuda")
    p.add_argument("--config", type=pathlib.Path, default=None, help="a TOML file of options")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is often fastest for small models",
    )


def _training(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--tasks", nargs="+", default=None, help=f"of {tasks_mod.available()}")
    p.add_argument("--strategies", nargs="+", default=None, help="e.g. cwy+adam riemannian+rgd")
    p.add_argument(
        "--dtype",
        dest="dtypes",
        nargs="+",
        default=None,
        help="float32 float64 complex64 complex128",
    )
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (0, 1, …)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--record-every", type=int, default=None)
    p.add_argument("--n", type=int, default=None, help="matrix size / hidden size")
    p.add_argument("--m", type=int, default=None, help="columns (Stiefel tasks)")
    p.add_argument("--T", type=int, default=None, help="sequence length (copying, adding)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--permute", action="store_true", default=None, help="permuted digits")
    p.add_argument("--others", default=None, help="optimizer of the unconstrained weights")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="worker processes, one torch thread each (default 1: runs in this process)",
    )


def _shape(text: str) -> list[int]:
    """``"4096x64"`` → ``[4096, 64]``."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: NxM with integers, e.g. 4096x64")
    return [int(p) for p in parts]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stiefel-compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _training(sub.add_parser("drift", help="‖XᴴX − I‖_F against step"))
    _training(sub.add_parser("convergence", help="loss against step and wall time"))
    c = sub.add_parser("complexity", help="time and memory against size")
    _common(c)
    c.add_argument("--sizes", type=int, nargs="+", default=None)
    c.add_argument("--fractions", type=float, nargs="+", default=None, help="L / n")
    c.add_argument("--repeats", type=int, default=None)
    c.add_argument(
        "--shapes",
        type=_shape,
        nargs="+",
        default=None,
        help="St(N, M) shapes of the optimizer steps, as NxM (e.g. 4096x64)",
    )
    r = sub.add_parser("report", help="gather results into report.md")
    _common(r)
    q = sub.add_parser("quick", help="a small run of everything and the report")
    _common(q)
    return parser


def _load_toml(path: pathlib.Path | None) -> dict:
    if path is None:
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    if not path.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    return tomllib.loads(path.read_text())


def _option_names() -> dict[str, set[str]]:
    """The option names each subcommand but ``quick`` takes: its flags and its defaults."""
    subs = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        command: {a.dest for a in subs.choices[command]._actions} - {"help", "config", "threads"}
        | set(DEFAULTS.get(command, {}))
        | {"others", "k"}
        for command in COMMANDS
        if command != "quick"
    }


def _check_config(cfg: dict, path: pathlib.Path) -> None:
    """Unknown tables or keys in a TOML config raise ValueError listing the known ones."""
    names = _option_names()
    every = set().union(*names.values())
    for key, value in cfg.items():
        if isinstance(value, dict) and key not in every:
            if key not in COMMANDS:
                raise ValueError(
                    f"--config {path}: unknown table [{key}]; available: {', '.join(COMMANDS)}"
                )
            known = names.get(key, every)  # [quick] takes any subcommand's options
            for k in value:
                if k not in known:
                    raise ValueError(
                        f"--config {path}: unknown option {k!r} in [{key}]; "
                        f"available: {', '.join(sorted(known))}"
                    )
        elif key not in every:
            raise ValueError(
                f"--config {path}: unknown option {key!r}; available: {', '.join(sorted(every))}"
            )


def _options(command: str, args: argparse.Namespace, preset: dict | None = None) -> dict:
    opts = dict(DEFAULTS.get(command, {}))
    opts.update(preset or {})
    cfg = _load_toml(getattr(args, "config", None))
    _check_config(cfg, getattr(args, "config", None))
    limits = dict(opts.get("limits") or {})
    opts.update({k: v for k, v in cfg.items() if not (isinstance(v, dict) and k in COMMANDS)})
    opts.update(cfg.get(command, {}))
    if "limits" in opts:  # a config's limits add to the defaults' instead of replacing them
        opts["limits"] = {**limits, **(opts["limits"] or {})}
    opts.update(
        {
            k: v
            for k, v in vars(args).items()
            if v is not None and k not in ("command", "config", "threads")
        }
    )
    opts.setdefault("out", pathlib.Path("results"))
    opts["out"] = pathlib.Path(opts["out"])
    opts.setdefault("device", "cpu")
    opts.setdefault("others", "adam(lr=1e-3)")
    return opts


def task_options(task: str, opts: dict) -> dict:
    """The flags that ``task`` takes (n, m, T, batch, permute), from the options."""
    params = inspect.signature(tasks_mod.TASKS[task].__init__).parameters
    return {
        k: opts[k]
        for k in ("n", "m", "T", "batch", "permute", "k")
        if k in params and opts.get(k) is not None
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}: allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.command == "quick":
        base = _options("report", args)
        out = base["out"]
        for name, fn in (
            ("drift", drift_section),
            ("convergence", convergence_section),
            ("complexity", complexity_section),
        ):
            opts = _options(
                name,
                argparse.Namespace(out=out, device=args.device, config=args.config, threads=None),
                QUICK[name],
            )
            print(f"== {name}", flush=True)
            fn(opts)
    elif args.command == "report":
        out = _options("report", args)["out"]
    else:
        opts = _options(args.command, args)
        out = opts["out"]
        {
            "drift": drift_section,
            "convergence": convergence_section,
            "complexity": complexity_section,
        }[args.command](opts)
    path = write_report(out)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
