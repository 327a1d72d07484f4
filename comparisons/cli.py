"""Command line of the comparison harness: ``python -m stiefel.comparisons`` / ``stiefel-compare``.

Argument parsing only: options are checked in `stiefel.comparisons.config`, runs stored by
`stiefel.comparisons.store`, sections live in `stiefel.comparisons.sections`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time
import warnings

import torch

from .. import optimizers, parametrizations
from . import config, cost, tasks
from .grid import plan
from .report import no_results, write_report
from .sections import SECTIONS
from .store import DAMAGED, MANIFEST, OutputLocked, RunStore
from .strategies import literal

__all__ = ["main", "run"]

DESCRIPTION = """\
Compare orthogonality strategies: a map (or riemannian) plus an optimizer, e.g. cwy+adam.

subcommands: drift, convergence, complexity, report, and quick (a smoke run of
all three plus the report; its duration is measured in docs/results.md). Options come, later
winning, from the defaults, a TOML file (--config: top-level keys, then the
table named after the subcommand, [quick] under quick), then the flags.
Results go to --out: one JSON per run as it finishes, manifest.json, the long
table results.jsonl, report.md.
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
    return key.strip(), literal(value.strip())


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


#: (flag, keywords of add_argument, default-key) of every subcommand's options; a
#: default-key names the option whose configs/defaults.toml value the help shows
COMMON = [
    ("--out", dict(type=pathlib.Path, help="results folder (default: results)"), None),
    ("--device", dict(help="cpu or cuda (default: cpu)"), None),
    ("--config", dict(type=pathlib.Path, help="a TOML file of options"), None),
    ("--threads", dict(type=int, help="torch CPU threads per worker (default: 1)"), None),
    ("--resume", dict(action="store_true", help="continue the runs in --out"), None),
    ("--overwrite", dict(action="store_true", help="replace this subcommand's results"), None),
    ("--import", dict(dest="imports", action="append", metavar="MODULE", help="import MODULE "
     "first (repeatable): it registers tasks, e.g. experiments.lipschitz from a checkout"), None),
    ("--trust-config", dict(action="store_true", help="let --config import any module "
                            "(default: only the checkout's experiments.*)"), None),
]  # fmt: skip
TRAINING = [
    ("--tasks", dict(nargs="+", help="registered tasks"), "tasks"),
    ("--strategies", dict(nargs="+", help="METHOD+OPTIMIZER"), "strategies"),
    ("--dtype", dict(dest="dtypes", nargs="+", help=""), "dtypes"),
    ("--seeds", dict(type=int, help="seeds 0, 1, …"), "seeds"),
    ("--steps", dict(type=int, help=""), "steps"),
    ("--record-every", dict(type=int, help=""), "record_every"),
    ("--lr", dict(type=float, help="lr of the strategies that name none, on every task "
     "(default: the optimizer's lr on the task in configs/learning_rates.toml, else its "
     "declared one)"), None),
    ("--task-option", dict(dest="task_options", type=_task_option, action="append", metavar=
     "KEY=VALUE", help="a task option (repeatable), for the tasks that take it; see below"), None),
    *[(f"--{k}", dict(type=int, help=f"task option {k}{what}"), None) for k, what in
      (("n", " (matrix / hidden size)"), ("m", " (columns)"), ("T", " (sequence length)"),
       ("batch", ""))],
    ("--permute", dict(action="store_true", help="task option permute"), None),
    ("--others", dict(help="optimizer of the unconstrained weights"), None),
    ("--jobs", dict(type=int, help="worker processes (default: one per core)"), None),
]  # fmt: skip
COMPLEXITY = [
    ("--sizes", dict(type=int, nargs="+", help=""), "sizes"),
    ("--fractions", dict(type=float, nargs="+", help="L / n"), None),
    ("--repeats", dict(type=int, help=""), "repeats"),
    ("--shapes", dict(type=_shape, nargs="+", help="St(N, M) shapes as NxM (4096x64)"), None),
    ("--methods", dict(nargs="+", help="the maps measured (default: all)"), None),
    ("--optimizers", dict(nargs="+", help="the optimizers whose steps are measured, geoopt "
                          "for its anchors (default: all Riemannian ones)"), None),
]  # fmt: skip


