"""Benchmarks of the kernels, maps and optimizers against geoopt, geotorch and torch."""
