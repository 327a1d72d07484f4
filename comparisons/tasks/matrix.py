"""Matrix problems with known optima: Procrustes and Brockett (PCA) on O(n), U(n), St(N, M)."""

from __future__ import annotations

import torch
from torch import nn

from ...manifolds import kernels
from ...parametrizations import orthogonalize
from ..task import Task, positive_int, register


class _MatrixModel(nn.Module):
    def __init__(self, x0: torch.Tensor, method: str, options: dict):
        super().__init__()
        self.transition = orthogonalize(x0, method=method, **options)

    def forward(self) -> torch.Tensor:
        return self.transition()


class _MatrixTask(Task):
    kind = "matrix"

    def __init__(self, dtype, device, seed, n: int = 32, m: int | None = None):
        super().__init__(dtype, device, seed)
        self.n = positive_int(self.name, "n", n)
        self.m = n if m is None else positive_int(self.name, "m", m)
        if self.m > self.n:
            raise ValueError(f"task {self.name!r}: m={self.m}; allowed: 1 <= m <= n={self.n}")

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, generator=self.generator).to(self.device)

    def build(self, method: str, method_options: dict) -> nn.Module:
        x0 = kernels.haar(self.n, self.m, dtype=self.dtype, generator=self.generator)
        return _MatrixModel(x0.to(self.device), method, method_options)


@register("procrustes")
class Procrustes(_MatrixTask):
    r"""min ½‖XP − R‖²_F / k over St(n, m) (O(n) when m = n), P ∈ 𝔽^{m×k}, R ∈ 𝔽^{n×k}.

    Since ‖XP‖_F = ‖P‖_F for every X on St, the problem is max Re tr(Xᴴ RPᴴ), solved
    by the polar factor of RPᴴ (an SVD): the optimum is exact. On O(n) the
    optimum is only reachable from the component of its determinant, so the
    model starts there.
    """

    def __init__(self, dtype, device, seed, n: int = 32, m: int | None = None, k: int = 64):
        super().__init__(dtype, device, seed, n, m)
        k = positive_int(self.name, "k", k)
        self.p = self._randn(self.m, k)
        truth = kernels.haar(self.n, self.m, dtype=self.dtype, generator=self.generator)
        self.r = truth.to(self.device) @ self.p + 0.5 * self._randn(self.n, k)
        self.k = k
        best = kernels.polar(self.r @ self.p.mH)
        self.solution = best
        self.optimum = float(self._value(best))

    def _value(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.linalg.norm(x @ self.p - self.r) ** 2 / self.k

    def build(self, method: str, method_options: dict) -> nn.Module:
        x0 = kernels.haar(self.n, self.m, dtype=self.dtype, generator=self.generator)
        x0 = x0.to(self.device)
        if self.n == self.m and not x0.is_complex():
            if float(torch.linalg.det(x0) * torch.linalg.det(self.solution)) < 0:
                x0[:, 0] = -x0[:, 0]
        return _MatrixModel(x0, method, method_options)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        return self._value(model())


@register("brockett")
class Brockett(_MatrixTask):
    r"""min Re tr(XᴴAXD) over St(n, m): A Hermitian, D = diag(m, m−1, …, 1)/m.

    The minimizers are eigenvectors of A for its m smallest eigenvalues, the
    smallest paired with the largest weight (Brockett 1991); the optimum is
    Σ_i d_i λ_i with the λ ascending. With m = n this is the full
    eigendecomposition; with m < n it is PCA of −A.
    """

    def __init__(self, dtype, device, seed, n: int = 32, m: int | None = None):
        super().__init__(dtype, device, seed, n, m)
        g = self._randn(self.n, self.n)
        self.a = (g + g.mH) / (2 * self.n**0.5)
        real = self.a.real.dtype
        self.d = torch.arange(self.m, 0, -1, dtype=real, device=self.device) / self.m
        wide = torch.complex128 if self.dtype.is_complex else torch.float64
        lam = torch.linalg.eigvalsh(self.a.to(wide))
        self.optimum = float((lam[: self.m] * self.d.double()).sum())

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        x = model()
        return ((x.mH @ self.a @ x).diagonal().real * self.d).sum()
