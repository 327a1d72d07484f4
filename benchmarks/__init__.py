"""Benchmark scripts, run from a checkout: ``python -m benchmarks.maps`` (not installed)."""
