"""The comparison harness: drift, convergence and complexity of every strategy.

Run ``python -m stiefel.comparisons --help`` (or ``stiefel-compare``). Importing
the harness registers its generic tasks (`stiefel.comparisons.tasks`), also in
the worker processes of ``jobs > 1``.
"""

from . import tasks  # noqa: F401  (registers procrustes, brockett, copying, adding, digits)
