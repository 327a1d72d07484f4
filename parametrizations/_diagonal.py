r"""The sign / phase diagonal shared by the reflection maps and the scaled Cayley map."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SignPhaseDiagonal"]


class SignPhaseDiagonal:
    r"""Mixin for maps ending in a diagonal d of m signs (real) or phases e^{iθ} (complex).

    Note [Signs live in a buffer, phases in a parameter]
    On O(n) a continuous change of the free parameters cannot flip the
    determinant, so the signs d are a non-trainable buffer set by
    ``right_inverse`` (``signs`` for the reflection maps, ``scaling`` for
    scoRNN's D): stored inside a trainable tensor (as torch's householder map
    stores them in the diagonal of its parameter), weight decay would shrink
    them and eventually move the matrix to another component. For U(n) the
    determinant is a continuous phase, so the phases θ are a trainable
    parameter (§4.3 of the Householder paper, scuRNN's D): weight decay moves
    θ continuously and cannot make the map degenerate.
    """

    #: name of the real buffer holding the signs
    diagonal_buffer = "signs"

    def _init_diagonal(self, d: torch.Tensor) -> None:
        """Create the buffer (real) or the phase parameter (complex) from d (…, m), ±1 / real."""
        if self.is_complex:  # type: ignore[attr-defined]
            self.phases = nn.Parameter(torch.zeros_like(d))
        else:
            self.register_buffer(self.diagonal_buffer, d)  # type: ignore[attr-defined]

    def _apply(self, fn, recurse=True):
        # module.to(torch.complex128) casts every floating tensor to complex, the phases
        # θ too: they stay real, in the cast's real dtype (θ of a unit-modulus e^{iθ})
        if not self.is_complex:  # type: ignore[attr-defined]
            return super()._apply(fn, recurse)  # type: ignore[misc]
        theta = self.phases
        keep = {id(theta)} | ({id(theta.grad)} if theta.grad is not None else set())

        def real_phases(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out.real.clone() if id(t) in keep and out.is_complex() else out

        return super()._apply(real_phases, recurse)  # type: ignore[misc]

    def check_state(self) -> str | None:
        """Real signs must be ±1 (a unit-modulus diagonal); complex phases are any finite θ."""
        why = super().check_state()  # type: ignore[misc]
        if why is not None or self.is_complex:  # type: ignore[attr-defined]
            return why
        d = getattr(self, self.diagonal_buffer)
        bad = int((d.detach().abs() != 1).sum())
        if bad:
            return (
                f"buffer {self.diagonal_buffer!r} has {bad} of {d.numel()} entries other than "
                "±1 (the diagonal must be unimodular)"
            )
        return None

    def diagonal(self) -> torch.Tensor:
        """d: the signs (real) or e^{iθ} (complex), shape (…, m)."""
        if self.is_complex:  # type: ignore[attr-defined]
            return torch.polar(torch.ones_like(self.phases), self.phases)
        return getattr(self, self.diagonal_buffer)

    def set_diagonal(self, d: torch.Tensor) -> None:
        """Store d (signs, or unit-modulus complex numbers whose angle becomes θ)."""
        with torch.no_grad():
            if self.is_complex:  # type: ignore[attr-defined]
                theta = torch.angle(d) if d.is_complex() else torch.where(d < 0, torch.pi, 0.0)
                self.phases.copy_(theta)
            else:
                getattr(self, self.diagonal_buffer).copy_(d.real)
