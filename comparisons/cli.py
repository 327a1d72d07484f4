"""Command line of the comparison harness: ``python -m stiefel.comparisons`` / ``stiefel-compare``.

Argument parsing only: options are merged and checked in
`stiefel.comparisons.config`, runs are stored by
`stiefel.comparisons.store`, sections live in
`stiefel.comparisons.sections`.
"""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import signal
import sys
import time
import warnings

import torch

from .. import optimizers, parametrizations
from . import config, tasks
from .report import write_report
from .sections import SECTIONS
from .store import OutputLocked, RunStore

__all__ = ["main", "run"]

DESCRIPTION = """\
Compare orthogonality strategies: a map (or riemannian) plus an optimizer, e.g. cwy+adam.

subcommands: drift, convergence, complexity, report, and quick (a small run of
all three plus the report, a few minutes on 2 cores). Options come, later
winning, from the defaults, a TOML file (--config: top-level keys, then the
table named after the subcommand, [quick] under quick), then the flags.
Results go to --out: one JSON per run as it finishes, manifest.json, report.md.
"""

#: Note [Dependency warnings]: geoopt decorates functions with torch.jit.script,
#: deprecated in torch 2.13; the warning is about geoopt, not about the run.
DEPENDENCY_WARNINGS = [("`torch.jit.script` is deprecated", DeprecationWarning)]


def _quiet_dependencies() -> None:
    for message, category in DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
        entry = f"ignore:{message}:{category.__name__}"
        old = os.environ.get("PYTHONWARNINGS")
        if entry not in (old or ""):  # spawned workers read it at start-up
            os.environ["PYTHONWARNINGS"] = entry if not old else f"{old},{entry}"


def _task_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--task-option {text!r}; expected KEY=VALUE, e.g. T=50")
    key, value = text.split("=", 1)
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip()


def _shape(text: str) -> list[int]:
    try:
        return config.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _default(command: str, key: str) -> str:
    d = config.preset("defaults").get(command, {}).get(key)
    if isinstance(d, list):
        d = " ".join(map(str, d))
    return f" (default: {d})" if d is not None else ""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="results folder (default: results)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--config", type=pathlib.Path, default=None, help="a TOML file of options")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--resume", action="store_true", help="continue the runs in --out, skipping finished ones"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results of this subcommand in --out"
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=None,
        metavar="MODULE",
        help="import MODULE first (repeatable): it registers tasks, e.g. experiments.lipschitz "
        "from the root of a checkout",
    )


def _training(p: argparse.ArgumentParser, c: str) -> None:
    _common(p)
    p.add_argument(
        "--tasks", nargs="+", default=None, help="registered tasks" + _default(c, "tasks")
    )
    p.add_argument(
        "--strategies", nargs="+", default=None, help="METHOD+OPTIMIZER" + _default(c, "strategies")
    )
    p.add_argument("--dtype", dest="dtypes", nargs="+", default=None, help=_default(c, "dtypes"))
    p.add_argument("--seeds", type=int, default=None, help="seeds 0, 1, …" + _default(c, "seeds"))
    p.add_argument("--steps", type=int, default=None, help=_default(c, "steps"))
    p.add_argument("--record-every", type=int, default=None, help=_default(c, "record_every"))
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate of strategies that name none (default: the optimizer's declared one)",
    )
    p.add_argument(
        "--task-option",
        dest="task_options",
        type=_task_option,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a task option (repeatable), for the tasks that take it; see the list below",
    )
    p.add_argument("--n", type=int, default=None, help="task option n (matrix / hidden size)")
    p.add_argument("--m", type=int, default=None, help="task option m (columns)")
    p.add_argument("--T", type=int, default=None, help="task option T (sequence length)")
    p.add_argument("--batch", type=int, default=None, help="task option batch")
    p.add_argument("--permute", action="store_true", default=None, help="task option permute")
    p.add_argument("--others", default=None, help="optimizer of the unconstrained weights")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: 1)")


def _epilog() -> str:
    maps = ", ".join(parametrizations.available())
    opts = ", ".join(optimizers.available())
    lines = [
        f"methods: {maps}, and those a task builds itself (listed under the task)",
        f"optimizers: {opts}",
        "tasks:",
    ]
    for t in tasks.available():
        cls = tasks.get(t)
        o = ", ".join(f"{k}={v!r}" for k, v in tasks.options(t).items())
        lines.append(f"  {t} ({cls.kind}): {o}")
        if cls.extra_methods:
            own = "; ".join(f"{m}: {what}" for m, what in cls.extra_methods.items())
            lines.append(f"    its methods: {own}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The argument parser (help texts list what the registries hold)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="stiefel-compare", description=DESCRIPTION, epilog=_epilog(), formatter_class=fmt
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("drift", "‖XᴴX − I‖_F against step"),
        ("convergence", "loss against step and wall time"),
    ):
        _training(sub.add_parser(name, help=text, epilog=_epilog(), formatter_class=fmt), name)
    c = sub.add_parser("complexity", help="time and memory against size", formatter_class=fmt)
    _common(c)
    c.add_argument(
        "--sizes", type=int, nargs="+", default=None, help=_default("complexity", "sizes")
    )
    c.add_argument("--fractions", type=float, nargs="+", default=None, help="L / n")
    c.add_argument("--repeats", type=int, default=None, help=_default("complexity", "repeats"))
    c.add_argument(
        "--shapes", type=_shape, nargs="+", default=None, help="St(N, M) shapes as NxM (4096x64)"
    )
    _common(sub.add_parser("report", help="gather the results in --out into report.md"))
    _common(sub.add_parser("quick", help="a small run of everything and the report"))
    return p


def _flags(args: argparse.Namespace) -> dict:
    skip = {"command", "config", "threads", "resume", "overwrite"}
    flags = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    if "task_options" in flags:
        flags["task_options"] = dict(flags["task_options"])
    return flags


def main(argv: list[str] | None = None) -> int:
    """Run the harness; raises ValueError/TypeError/OSError on bad options (before training)."""
    _quiet_dependencies()
    args = parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    quick = args.command == "quick"
    names = list(SECTIONS) if quick else [args.command] if args.command in SECTIONS else []
    flags = _flags(args)
    opts = {s: config.resolve(s, flags, args.config, quick) for s in names}  # all checks first
    only = {k: flags.get(k) for k in ("out", "imports")}
    out = config.resolve("report", only, args.config)["out"]
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with RunStore(out, resume=args.resume, overwrite=args.overwrite) as store:
            for s in names:
                print(f"== {s}", flush=True)
                SECTIONS[s](store, opts[s])
            path = write_report(store)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote {out / path} in {time.perf_counter() - t0:.0f} s")
    return 0


def run(argv: list[str] | None = None) -> int:
    """The console script: ``main`` with errors printed as one line (exit 2, 130 on Ctrl-C)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted: finished runs are stored; continue with --resume", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, OutputLocked) as exc:
        print(f"stiefel-compare: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
