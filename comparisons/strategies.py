"""Strategies: a map (or ``riemannian``) plus an optimizer, named like ``cwy+adam``.

Grammar: ``strategy := part "+" part``, ``part := NAME [ "(" key "=" value { "," key "="
value } ")" ]``. The first part is a parametrization method of `stiefel.parametrizations`
(``riemannian`` leaves the weight a manifold parameter) or a model a task
builds itself (``Task.extra_methods``: ``lstm`` on the sequence tasks,
``convlstm`` on ``moving_digits``, ``lora`` on ``finetune``, ...); the second
is an optimizer name of `stiefel.optimizers`. Values are parsed as Python
literals where they can be (``lr=1e-3``, ``betas=(0.9,0.99)``) and kept as
strings otherwise (``metric=canonical``).

Example:
    ```python
    from stiefel.comparisons.strategies import parse

    s = parse("riemannian+rgd(metric=canonical,retraction=cayley)")
    assert (s.method, s.optimizer) == ("riemannian", "rgd")
    assert s.optimizer_options == {"metric": "canonical", "retraction": "cayley"}
    ```

A strategy that names no ``lr`` gets the ``--lr`` of the run, else the optimizer's lr on
the task (`stiefel.comparisons.config.task_lr`), else its declared default learning rate
(`stiefel.optimizers.info`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

__all__ = ["Strategy", "parse", "literal"]

_PART = re.compile(r"^\s*([A-Za-z_][\w\-]*)\s*(?:\((.*)\))?\s*$")


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy: map method and options, optimizer name and options."""

    name: str
    method: str
    optimizer: str
    method_options: dict = field(default_factory=dict)
    optimizer_options: dict = field(default_factory=dict)

    def lr(self, default: float | None = None) -> float:
        """The strategy's ``lr``, else ``default``, else the optimizer's declared default."""
        if "lr" in self.optimizer_options:
            return float(self.optimizer_options["lr"])
        if default is not None:
            return float(default)
        from .. import optimizers

        return optimizers.info(self.optimizer).default_lr


def literal(text: str):
    """``text`` as a Python literal where it is one (``1e-3``, ``(0.9,0.99)``), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _part(text: str, where: str) -> tuple[str, dict]:
    m = _PART.match(text)
    if not m:
        raise ValueError(f"{where}: cannot parse {text!r}; expected NAME or NAME(key=value,...)")
    options = {}
    for item in filter(str.strip, _split(m.group(2) or "", ",")):
        if "=" not in item:
            raise ValueError(f"{where}: option {item.strip()!r} must look like key=value")
        key, val = item.split("=", 1)
        options[key.strip()] = literal(val.strip())
    return m.group(1), options


def parse(
    text: str, methods: list[str] | None = None, optimizers: list[str] | None = None
) -> Strategy:
    """Parse ``"method+optimizer"``; check the names against ``methods``/``optimizers``."""
    if not isinstance(text, str):
        raise TypeError(f"strategy must be a str like 'cwy+adam', got {type(text).__name__}")
    parts = _split(text, "+")
    if len(parts) != 2:
        raise ValueError(
            f"strategy {text!r} must be METHOD+OPTIMIZER, e.g. 'cwy+adam' or "
            "'riemannian+rgd(metric=canonical)'"
        )
    method, mopts = _part(parts[0], f"strategy {text!r}")
    opt, oopts = _part(parts[1], f"strategy {text!r}")
    for kind, name, known in (("method", method, methods), ("optimizer", opt, optimizers)):
        if known is not None and name not in known:
            raise ValueError(
                f"strategy {text!r}: unknown {kind} {name!r}; available: {', '.join(known)}"
            )
    lr = oopts.get("lr")
    if "lr" in oopts and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0):
        raise ValueError(
            f"strategy {text!r}: optimizer {opt!r} option lr={lr!r}; allowed: a number > 0"
        )
    return Strategy(text.replace(" ", ""), method, opt, mopts, oopts)
