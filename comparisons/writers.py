"""One writer per format: text, JSON, markdown tables, PNG/SVG figures and progress on stderr.

Every file is written atomically (a temporary file in the same folder, then
``os.replace``), so an interrupted run never leaves half a file, and a
symbolic link at the destination is replaced, never written through; it gets
the permissions the umask gives a file ``open`` creates (0666 less the umask).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

__all__ = ["write_text", "write_json", "md_table", "fmt", "save_figure", "Progress"]


def write_text(path: str | pathlib.Path, text: str | bytes) -> pathlib.Path:
    """Write ``text`` to ``path`` atomically (temporary file + rename); parent folders created."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.umask(mask := os.umask(0o022))  # read by setting it back: there is no getter
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp's 0600 is for secrets; results are shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | pathlib.Path, obj: Any) -> pathlib.Path:
    """``obj`` as indented JSON (values JSON does not know are written with ``str``)."""
    return write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def fmt(v: Any) -> str:
    """A table cell: None as '–', floats with 4 significant digits (scientific when far from 1).

    From 1,000 to below a million a float is written to the unit, with thousands
    separators (a parameter count stored as a float: 141,268, not 1.41e+05), so
    that one column never mixes the two notations in that range.
    """
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if 1e3 <= abs(v) < 1e6:
            return f"{round(v):,}"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.2e}"
        return f"{v:.4g}"
    return str(v)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; cells go through `fmt` (strings are kept as they are).

    Example:
        ```python
        from stiefel.comparisons.writers import md_table

        assert md_table(["a", "b"], [[1, 0.5]]) == "| a | b |\\n|---|---|\\n| 1 | 0.5 |\\n"
        ```
    """
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_figure(fig, out: pathlib.Path, stem: str) -> list[str]:
    """Save ``fig`` as ``stem.png`` and ``stem.svg`` in ``out`` (atomically); return the names."""
    import matplotlib.pyplot as plt

    names = []
    for ext in ("png", "svg"):
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=110, bbox_inches="tight")
        write_text(pathlib.Path(out) / f"{stem}.{ext}", buf.getvalue())
        names.append(f"{stem}.{ext}")
    plt.close(fig)
    return names


class Progress:
    """Progress of a long section on stderr: a tqdm bar with ETA on a terminal, elsewhere (a log,
    a pipe, no tqdm) one line per finished unit with its ETA (time so far × left / done)."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.done, self.t0 = total, desc, 0, time.perf_counter()
        self.unit = unit  # what is counted ("steps", "measurements")
        tqdm = importlib.util.find_spec("tqdm") and importlib.import_module("tqdm").tqdm
        tty = tqdm and sys.stderr.isatty()  # tqdm (the compare extra's) writes to stderr
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False) if tty else None

    def update(self, n: int = 1) -> None:
        """``n`` more units done: the bar moves."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def finished(self, what: str, n: int = 0) -> None:
        """``what`` finished (and ``n`` more units): the bar's note, or a line with the ETA."""
        self.update(n)
        eta = (time.perf_counter() - self.t0) * (self.total - self.done) / max(self.done, 1)
        line = f"{self.desc}: {self.done}/{self.total} {self.unit}, {what} done, ETA {eta:.0f} s"
        _ = self.bar.set_postfix_str(f"{what} done") if self.bar else print(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
