"""Make the shared helper module ``_spectra`` importable (pytest --import-mode=importlib)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
