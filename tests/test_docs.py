"""Every ```python block of the README and of docs/ runs (Clarifications: docs examples)."""

import doctest
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for page in PAGES:
        for i, code in enumerate(BLOCK.findall(page.read_text())):
            yield pytest.param(code, id=f"{page.relative_to(ROOT)}-{i}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_markdown_python_block_runs(code):
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})


MODULES = ["stiefel.manifolds.kernels", "stiefel.manifolds.stiefel"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
