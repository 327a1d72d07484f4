"""Benchmark scripts, run from a checkout as ``python -m benchmarks.<name>`` (not installed)."""
