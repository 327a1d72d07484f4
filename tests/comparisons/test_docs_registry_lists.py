"""The lists of methods and optimizers on the docs pages are the registries' own.

A page either writes a ``<!-- registry:... -->`` marker (the mkdocs hook in
``docs/_hooks/registry.py`` puts the generated table there) or, where it prints
``optimizers.available()`` / ``parametrizations.available()``, shows the list
that call returns now, compared here with the registry.
"""

import ast
import pathlib
import re

import pytest

from stiefel import optimizers, parametrizations

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
CALL = re.compile(r"(optimizers|parametrizations)\.available\(\)\)\s*\n\s*#\s*(\[.*\])")
#: a page whose printed list predates registered optimizers; its owner replaces the list
#: by the call's output (or a registry marker), and this mark goes
STALE: dict[str, str] = {}


def printed_lists(text: str) -> list[tuple[str, list[str]]]:
    """(registry, the list shown as the output of its ``available()``) on a page."""
    return [(m.group(1), ast.literal_eval(m.group(2))) for m in CALL.finditer(text)]


def test_the_finder_reads_a_printed_list():
    text = "print(optimizers.available())\n# ['adam', 'rgd']\n"
    assert printed_lists(text) == [("optimizers", ["adam", "rgd"])]


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=STALE[rel]))
        if (rel := str(p.relative_to(ROOT))) in STALE
        else p
        for p in PAGES
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_printed_registry_lists_match_the_registry(page):
    registry = {
        "optimizers": optimizers.available(),
        "parametrizations": parametrizations.available(),
    }
    for name, shown in printed_lists(page.read_text()):
        assert shown == registry[name], (name, shown)


def test_the_comparisons_page_takes_its_tables_from_the_registry():
    text = (ROOT / "docs" / "comparisons.md").read_text()
    for table in ("methods", "optimizers", "tasks"):
        assert f"<!-- registry:{table} -->" in text
    hook = (ROOT / "docs" / "_hooks" / "registry.py").read_text()
    assert all(f'"{t}": _{t}' in hook for t in ("methods", "optimizers", "tasks"))