def _add(p: argparse.ArgumentParser, command: str, options: list) -> argparse.ArgumentParser:
    for flag, kw, key in [*COMMON, *options]:
        help_text = kw["help"] + (_default(command, key) if key else "")
        p.add_argument(flag, **{"default": None, **kw, "help": help_text})
    return p


def _epilog(command: str | None = None) -> str:
    """The registries' lists; a task's options with the values ``command`` runs it with
    (its section of configs/defaults.toml over the task's own defaults)."""
    configured = config.preset("defaults").get(command, {}).get("task_options") or {}
    maps = ", ".join(parametrizations.available())
    opts = ", ".join(optimizers.available())
    lines = [
        f"methods: {maps}, and those a task builds itself (listed under the task)",
        f"optimizers: {opts}",
        "tasks:",
    ]
    for t in tasks.available():
        cls = tasks.get(t)
        lines.append(f"  {t} ({cls.kind}): {config.task_option_values(t, configured)}")
        if cls.extra_methods:
            own = "; ".join(f"{m}: {what}" for m, what in cls.extra_methods.items())
            lines.append(f"    its methods: {own}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, as the harness's own (usage: --help)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    """The argument parser (help texts list what the registries hold)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="stiefel-compare", description=DESCRIPTION, epilog=_epilog(), formatter_class=fmt
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, text, options in (
        ("drift", "‖XᴴX − I‖_F against step", TRAINING),
        ("convergence", "loss against step and wall time", TRAINING),
        ("complexity", "time and memory against size", COMPLEXITY),
        ("report", "gather the results in --out into report.md", []),
        ("quick", "a small run of everything and the report", []),
    ):
        epilog = _epilog(name) if options is TRAINING else None
        _add(sub.add_parser(name, help=text, epilog=epilog, formatter_class=fmt), name, options)
    return p


def _flags(args: argparse.Namespace) -> dict:
    skip = {"command", "config", "threads", "resume", "overwrite", "trust_config"}
    flags = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    return {k: dict(v) if k == "task_options" else v for k, v in flags.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the harness; raises ValueError/TypeError/OSError on bad options (before training)."""
    _quiet_dependencies()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:  # --help lists the tasks the --import modules add
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--import", dest="imports", action="append", default=[])
        tasks.import_modules(pre.parse_known_args(argv)[0].imports)
    args = parser().parse_args(argv)
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite together; allowed: one of them")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads}; allowed: an integer >= 1")
    threads, shown = torch.get_num_threads(), warnings.formatwarning
    torch.set_num_threads(args.threads or 1)  # Note [Trusted times]: work on one thread
    warnings.formatwarning = _one_line  # a note to the user, not a source line
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)
        warnings.formatwarning = shown


def _one_line(message, category, *_: object, **__: object) -> str:
    return f"{category.__name__}: {message}\n"


def _load_note(jobs: int) -> None:
    """Say when the machine is busier than its cores before a section that takes times."""
    m = cost.machine()
    if m["load"] > m["cores"]:
        if m["threads"] > 1:
            fix = "run with --threads 1"
        else:
            fix = "use fewer --jobs, or a quiet machine" if jobs > 1 else "use a quiet machine"
        print(f"note: load average {m['load']:g} is above the {m['cores']} cores: times that "
              f"waited for a core or spread are flagged; {fix}", flush=True)  # fmt: skip


def _main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    quick = args.command == "quick"
    names = list(SECTIONS) if quick else [args.command] if args.command in SECTIONS else []
    flags = _flags(args)
    trust = args.trust_config
    opts = {s: config.resolve(s, flags, args.config, quick, trust) for s in names}  # checks first
    for s in (s for s in names if "tasks" in opts[s]):  # built once before any section trains
        plan(opts[s], build=True)
    only = {k: flags.get(k) for k in ("out", "imports")}
    out = config.resolve("report", only, args.config, trust=trust)["out"]
    held = [pathlib.Path(out, name) for name in (MANIFEST, DAMAGED)]
    if not names and not any(p.is_file() for p in held):  # a report writes nothing there
        raise no_results(out)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with RunStore(out, resume=args.resume, overwrite=args.overwrite) as store:
            if names:  # the report titles a smoke run as such
                store.manifest["preset"] = "quick" if quick else None
            for s in names:
                print(f"== {s}", flush=True)
                _load_note(opts[s].get("jobs", 1))
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
