"""The ground floor every other package stands on: argument checks, option
signatures and the registry mechanism (`checks`, `options`, `registry`).

It imports nothing from the rest of `stiefel`, so `manifolds/` holds geometry
only and each registry (maps, optimizers, tasks) is built on one mechanism.
"""
