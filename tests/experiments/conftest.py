"""The experiments of this checkout (not installed) import as ``experiments.<name>``.

``python -m stiefel.comparisons`` run from the checkout's root has the root on
``sys.path``; the tests put it there the same way.
"""

import pathlib
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
