"""Riemannian optimizers and the optimizer registry (see the optimizers issue)."""
