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
        summary = (inspect.getdoc(cls) or "").split("\n")[0].replace("|", "\\|")
        rows.append(
            [
                link,
                summary or f"`{cls.__name__}`",
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
    return _table(["method", "the map", "serial cost", "reaches", "operator form"], rows)


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
        opts = ", ".join(f"`{k}={v!r}`" for k, v in tasks.options(name).items())
        own = ", ".join(f"`{m}`" for m in cls.extra_methods)
        summary = (inspect.getdoc(cls) or "").split("\n")[0]
        rows.append([f"`{name}`", cls.kind, opts or "–", summary, own or "–"])
    return _table(["task", "kind", "options (defaults)", "what", "its own methods"], rows)


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


def on_nav(nav, config, files):
    """Add the page ``methods/<name>.md`` of every registered map to the Methods section.

    mkdocs.yml lists only the section's index (and ``riemannian``, which is not a
    map); the map pages follow the registry's order, so a new map's page appears
    in the navigation with no edit of mkdocs.yml.
    """
    from mkdocs.structure.nav import Section
    from mkdocs.structure.pages import Page

    from stiefel import parametrizations

    section = next((s for s in nav.items if isinstance(s, Section) and s.title == "Methods"), None)
    if section is None:
        raise ValueError("mkdocs.yml has no 'Methods' section for the map pages")
    listed = {getattr(p, "file", None) and p.file.src_uri for p in section.children}
    pages = []
    for name in parametrizations.maps():
        f = files.get_file_from_path(f"methods/{name}.md")
        if f is None or f.src_uri in listed:
            continue
        page = f.page if f.page is not None else Page(None, f, config)
        page.parent = section
        pages.append(page)
    # the index first, then the maps in registry order, then what mkdocs.yml lists after it
    index, rest = section.children[:1], section.children[1:]
    section.children = index + pages + rest
    nav.pages = [p for p in _walk(nav.items)]
    return nav


def _walk(items):
    from mkdocs.structure.nav import Section
    from mkdocs.structure.pages import Page

    for item in items:
        if isinstance(item, Section):
            yield from _walk(item.children)
        elif isinstance(item, Page):
            yield item
