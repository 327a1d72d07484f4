"""mkdocs hook: the tables of what exists are generated from the registries.

A page writes ``<!-- registry:methods -->``, ``<!-- registry:optimizers -->`` or
``<!-- registry:tasks -->`` where the table goes; the hook replaces the marker
by a markdown table read from ``stiefel.parametrizations.maps()``,
``stiefel.optimizers.available()``/``info()`` and
``stiefel.comparisons.tasks.available()``, so a registered map, optimizer or
task appears in the docs with no edit of a docs page.
"""

from __future__ import annotations

import inspect
import posixpath
import re

MARKER = re.compile(r"<!-- registry:(\w+) -->")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _methods(page_url: str, files) -> str:
    from stiefel import parametrizations

    rows = []
    for name, cls in parametrizations.maps().items():
        doc = f"methods/{name}.md"
        link = (
            f"[`{name}`]({_relative(page_url, doc)})"
            if files.get_file_from_path(doc)
            else f"`{name}`"
        )
        rows.append(
            [
                link,
                f"`{cls.__module__.replace('stiefel.', '')}.{cls.__name__}`",
                cls.formula or "–",
                cls.domain or "–",
                "yes" if cls.has_operator() else "no",
            ]
        )
    rows.append(
        [
            "[`riemannian`](" + _relative(page_url, "methods/riemannian.md") + ")",
            "manifold parameter",
            "per optimizer step",
            "every point",
            "–",
        ]
    )
    return _table(["method", "class", "serial cost", "reaches", "operator form"], rows)


def _optimizers(page_url: str, files) -> str:
    from stiefel import optimizers

    rows = []
    for name in optimizers.available():
        info = optimizers.info(name)
        rows.append(
            [
                f"`{name}`",
                "yes" if info.riemannian else "no",
                f"{info.default_lr:g}",
                info.formula or "–",
            ]
        )
    return _table(["name", "manifold parameters", "default lr", "one step"], rows)


def _tasks(page_url: str, files) -> str:
    from stiefel.comparisons import tasks

    rows = []
    for name in tasks.available():
        cls = tasks.get(name)
        params = list(inspect.signature(cls.__init__).parameters.values())[4:]
        opts = ", ".join(
            f"`{p.name}={p.default!r}`"
            for p in params
            if p.kind is p.KEYWORD_ONLY or p.default is not p.empty
        )
        rows.append(
            [f"`{name}`", cls.kind, opts or "–", (inspect.getdoc(cls) or "").split("\n")[0]]
        )
    return _table(["task", "kind", "options (defaults)", "what"], rows)


def _relative(src_uri: str, target: str) -> str:
    """The link to docs page ``target`` from the page whose source is ``src_uri``."""
    return posixpath.relpath(target, posixpath.dirname(src_uri) or ".")


TABLES = {"methods": _methods, "optimizers": _optimizers, "tasks": _tasks}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ValueError(f"unknown registry table {name!r}; allowed: {', '.join(TABLES)}")
        return TABLES[name](page.file.src_uri, files)

    return MARKER.sub(replace, markdown)
