"""The documentation cannot rot (a documentation example is a test).

- Every ```python block of the README and of docs/**/*.md runs. The blocks of
  one page share a namespace, in page order, like the cells of a notebook: a
  block may use the names defined by the blocks above it. Blocks that must not
  run are fenced ```text (or ```toml, ```bash, ...).
- The fenced ```python examples of every docstring of the package run.
- ``mkdocs build --strict`` succeeds (the site of the ``docs`` extra).
"""

import ast
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
#: a fenced block inside a docstring, indented as a whole (e.g. under "Example:")
INDENTED_BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.S | re.M)
SLOW_BLOCK_S = 20.0  # a docs example is meant to take well under 2 s; this catches runaways


def _page_blocks(page: pathlib.Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def _blocks():
    for page in PAGES:
        for i, _ in enumerate(_page_blocks(page)):
            yield pytest.param(page, i, id=f"{page.relative_to(ROOT)}-{i}")


class _PageRun:
    """The shared namespace of one page and how many of its blocks have run."""

    def __init__(self, page: pathlib.Path):
        self.page = page
        self.blocks = _page_blocks(page)
        self.namespace: dict = {"__name__": "__docs__"}
        self.done = 0
        self.failed: int | None = None

    def run_through(self, index: int) -> float:
        """Run blocks done..index (so that a block sees the names of those above it)."""
        elapsed = 0.0
        while self.done <= index:
            i = self.done
            if self.failed is not None:
                pytest.fail(
                    f"block {self.failed} of {self.page.relative_to(ROOT)} failed, "
                    f"so block {i}, which may use its names, cannot run"
                )
            code = compile(self.blocks[i], f"<{self.page.relative_to(ROOT)} block {i}>", "exec")
            t0 = time.perf_counter()
            try:
                exec(code, self.namespace)
            except BaseException:
                self.failed = i
                raise
            finally:
                self.done = i + 1
            elapsed = time.perf_counter() - t0
        return elapsed


_RUNS: dict[pathlib.Path, _PageRun] = {}


@pytest.fixture(scope="module", autouse=True)
def _restore_registries():
    """Docs examples register optimizers and maps; undo that for the rest of the session."""
    from stiefel.optimizers import registry
    from stiefel.parametrizations import base

    saved = registry.OPTIMIZERS.snapshot(), base.MAPS.snapshot()
    yield
    registry.OPTIMIZERS.restore(saved[0])
    base.MAPS.restore(saved[1])
    _RUNS.clear()


@pytest.mark.parametrize(("page", "index"), list(_blocks()))
def test_markdown_python_block_runs(page, index):
    run = _RUNS.get(page)
    if run is None or run.done > index:  # first use, or re-run out of order: start afresh
        run = _RUNS[page] = _PageRun(page)
    elapsed = run.run_through(index)
    assert elapsed < SLOW_BLOCK_S, (
        f"block {index} of {page.relative_to(ROOT)} took {elapsed:.1f} s; docs examples "
        "must be quick (use small sizes)"
    )


def test_every_fence_is_closed_and_python_blocks_are_found():
    """A ```python fence the regex misses (e.g. ```py or an unclosed one) would never run."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = re.findall(r"^```", text, re.M)
        assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)} has an unclosed ``` fence"
        opened = re.findall(r"^```(py|python3|pycon)\s*$", text, re.M)
        assert not opened, (
            f"{page.relative_to(ROOT)} fences code as ```{opened[0]}: use ```python "
            "(executed by this test) or ```text (not executed)"
        )


def _package_files() -> list[pathlib.Path]:
    """Every .py file of the installed package, from pyproject's package list (no hand list)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    files = []
    for pkg in cfg["packages"]:
        folder = ROOT.joinpath(*pkg.split(".")[1:])
        files += sorted(folder.glob("*.py"))
    return files


def _docstrings():
    """(file, qualified name, docstring) of every module, class and function of the package."""
    for path in _package_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            name = prefix or "<module>"
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield path, name, doc
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    stack.append((child, f"{prefix}.{child.name}" if prefix else child.name))


def _docstring_cases():
    for path, name, doc in _docstrings():
        blocks = [textwrap.dedent(b) for _, b in INDENTED_BLOCK.findall(doc + "\n")]
        if blocks:
            rel = path.relative_to(ROOT)
            yield pytest.param(rel, name, blocks, id=f"{rel}::{name}")


@pytest.mark.parametrize(("path", "name", "blocks"), list(_docstring_cases()))
def test_docstring_examples(path, name, blocks):
    """The fenced ```python examples of a docstring run, in order, in one namespace."""
    namespace: dict = {"__name__": "__docstring__"}
    for i, block in enumerate(blocks):
        t0 = time.perf_counter()
        exec(compile(block, f"<{path}::{name} block {i}>", "exec"), namespace)
        elapsed = time.perf_counter() - t0
        assert elapsed < SLOW_BLOCK_S, f"{path}::{name} block {i} took {elapsed:.1f} s"


def test_docstring_examples_are_found():
    """The collection above sees the examples (a broken regex would pass vacuously)."""
    assert len(list(_docstring_cases())) >= 20


RST = re.compile(r"(:(func|class|meth|mod|attr|data|exc):`|^\s*>>> |Example::|Examples::)", re.M)


def test_docstrings_use_one_markdown_style():
    """Docstrings are Google style with fenced examples, which mkdocstrings renders.

    reST roles (``:func:`x` ``), ``Example::`` blocks and ``>>>`` doctest prompts are
    shown literally on the site, so none may appear in a docstring of the package.
    """
    bad = [
        f"{path.relative_to(ROOT)}::{name}: {RST.search(doc).group(0).strip()!r}"
        for path, name, doc in _docstrings()
        if RST.search(doc)
    ]
    assert not bad, "reST-style docstrings (use Google style, ```python examples):\n" + "\n".join(
        bad
    )


DOCS_MODULES = ["mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx"]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    """``mkdocs build --strict`` passes: no broken link, no griffe docstring warning.

    It needs the ``docs`` extra. Without it the test is skipped, with the reason
    printed, on a developer machine; where the environment variable ``CI`` is set
    (or ``STIEFEL_DOCS_REQUIRED``), a missing extra is a failure, not a skip.
    """
    missing = [m for m in DOCS_MODULES if not _importable(m)]
    if missing:
        msg = (
            f"the docs extra is not installed (missing {', '.join(missing)}); "
            'pip install -e ".[docs]"'
        )
        if os.environ.get("CI") or os.environ.get("STIEFEL_DOCS_REQUIRED"):
            pytest.fail(msg)
        pytest.skip(msg)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").exists()
    for page in ("getting-started", "concepts", "methods/cwy", "plugins", "results", "api/kernels"):
        assert (site / page / "index.html").exists(), f"page {page} was not built"
    _check_site_has_no_rest(site)
    _check_public_api_is_documented(site)


def _check_site_has_no_rest(site: pathlib.Path) -> None:
    """reST markup rendered literally (``:func:``, ``:class:``, ``Example::``) is a docs bug."""
    literal = re.compile(r":func:|:class:|Example::")
    bad = [
        f"{f.relative_to(site)}: {literal.search(f.read_text(errors='replace')).group(0)}"
        for f in sorted(site.rglob("*.html"))
        if literal.search(f.read_text(errors="replace"))
    ]
    assert not bad, "the built site shows reST markup literally:\n" + "\n".join(bad)


def _public_namespaces() -> list[str]:
    """``stiefel`` and the subpackages it exports: their ``__all__`` is the public API."""
    import inspect

    import stiefel

    subs = [n for n in stiefel.__all__ if inspect.ismodule(getattr(stiefel, n, None))]
    return ["stiefel", *(f"stiefel.{n}" for n in subs)]


def _check_public_api_is_documented(site: pathlib.Path) -> None:
    """Every public class and function (``__all__``) has an entry in the API reference."""
    import inspect

    html = "\n".join(f.read_text(errors="replace") for f in (site / "api").rglob("*.html"))
    ids = set(re.findall(r'id="([\w.]+)"', html))
    missing = []
    for name in _public_namespaces():
        mod = importlib.import_module(name)
        for attr in getattr(mod, "__all__", []):
            obj = getattr(mod, attr)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if f"{name}.{attr}" not in ids:
                missing.append(f"{name}.{attr}")
    assert not missing, "public names missing from the API reference: " + ", ".join(missing)
