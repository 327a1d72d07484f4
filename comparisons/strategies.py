"""Strategies: a map (or ``riemannian``) plus an optimizer, named like ``cwy+adam``.

Grammar::

    strategy  := part "+" part
    part      := NAME [ "(" key "=" value { "," key "=" value } ")" ]

The first part is a parametrization method of :mod:`stiefel.parametrizations`
(``riemannian`` leaves the weight a manifold parameter) or ``lstm`` (the LSTM
baseline, sequence tasks only); the second is an optimizer name of
:mod:`stiefel.optimizers`. Values are parsed as Python literals where they can
be (``lr=1e-3``, ``betas=(0.9,0.99)``) and kept as strings otherwise
(``metric=canonical``).

Example::

    >>> s = parse("riemannian+rgd(metric=canonical,retraction=cayley)")
    >>> s.method, s.optimizer, s.optimizer_options
    ('riemannian', 'rgd', {'metric': 'canonical', 'retraction': 'cayley'})
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

__all__ = ["Strategy", "parse", "DEFAULT_LR"]

_PART = re.compile(r"^\s*([A-Za-z_][\w\-]*)\s*(?:\((.*)\))?\s*$")

#: learning rates used when a strategy names none (per optimizer; the Riemannian
#: optimizers move on the manifold, the Euclidean ones move the map's parameters)
DEFAULT_LR = {
    "sgd": 0.05,
    "adam": 1e-2,
    "adamw": 1e-2,
    "rmsprop": 1e-3,
    "adagrad": 0.1,
    "rgd": 0.05,
    "radam": 1e-2,
    "landing": 0.02,
    "geoopt_rsgd": 0.05,
    "geoopt_radam": 1e-2,
}


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy: map method and options, optimizer name and options."""

    name: str
    method: str
    optimizer: str
    method_options: dict = field(default_factory=dict)
    optimizer_options: dict = field(default_factory=dict)

    @property
    def is_baseline(self) -> bool:
        return self.method == "lstm"

    def lr(self) -> float:
        return float(self.optimizer_options.get("lr", DEFAULT_LR.get(self.optimizer, 1e-3)))


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _split_options(text: str, where: str) -> dict:
    out: dict = {}
    depth, start, items = 0, 0, []
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    for item in items:
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"{where}: option {item.strip()!r} must look like key=value")
        key, val = item.split("=", 1)
        out[key.strip()] = _value(val.strip())
    return out


def _part(text: str, where: str) -> tuple[str, dict]:
    m = _PART.match(text)
    if not m:
        raise ValueError(f"{where}: cannot parse {text!r}; expected NAME or NAME(key=value,...)")
    return m.group(1), _split_options(m.group(2) or "", where)


def _top_level_plus(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "+" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse(
    text: str, methods: list[str] | None = None, optimizers: list[str] | None = None
) -> Strategy:
    """Parse ``"method+optimizer"``; check the names against ``methods``/``optimizers``."""
    if not isinstance(text, str):
        raise TypeError(f"strategy must be a str like 'cwy+adam', got {type(text).__name__}")
    parts = _top_level_plus(text)
    if len(parts) != 2:
        raise ValueError(
            f"strategy {text!r} must be METHOD+OPTIMIZER, e.g. 'cwy+adam' or "
            "'riemannian+rgd(metric=canonical)'"
        )
    method, mopts = _part(parts[0], f"strategy {text!r}")
    opt, oopts = _part(parts[1], f"strategy {text!r}")
    if methods is not None and method not in methods:
        raise ValueError(
            f"strategy {text!r}: unknown method {method!r}; available: {', '.join(methods)}"
        )
    if optimizers is not None and opt not in optimizers:
        raise ValueError(
            f"strategy {text!r}: unknown optimizer {opt!r}; available: {', '.join(optimizers)}"
        )
    return Strategy(text.replace(" ", ""), method, opt, mopts, oopts)
