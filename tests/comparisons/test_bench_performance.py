"""benchmarks/performance.py writes the benchmark scripts' tables into docs/performance.md.

A smoke run at tiny sizes (``--quick``): no timing assertion. What is checked is
the page: each section's text lands between its own markers, everything else is
kept byte for byte, and a page without the markers is refused before anything runs.
"""

import pathlib

import pytest

from stiefel.benchmarks import performance as perf

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _page(names, inside="stale table"):
    parts = ["# Performance\n\nProse before.\n"]
    for name in names:
        begin, end = perf.markers(name)
        parts.append(f"## {name}\n\n{begin}\n{inside}\n{end}\n\nProse after {name}.\n")
    return "\n".join(parts)


def _outside(text, names):
    """The page with every section's body cut out (what the script must not touch)."""
    for name in names:
        begin, end = perf.markers(name)
        head, rest = text.split(begin)
        _, tail = rest.split(end)
        text = f"{head}{begin}{end}{tail}"
    return text


def test_quick_run_fills_each_section_between_its_markers(tmp_path):
    names = ["precision", "init"]
    page = tmp_path / "performance.md"
    page.write_text(_page(names), encoding="utf-8")
    before = page.read_text(encoding="utf-8")

    done = perf.main(["--quick", "--only", ",".join(names), "--page", str(page)])

    after = page.read_text(encoding="utf-8")
    assert _outside(after, names) == _outside(before, names)
    assert "stale table" not in after
    assert list(done) == names
    for name in names:
        begin, end = perf.markers(name)
        body = after.split(begin)[1].split(end)[0].strip()
        assert body == done[name].strip()
        # the command that produced it, then the script's own markdown table(s)
        assert body.startswith(f"```text\npython -m benchmarks.{name} --quick")
        assert any(line.startswith("|---") for line in body.splitlines()), body
        assert "Targets" not in body
    assert "| householder |" in done["precision"] and "| rgd(" in done["precision"]


def test_targets_blocks_are_left_out():
    output = "Title — torch\nline two\n\n\nO(8)\n| a |\n|---|\n| 1 |\n\nTargets (x)\n| t |\n|---|\n"
    assert perf.keep(output) == "Title — torch\nline two\n\nO(8)\n| a |\n|---|\n| 1 |"


def test_a_page_without_the_markers_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    page = tmp_path / "performance.md"
    page.write_text(_page(["maps"]), encoding="utf-8")
    before = page.read_text(encoding="utf-8")
    ran = []
    monkeypatch.setattr(perf, "run", lambda name, quick=False: ran.append(name) or "x")
    with pytest.raises(SystemExit):
        perf.main(["--quick", "--only", "maps,init", "--page", str(page)])
    assert "BEGIN benchmarks.performance init" in capsys.readouterr().err
    assert ran == [] and page.read_text(encoding="utf-8") == before
    # markers in the wrong order or twice are refused too
    begin, end = perf.markers("init")
    for bad in (f"{end}\n{begin}\n", f"{begin}\n{end}\n{begin}\n{end}\n"):
        with pytest.raises(ValueError, match="found them"):
            perf.splice(bad, "init", "body")


def test_a_page_that_does_not_exist_is_created_with_the_sections(tmp_path, monkeypatch, capsys):
    """``--page`` naming a new file writes a page of the sections run, each between its
    markers; a folder that does not exist is a parser error."""
    monkeypatch.setattr(perf, "run", lambda name, quick=False: f"body of {name}")
    page = tmp_path / "new.md"
    perf.main(["--quick", "--only", "maps,init", "--page", str(page)])
    text = page.read_text(encoding="utf-8")
    for name in ("maps", "init"):
        begin, end = perf.markers(name)
        assert f"{begin}\nbody of {name}\n{end}" in text
    assert "optimizers" not in text
    with pytest.raises(SystemExit):
        perf.main(["--quick", "--only", "maps", "--page", str(tmp_path / "no" / "x.md")])
    assert "allowed: a file in an existing folder" in capsys.readouterr().err


def test_an_unknown_section_is_a_parser_error(capsys):
    with pytest.raises(SystemExit):
        perf.main(["--only", "maps,nonsense", "--print"])
    err = capsys.readouterr().err
    assert "nonsense" in err and "allowed: maps, optimizers" in err


def test_docs_page_holds_every_section_once():
    """docs/performance.md keeps a place for each section the script writes."""
    text = perf.PAGE.read_text(encoding="utf-8")
    for name in perf.SECTIONS:
        perf.splice(text, name, "")  # raises unless both markers are there once, in order
        begin, _ = perf.markers(name)
        assert perf.command(name) in text.split(begin)[1], f"section {name} was not regenerated"
    assert "## Optimizer step: ops, host reads and host time per step" in text


@pytest.mark.slow
def test_every_section_runs_quick():
    """Each section's quick argument list is one its script accepts (maps needs geotorch)."""
    pytest.importorskip("geotorch")
    pytest.importorskip("geoopt")
    done = perf.main(["--quick", "--print"])
    assert list(done) == list(perf.SECTIONS)
    for name, body in done.items():
        assert any(line.startswith("|---") for line in body.splitlines()), name
