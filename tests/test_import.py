"""`import stiefel` stays light: no heavy optional module is imported with it.

`torch.distributed.tensor` (and sympy through it), scipy and `torch._dynamo` each
add a large share of `import torch`'s own time; the package imports them where they
are used, never at import. A fresh interpreter imports stiefel and reports which of
them ended up in ``sys.modules`` and, for each, the stiefel line that pulled it in.
geoopt, a dependency whose classes the manifolds subclass, would import scipy for
its line search: that import waits for the line search's first call (Note [geoopt
without scipy at import]), which still gets scipy's own functions.
"""

import json
import subprocess
import sys

HEAVY = ("torch.distributed.tensor", "sympy", "scipy", "torch._dynamo")

# A meta-path finder that records, for the first import of each heavy module, the
# innermost frame of the stiefel package on the stack and the innermost frame of all (who
# imported it: a line of ours, or a dependency's line under it); it finds nothing itself,
# so the import goes on as usual.
PROBE = """
import importlib.util, json, os, sys, traceback

HEAVY = {heavy!r}
ROOT = importlib.util.find_spec("stiefel").submodule_search_locations[0] + os.sep
who = {{}}


class Witness:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in who:
            stack = [f for f in traceback.extract_stack() if "importlib" not in f.filename
                     and not f.filename.startswith("<")]
            ours = [f for f in stack if f.filename.startswith(ROOT)]
            where = [f"{{f.filename}}:{{f.lineno}}" for f in (ours[-1:] + stack[-1:])]
            who[name] = " via ".join(dict.fromkeys(where)) or "?"
        return None


sys.meta_path.insert(0, Witness())
import torch  # noqa: E402

before = set(sys.modules)
import stiefel  # noqa: E402, F401

print(json.dumps({{
    "stiefel": "stiefel" in sys.modules and "stiefel.optimizers" in sys.modules,
    "before": sorted(HEAVY & before),
    "after": {{name: who.get(name, "?") for name in HEAVY if name in sys.modules}},
}}))
"""


def test_import_stiefel_imports_no_heavy_optional_module():
    code = PROBE.format(heavy=set(HEAVY))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["stiefel"], "the subprocess did not import the package"
    assert seen["before"] == [], f"import torch alone imports {seen['before']}"
    after = seen["after"]
    found = ", ".join(f"{name}: {where}" for name, where in sorted(after.items()))
    assert after == {}, f"import stiefel imports (module: our line via the one under it) {found}"


LINESEARCH = """
import sys
import stiefel  # noqa: F401
from geoopt.optim import rlinesearch

assert "scipy.optimize" not in sys.modules and "scipy" not in sys.modules
phi, derphi = (lambda a: (a - 1.0) ** 2), (lambda a: 2.0 * (a - 1.0))
got = (rlinesearch.scalar_search_armijo(phi, phi(0.0), derphi(0.0)),
       rlinesearch.scalar_search_wolfe2(phi, derphi)[0])
from scipy.optimize import _linesearch  # noqa: E402

want = (_linesearch.scalar_search_armijo(phi, phi(0.0), derphi(0.0)),
        _linesearch.scalar_search_wolfe2(phi, derphi)[0])
assert got == want, (got, want)
assert sys.modules["scipy.optimize._linesearch"] is _linesearch  # the stand-in is gone
print("ok")
"""


def test_geoopts_line_search_gets_scipys_functions_at_its_first_call():
    out = subprocess.run(
        [sys.executable, "-c", LINESEARCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
