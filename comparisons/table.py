"""The long results table: every stored run as rows of (section, task, strategy, dtype, seed,
step, metric, value), written as JSON lines (``results.jsonl``) beside the manifest.

Note [One long table]
A training run gives one row per recorded step of each series (``loss``,
``time`` on the wall clock, ``drift``, ``cpu_time`` on the thread CPU clock)
and one row per final value at its last step (``final_loss``, ``gap``,
``failed``, ``lr``, …; nested values such as the held-out metrics as
``metrics.test_accuracy``). A complexity part gives one row per measured
number: ``task`` is the part (``maps``, ``steps``, …), ``strategy`` the row's
label (its first text column: the series of the maps and steps, e.g. ``cwy
L=0.25n``, the layer of the convolutions), ``step`` its size (its first integer
column). The report's tables and figures show the same stored runs.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

__all__ = ["COLUMNS", "SERIES", "run_rows", "dumps", "read"]

COLUMNS = ("section", "task", "strategy", "dtype", "seed", "step", "metric", "value")
#: the series a training run records at each of its recorded steps
SERIES = ("loss", "time", "drift", "cpu_time")


def _flat(values: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def run_rows(section: str, key: dict, record: dict) -> list[dict]:
    """The rows of one stored run (Note [One long table]); ``key`` is its store key.

    Example:
        ```python
        from stiefel.comparisons.table import run_rows

        key = {"task": "t", "strategy": "cwy+adam", "dtype": "float64", "seed": 0}
        rec = {"step": [0, 9], "loss": [2.0, 1.0], "time": [0.1, 1.0], "drift": [0, 0], "lr": 0.1}
        rows = run_rows("drift", key, {**key, **rec})
        assert rows[1] == {**key, "section": "drift", "step": 9, "metric": "loss", "value": 1.0}
        assert rows[-1]["metric"] == "lr" and rows[-1]["step"] == 9
        ```
    """
    base = dict(section=section, task=key.get("task", key.get("part")), strategy=None)
    base.update(strategy=key.get("strategy"), dtype=key.get("dtype"), seed=key.get("seed"))
    if "value" in record:  # a complexity part: a number, or the rows of a table
        value = record["value"]
        if not isinstance(value, list):
            return [dict(base, step=None, metric=base["task"], value=value)]
        return [row for r in value for row in _measured(base, r)]
    rows = [
        dict(base, step=s, metric=m, value=v)
        for m in SERIES
        if m in record  # records stored before the CPU clock have no cpu_time
        for s, v in zip(record["step"], record[m], strict=True)
    ]
    last = record["step"][-1] if record["step"] else None
    final = {k: v for k, v in record.items() if k not in (*SERIES, "step", *key)}
    return rows + [dict(base, step=last, metric=k, value=v) for k, v in _flat(final).items()]


def _measured(base: dict, row: dict) -> list[dict]:
    label = next((k for k, v in row.items() if isinstance(v, str)), None)
    size = next((k for k, v in row.items() if type(v) is int), None)
    rest = {k: v for k, v in row.items() if k not in (label, size)}
    ident = dict(strategy=row.get(label), step=row.get(size))
    return [dict(base, **ident, metric=k, value=v) for k, v in rest.items()]


def dumps(rows: list[dict]) -> str:
    """JSON lines of ``rows``, the columns in `COLUMNS` order."""
    return "".join(json.dumps({c: r.get(c) for c in COLUMNS}, default=str) + "\n" for r in rows)


def read(out: str | pathlib.Path, **where: Any) -> list[dict]:
    """The rows of ``out/results.jsonl`` whose columns equal ``where`` (all rows without);
    a damaged line is skipped with a warning naming the file and the line."""
    path = pathlib.Path(out, "results.jsonl")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            rows.append(dict(json.loads(line)))
        except (TypeError, ValueError) as exc:  # a damaged line is named, never fatal
            warnings.warn(f"skipping the damaged line {i} of {path} ({exc})", stacklevel=2)
    return [r for r in rows if all(r[k] == v for k, v in where.items())]
