"""No package file over 450 lines and no class over 300: a module a reader takes in at once.

The package is split by idea (a map's forward, its first-use checks, its right
inverses; ``orthogonalize``'s entry point, its in-place registration, the
bare-tensor holder), so each file stays readable; this test names every file
and class past the limits, with its size, when one grows back. The tests,
benchmarks and experiments are not the package and are not counted.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 450
MAX_CLASS_LINES = 300
#: top-level folders that are not the package, and folders of tools and builds
NOT_PACKAGE = {"tests", "benchmarks", "experiments", "build", "dist", "site"}


def package_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The package's ``.py`` files under ``root`` (no tests, tools, builds or hidden folders)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in parts):
            continue
        if any(p.endswith(".egg-info") or p == "__pycache__" for p in parts):
            continue
        out.append(path)
    return out


def offenders(root: pathlib.Path) -> list[str]:
    """``"path: N lines"`` for each file over the limit, ``"path:Class: N lines"`` per class."""
    found = []
    for path in package_files(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{rel}: {lines} lines (file limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{rel}:{node.name}: {size} lines (class limit {MAX_CLASS_LINES})")
    return found


def test_no_package_file_or_class_is_too_long():
    assert len(package_files(ROOT)) > 50  # the walk found the package
    bad = offenders(ROOT)
    assert not bad, "split by idea (one idea per file, a module docstring):\n" + "\n".join(bad)


@pytest.mark.parametrize(("body", "file_lines", "expected"), [(298, 300, 0), (299, 301, 1)])
def test_the_limits_count_a_class_from_its_line_to_its_last(tmp_path, body, file_lines, expected):
    # a class of `class` + docstring + `body` lines: 300 lines is allowed, 301 is not
    src = "class Big:\n    '''doc'''\n" + "    x = 1\n" * body
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text(src)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "huge.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert len(src.splitlines()) == body + 2
    bad = offenders(tmp_path)
    assert len(bad) == expected, bad
    if expected:
        assert bad == [f"pkg/big.py:Big: {body + 2} lines (class limit {MAX_CLASS_LINES})"]
    long_file = "x = 1\n" * (MAX_FILE_LINES + 1)
    (tmp_path / "pkg" / "long.py").write_text(long_file)
    assert f"pkg/long.py: {MAX_FILE_LINES + 1} lines (file limit {MAX_FILE_LINES})" in offenders(
        tmp_path
    )
