"""Shared test problems with analytic optima computed independently (numpy LAPACK)."""

from __future__ import annotations

import inspect

import geoopt
import numpy as np
import torch

from stiefel import optimizers
from stiefel.manifolds import Orthogonal, Stiefel

# (label, n, m, complex): St real, St complex, O(n)
SPACES = [("st_real", 10, 3, False), ("st_complex", 10, 3, True), ("o_n", 5, 5, False)]


def haar_np(rng: np.random.Generator, n: int, m: int, cplx: bool) -> np.ndarray:
    a = rng.standard_normal((n, m))
    if cplx:
        a = a + 1j * rng.standard_normal((n, m))
    q, r = np.linalg.qr(a)
    return q * (np.diag(r) / np.abs(np.diag(r)))


def manifold(n: int, m: int, cplx: bool):
    return Orthogonal(n) if n == m and not cplx else Stiefel(n, m, complex=cplx)


def procrustes(rng, n, m, cplx):
    """min −Re tr(CᴴX): optimum UVᴴ from numpy's SVD of C (singular values in [1, 2])."""
    c = (haar_np(rng, n, m, cplx) * np.linspace(2.0, 1.0, m)) @ haar_np(rng, m, m, cplx).conj().T
    u, _, vh = np.linalg.svd(c, full_matrices=False)
    ct = torch.tensor(c)

    def loss(x):
        return -(ct.conj() * x).real.sum()

    def error(x: np.ndarray) -> float:
        return float(np.abs(x - u @ vh).max())

    return loss, error, u @ vh


def brockett(rng, n, m, cplx):
    """min tr(XᴴAXN), N = diag(m, …, 1): columns are eigenvectors of A (numpy eigh)."""
    q = haar_np(rng, n, n, cplx)
    a = (q * np.linspace(1.0, 3.0, n)) @ q.conj().T
    a = 0.5 * (a + a.conj().T)
    _, vecs = np.linalg.eigh(a)
    at, nt = torch.tensor(a), torch.arange(m, 0, -1, dtype=torch.float64)

    def loss(x):
        return ((x.conj() * (at @ x)).real.sum(0) * nt).sum()

    def error(x: np.ndarray) -> float:
        # each column equals the matching eigenvector up to a sign/phase
        return float(np.abs(np.abs(np.diag(vecs[:, :m].conj().T @ x)) - 1).max())

    return loss, error, None


PROBLEMS = {"procrustes": procrustes, "brockett": brockett}


def start_point(rng, n, m, cplx, target=None) -> torch.Tensor:
    """A Haar start; on O(n) in the connected component of ``target`` (det sign)."""
    x = haar_np(rng, n, m, cplx)
    if target is not None and n == m and not cplx:
        if np.sign(np.linalg.det(x)) != np.sign(np.linalg.det(target)):
            x[:, 0] *= -1
    return torch.tensor(x)


def manifold_param(x: torch.Tensor, man=None) -> geoopt.ManifoldParameter:
    n, m = x.shape[-2:]
    return geoopt.ManifoldParameter(x.clone(), manifold=man or manifold(n, m, x.is_complex()))


def rule_names() -> list[str]:
    """Registered optimizers written on the package's rule interface (RiemannianOptimizer)."""
    return [
        n
        for n in optimizers.available()
        if isinstance(optimizers.get(n), type)
        and issubclass(optimizers.get(n), optimizers.RiemannianOptimizer)
    ]


def takes(name: str, *options: str) -> bool:
    """Whether optimizer ``name`` takes every one of ``options`` by name (its signature).

    A suite that passes an option selects the optimizers that take it: a plugin's
    constructor need not have a rule's options (``nesterov``), and one written before
    it forwarded torch's (``foreach``, ``capturable``, ``telemetry``) lacks those.
    """
    params = inspect.signature(optimizers.get(name)).parameters
    return all(option in params for option in options)


def rule_names_taking(*options: str) -> list[str]:
    """Those of `rule_names` that take every one of ``options`` (`takes`)."""
    return [n for n in rule_names() if takes(n, *options)]


def builtin_rule_names() -> list[str]:
    """Those of `rule_names` defined in this package, not by a plugin."""
    package = optimizers.RiemannianOptimizer.__module__.split(".")[0]
    return [n for n in rule_names() if optimizers.get(n).__module__.split(".")[0] == package]


def retraction_rule_names() -> list[str]:
    """Those of `rule_names` that refuse a point off the manifold (they retract)."""
    return [n for n in rule_names() if not optimizers.get(n).accepts_off_manifold]


def orth_err64(x: torch.Tensor) -> float:
    """‖XᴴX − I‖_F of a real tall ``x`` (any dtype), measured independently in float64 numpy."""
    a = x.detach().float().numpy().astype(np.float64)
    return float(np.linalg.norm(a.T @ a - np.eye(a.shape[1])))


def random_gradients(
    gen: torch.Generator, shape: tuple[int, ...], steps: int, pool: int = 37, scale: float = 1.0
):
    """``steps`` gradients of ``shape``: ± one of ``pool`` random normals drawn once.

    Drawing a fresh normal matrix costs as much as a step at St(1024, 64); a random
    sign and a random pick per step keep the sequence from repeating.
    """
    bank = scale * torch.randn(pool, *shape, generator=gen)
    signs = torch.randint(0, 2, (steps,), generator=gen).mul(2).sub(1).tolist()
    index = torch.randint(0, pool, (steps,), generator=gen).tolist()
    for t in range(steps):
        yield bank[index[t]] if signs[t] > 0 else -bank[index[t]]
