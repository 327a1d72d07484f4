"""The fenced examples of the stiefel.nn and conv-kernel docstrings run (indented ones too)."""

import ast
import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "nn").glob("*.py")) + [ROOT / "parametrizations" / "conv.py"]
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.S | re.M)


def _examples():
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node, clean=True) or ""
                for i, (_, code) in enumerate(FENCE.findall(doc)):
                    name = getattr(node, "name", "<module>")
                    yield pytest.param(textwrap.dedent(code), id=f"{path.name}::{name}-{i}")


CASES = list(_examples())


def test_examples_are_found():
    assert len(CASES) >= 8


@pytest.mark.parametrize("code", CASES)
def test_docstring_example_runs(code):
    exec(compile(code, "<docstring>", "exec"), {"__name__": "__docstring__"})
