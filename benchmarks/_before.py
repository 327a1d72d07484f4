"""An earlier commit of this checkout, imported beside the current package for one-run comparisons.

``python -m benchmarks.launch --before REF`` steps the optimizers of commit REF in
the same rounds as today's: the two versions then share the machine's load, and a
before/after table is one run, not two runs minutes apart. The commit's tree is
exported with ``git archive`` into a temporary folder as the package
``stiefel_before`` (the package imports itself relatively, so it runs under any
name) and put first on ``sys.path``; nothing in the checkout changes.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import tarfile
import tempfile
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "stiefel_before"


def load(ref: str) -> ModuleType:
    """Import commit ``ref`` of this checkout as the package ``stiefel_before``.

    Raises:
        ValueError: ``ref`` names no commit of this checkout (git's message quoted), or
            another commit was imported in this process already.
    """
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise ValueError(f"--before {ref!r}: not a commit of {ROOT} ({found.stderr.strip()})")
    commit = found.stdout.strip()
    loaded = sys.modules.get(NAME)
    if loaded is not None:  # one earlier commit per process: the package name is taken
        if loaded.__commit__ != commit:
            raise ValueError(
                f"--before {ref!r}: commit {loaded.__commit__[:12]} is imported as {NAME} "
                "already; allowed: one earlier commit per process"
            )
        return loaded
    folder = pathlib.Path(tempfile.mkdtemp(prefix="stiefel-before-"))
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit], stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(folder / NAME, filter="data")
    sys.path.insert(0, str(folder))
    module = importlib.import_module(NAME)
    module.__commit__ = commit
    return module
