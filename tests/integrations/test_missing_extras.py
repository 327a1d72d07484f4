"""A missing optional library is named with what to install, not hidden behind another.

Each case imports in a fresh interpreter with one library made unimportable
(``sys.modules[name] = None``, Python's own way to block an import); the reference is
the message a user can act on.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _import_error(blocked: str, statement: str) -> str:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{blocked!r}] = None
        try:
            {statement}
        except ImportError as err:
            print("IMPORT-ERROR:", err)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout


@pytest.mark.parametrize(
    ("blocked", "statement", "message"),
    [
        # PEFT installed, one of its own imports failing: not "pip install peft"
        ("transformers", "import stiefel.integrations.peft", "PEFT is installed but importing"),
        ("peft", "import stiefel.integrations.peft", "needs PEFT: pip install peft"),
        ("matplotlib", "import stiefel.comparisons.cli", "pip install 'stiefel[compare]'"),
    ],
)
def test_a_missing_library_is_named_with_what_to_install(blocked, statement, message):
    out = _import_error(blocked, statement)
    assert "IMPORT-ERROR:" in out and message in out, out
