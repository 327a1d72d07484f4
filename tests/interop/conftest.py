"""Ports of geoopt's, geotorch's and torch's own property tests (their properties, our code)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the shared helper module, under --import-mode=importlib
    sys.path.insert(0, _HERE)
