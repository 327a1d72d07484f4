"""Reading the markdown tables the harness writes, for the tests that check its reports."""

from __future__ import annotations


def table_row(md: str, header: str, row: str) -> dict[str, str]:
    """The cells of the markdown row starting with ``row``, keyed by the table's header."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = [c.strip() for c in lines[start].strip("|").split("|")]
    line = next(line for line in lines[start:] if line.startswith(row))
    return dict(zip(names, [c.strip() for c in line.strip("|").split("|")], strict=True))
