"""Regenerate the CPU tables of docs/performance.md from the benchmark scripts.

Run ``python -m benchmarks.performance`` from a checkout. Each section below runs
one script of ``benchmarks/`` (its ``main(argv)``, in this process, on the CPU),
keeps its markdown output and writes it into the page between the section's two
marker comments::

    <!-- BEGIN benchmarks.performance maps -->
    ...replaced...
    <!-- END benchmarks.performance maps -->

Everything outside the markers is left as it is. A script's "Targets" blocks
(goals checked by its own tests) are left out of the page. ``--only maps,init``
runs a subset; ``--quick`` runs every script at tiny sizes (a smoke run: its
numbers mean nothing); ``--page PATH`` writes another file (created with the
sections' markers if it does not exist); ``--print`` prints the sections instead of
writing them.

Example:

```text
python -m benchmarks.performance                     # every CPU section, seconds
python -m benchmarks.performance --only maps,precision
python -m benchmarks.performance --quick --page /tmp/performance.md
```
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"


@dataclasses.dataclass(frozen=True)
class Section:
    """One benchmark script run and the argument lists of a full and of a quick run."""

    script: str
    argv: tuple[str, ...]
    quick: tuple[str, ...]


SECTIONS: dict[str, Section] = {
    "maps": Section(
        "maps",
        ("--sizes", "64,256", "--stiefel", "1024x64", "--rollout", "100,256", "--budget", "0.3"),
        ("--quick", "--sizes", "8", "--stiefel", "32x4", "--rollout", "3,16")
        + ("--repeats", "1", "--budget", "0"),
    ),
    "optimizers": Section(
        "optimizers",
        ("--shapes", "1024x64,256x256", "--budget", "0.3"),
        ("--quick", "--shapes", "16x2", "--repeats", "1", "--budget", "0"),
    ),
    "precision": Section(
        "precision",
        ("--n", "256", "--repeats", "3", "--budget", "0.3"),
        ("--quick", "--n", "8", "--repeats", "1", "--budget", "0"),
    ),
    "init": Section(
        "init",
        ("--sizes", "256,512"),
        ("--quick", "--sizes", "8", "--inits", "haar", "--threads", "1"),
    ),
}


def markers(name: str) -> tuple[str, str]:
    """The comment lines that open and close section ``name`` on the page."""
    return (
        f"<!-- BEGIN benchmarks.performance {name} -->",
        f"<!-- END benchmarks.performance {name} -->",
    )


def command(name: str, quick: bool = False) -> str:
    """The shell command that reruns section ``name`` alone."""
    section = SECTIONS[name]
    argv = section.quick if quick else section.argv
    return shlex.join(["python", "-m", f"benchmarks.{section.script}", *argv])


def keep(output: str) -> str:
    """A script's markdown output without its "Targets" blocks, blank lines squeezed."""
    blocks = [b.strip("\n") for b in re.split(r"\n\s*\n", output)]
    return "\n\n".join(b for b in blocks if b.strip() and not b.lstrip().startswith("Targets"))


def run(name: str, quick: bool = False) -> str:
    """Run section ``name``'s script; return the markdown to put between its markers."""
    section = SECTIONS[name]
    module = importlib.import_module(f".{section.script}", __package__)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = module.main(list(section.quick if quick else section.argv))
    output = returned if isinstance(returned, str) else printed.getvalue()
    return f"```text\n{command(name, quick)}\n```\n\n{keep(output)}"


def splice(page: str, name: str, body: str) -> str:
    """``page`` with the text between section ``name``'s markers replaced by ``body``.

    Raises:
        ValueError: if the page does not hold each marker exactly once, in order.
    """
    begin, end = markers(name)
    counts = page.count(begin), page.count(end)
    if counts != (1, 1) or page.index(begin) > page.index(end):
        raise ValueError(
            f"page must hold {begin!r} once, then {end!r} once; found them {counts[0]} and "
            f"{counts[1]} times"
        )
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def blank_page(names: list[str]) -> str:
    """A new page holding the markers of sections ``names``, in order, and nothing else."""
    return "\n\n".join("\n".join(markers(name)) for name in names) + "\n"


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Run the chosen sections and write them into the page; return {name: markdown}."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", default=None, help=f"sections, comma-separated: {','.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--page", type=pathlib.Path, default=PAGE, help="the page (docs/performance.md)")
    p.add_argument("--print", action="store_true", help="print the sections, write nothing")
    args = p.parse_args(argv)
    names = list(SECTIONS) if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        p.error(
            f"--only {args.only!r}: unknown section(s) {unknown}; allowed: {', '.join(SECTIONS)}"
        )
    page = None
    if not args.print:
        if args.page.is_dir() or not args.page.parent.is_dir():
            p.error(f"--page {str(args.page)!r}: allowed: a file in an existing folder")
        exists = args.page.exists()
        page = args.page.read_text(encoding="utf-8") if exists else blank_page(names)
        for name in names:  # every marker present before anything runs
            try:
                splice(page, name, "")
            except ValueError as err:
                p.error(f"--page {str(args.page)!r}: {err}")
    done = {}
    for name in names:
        done[name] = run(name, quick=args.quick)
        if page is None:
            print(done[name], end="\n\n")
        else:
            page = splice(page, name, done[name])
            args.page.write_text(page, encoding="utf-8")  # a section at a time: nothing lost
    return done


if __name__ == "__main__":
    main()
