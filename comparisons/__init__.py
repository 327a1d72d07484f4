"""The comparison harness: drift, convergence and complexity of every strategy.

Run ``python -m stiefel.comparisons --help`` (or ``stiefel-compare``).
"""
