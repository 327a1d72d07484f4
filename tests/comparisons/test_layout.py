"""The harness's size and import floors: comparisons/ stays small and flat, with no circle.

A floor is a module's height in the import graph of ``comparisons/``: a module
importing no other harness module is on floor 1, any other one floor above the
highest it imports. Edges are the static imports (``from .x import y``,
``from . import x``, ``import stiefel.comparisons.x``, also inside functions);
``from .x import y`` where ``x.y`` is a module counts as an import of ``x.y``.
The package's own ``__init__`` (which registers the generic tasks) is a module
like the others.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "comparisons"
#: lines of the harness's machinery (comparisons/ but its tasks); 10 more for the report's
#: gaps within rounding on either side and the runs that left their optimum; 146 more so
#: that a run off the manifold is never counted or drawn as converged, every strategy of
#: every section is built before any training (optimizer options named when refused),
#: duplicates are refused, and resume ignores where --out is and how many --jobs; 11
#: more for the distance at which an optimizer near the manifold by design counts on it; 4
#: for `grid.plan`'s ``build``: the CLI builds the maps and optimizers once, a section not again;
#: 13 for refusing a map with an optimizer that steps plain matrices as points (runner);
#: 62 for a report that cannot be misread: the figures' geometric mean beside the tables' mean,
#: each step formula and geoopt manifold once as a note, saved vs peak memory defined, legends
#: naming every line style, no lr said twice (tests/comparisons/test_report_clarity.py); 5
#: so that --help lists the tasks the --import modules register; 13 for parameter counts
#: written whole (141,268, not 1.41e+05), one name of the baseline in tables and figures and
#: a smoke report that claims only what its tables show; 14 for `__all__` naming the time cell
#: and flag note the experiments' parts share, and a note that rates are fastest runs, times
#: medians; 7 for argparse's errors on one line, as the harness's own; 3 for no gap column
#: where a task has no optimum; 12 for a report of a damaged manifest that says how to rebuild
#: it, and warnings printed as one-line notes during a run; 19 for workers that end with a
#: harness killed by SIGKILL (they had waited for work forever), watched from their start;
#: 17 for a resume that measures nothing keeping the machine of the run that measured, each
#: command's help showing the task options it runs with, and a load note that suggests fewer
#: jobs only where there are several; 7 for a report of a folder without results that
#: writes nothing there;
#: 1 for progress lines that name the unit they count; 1 for the optimizer figure's M; 3 for
#: the machine of a section's stored runs kept through resumes that fail or are interrupted;
#: 2 for a machine line whose end load was not recorded; 1 for the damaged manifest's
#: name kept once (`store.DAMAGED`), where three modules spelled it; 16 for a drift maximum
#: over every step (records in step with a correction cycle missed its peaks); 6 for a
#: missing matplotlib named with the extra that installs it; 14 for a device refused
#: with the other options when the machine lacks it (it failed mid-run)
CAP = 3537
PACKAGE = "stiefel.comparisons"


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(HARNESS).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def import_graph() -> dict[str, set[str]]:
    """Module → the harness modules it imports (statically)."""
    files = {_name(p): p for p in HARNESS.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs or ([base] if base in files else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in files]
            graph[mod] |= {t for t in targets if t != mod}
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor; AssertionError naming the circle when there is one."""
    out: dict[str, int] = {}

    def visit(m: str, path: tuple[str, ...]) -> int:
        assert m not in path, f"import circle: {' → '.join((*path[path.index(m) :], m))}"
        if m not in out:
            out[m] = 1 + max((visit(d, (*path, m)) for d in graph[m]), default=0)
        return out[m]

    for m in graph:
        visit(m, ())
    return out


def test_the_harness_is_small_and_flat():
    # the machinery, not its tasks: a new task is a file of comparisons/tasks/ and leaves
    # this cap alone (docs/contributing.md, "Add a harness task")
    tasks = HARNESS / "tasks"
    files = [p for p in HARNESS.rglob("*.py") if not p.is_relative_to(tasks)]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    # the cap follows the timed blocks and interleaved rounds (Note [Timed blocks] in
    # comparisons/cost.py), which ratios measured on a busy machine need
    assert lines <= CAP, lines
    height = floors(import_graph())
    assert max(height.values()) <= 6, sorted(height.items(), key=lambda kv: -kv[1])


def test_floor_counting_sees_a_circle_and_a_chain():
    assert floors({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    try:
        floors({"a": {"b"}, "b": {"a"}})
    except AssertionError as exc:
        assert "a → b → a" in str(exc)
    else:
        raise AssertionError("a circle was not seen")


def test_nothing_in_the_package_imports_experiments_or_benchmarks():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("experiments", "benchmarks", "tests", "docs", "build"):
            continue
        if any(part.startswith(".") for part in rel.parts):  # .venv-ci, .git: not the package
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad = [n for n in names if n.split(".")[0] in ("experiments", "benchmarks")]
            assert not bad, (rel, bad)
