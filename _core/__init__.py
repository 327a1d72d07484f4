"""The ground floor every other package stands on: argument checks, option
signatures, the registry mechanism and autocast switched off where the package
computes in its own precision (`checks`, `options`, `registry`, `autocast`).

It imports nothing from the rest of `stiefel`, so `manifolds/` holds geometry
only and each registry (maps, optimizers, tasks) is built on one mechanism.
"""
