r"""Right inverses: parameters that map back to a given point of St(n, m).

Everything here runs once per assignment (``module.weight = Q``), not per step;
the callers work in float64 / complex128 and cast back.
"""

from __future__ import annotations

import torch

from ._householder import householder_apply

__all__ = ["reflections_from_point", "complete", "cayley_scaling", "Unreachable"]


class Unreachable(ValueError):
    """The point is not in the image of the map with the given options."""


def _phase(x: torch.Tensor) -> torch.Tensor:
    p = torch.sgn(x)
    return torch.where(p == 0, torch.ones_like(p), p)


def _reflect(r: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # H(v) R for R (n, k), v (n,)
    return r - (2 / torch.vdot(v, v).real) * torch.outer(v, v.conj() @ r)


def _stable_loop(q: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Householder elimination of every column: Q = H(v₁)⋯H(v_m)[diag(d); 0], by blocks.

    Note [Stable reflections, complex]
    Column k of the partly reduced R is x (zero above row k, ‖x‖ = 1). The
    reflection with v = x + phase(x_k)·e_k maps x to −phase(x_k)·e_k; because
    |v_k| = 1 + |x_k| ≥ 1 there is no cancellation and v is never small, so
    every H(v) is a genuine, well-conditioned reflection (even for x = ±e_k).
    The reflections fix the columns already reduced (v is zero above row k),
    so after m steps R = [diag(d); 0] with d_k = −phase(x_k): a sign (real) or
    a phase (complex). For square Q the last step reflects the scalar x_n: the
    H₁ sign of the Householder paper. Theorem 1 of that paper (surjectivity onto
    O(n)) is the statement that this elimination always succeeds. The
    reflections of a panel of ``block`` columns are found column by column on
    the panel only (O(n·block) per column), then applied to the remaining
    columns at once in compact WY form (GEMMs and a triangular solve).
    """
    n, m = q.shape
    r = q.clone()
    vs = torch.zeros(n, m, dtype=q.dtype, device=q.device)
    d = torch.empty(m, dtype=q.dtype, device=q.device)
    for j0 in range(0, m, block):
        j1 = min(j0 + block, m)
        panel = r[:, j0:j1]
        for k in range(j0, j1):
            x = panel[k:, k - j0]
            ph = _phase(x[0])
            v = vs[:, k]
            v[k:] = x
            v[k] = v[k] + ph * torch.linalg.vector_norm(x)
            panel[:, k - j0 :] = _reflect(panel[:, k - j0 :], v)
            d[k] = -ph
        if j1 < m:  # H(v_{j1-1})⋯H(v_{j0}) applied to the trailing columns
            r[:, j1:] = householder_apply(vs[:, j0:j1].flip(-1), r[:, j1:], block)
    return vs, d


def _stable(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Q = H(v₁)⋯H(v_m)[diag(d); 0] for a batch (…, n, m) of orthonormal Q (real: LAPACK).

    Note [Reflections from LAPACK's QR]
    ``torch.geqrf`` (blocked Householder QR, LAPACK speed: n = 4096 in about a
    second) writes Q = H₁⋯H_m R with H_k = I − τ_k v_k v_kᴴ, v_k zero above row
    k and 1 in row k, and R upper triangular; for orthonormal Q, R is diagonal
    up to rounding, with entries of unit modulus. Three conventions are fixed:
    (1) LAPACK's choice of v_k maps the reduced column x to β_k e_k with
    β_k = −sign(x_k)‖x‖, the stable choice (no cancellation in v_k, every
    H_k well conditioned), and for real data τ_k = 2/‖v_k‖², so H_k is the
    reflection H(v_k). (2) In the complex case LAPACK's H_k is not Hermitian
    (τ_k complex, a reflection only when x_k is real), and making every x_k
    real needs the phases of columns chosen one after another: complex points
    use the column-by-column elimination of Note [Stable reflections, complex].
    (3) A column that is already reduced gets
    τ_k = 0 (H_k = I, e.g. for Q = I); it is written H(e_k)H(e_k), and the
    second H(e_k), which commutes with H_j (j > k, as e_k ⊥ v_j), flips the sign
    of d_k. The reflections are H(v_k) = I − 2v_kv_kᴴ/‖v_k‖² with LAPACK's v_k.
    """
    n, m = q.shape[-2:]
    if q.is_complex():
        pairs = [_stable_loop(qi) for qi in q.detach().reshape(-1, n, m)]
        v = torch.stack([vi for vi, _ in pairs]).reshape(q.shape)
        return v, torch.stack([di for _, di in pairs]).reshape(*q.shape[:-2], m)
    rows = torch.arange(n, device=q.device).unsqueeze(-1)
    cols = torch.arange(m, device=q.device)
    a, tau = torch.geqrf(q)
    d = torch.diagonal(a, dim1=-2, dim2=-1)[..., :m]
    d = _phase(d)
    v = torch.where(rows > cols, a[..., :, :m], torch.zeros((), dtype=q.dtype, device=q.device))
    v = v + (rows == cols).to(q.dtype)
    reduced = tau == 0
    if bool(reduced.any()):
        d = torch.where(reduced, -d, d)
    return v, d


def _greedy(q: torch.Tensor, budget: int, tol: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    r"""At most ``budget`` reflections with Q = H(v₁)⋯H(v_r)[diag(d); 0], or raise Unreachable.

    Note [Fewer reflections than columns]
    A reflection changes R − E by a rank-one term, so a point needs at least
    rank(Q − E_d) reflections. Greedily, the column j farthest from its target
    d_j e_j (d_j the phase of R_jj) is sent onto it by v = R_j − d_j e_j (a
    valid reflection as ‖R_j‖ = 1 and d̄_j R_jj is real). Later reflections
    have v orthogonal to the columns already placed, so each step fixes one
    more column for good; the loop stops once every column is within ``tol``.
    A d_j that differs from the point's own adds to the rank: the search is
    the fallback of `_fixed_tall`, which keeps the map's diagonal.
    """
    n, m = q.shape
    r = q.clone()
    idx = torch.arange(m)
    vs: list[torch.Tensor] = []
    while True:
        d = _phase(r[idx, idx])
        res = r.clone()
        res[idx, idx] -= d
        norms = torch.linalg.vector_norm(res, dim=0)
        j = int(torch.argmax(norms))
        if float(norms[j]) <= tol:
            return vs, d
        if len(vs) == budget:
            raise Unreachable(
                f"the point is not reachable with reflections={budget}: after {budget} "
                f"reflections a column is still {float(norms[j]):.3e} from its target"
            )
        v = res[:, j]
        r = _reflect(r, v)
        vs.append(v)


def _real_pick(m: torch.Tensor) -> torch.Tensor:
    # the column of M − I of largest norm: x = e_j has Mx ≠ x as far as possible
    j = int(torch.argmax(torch.linalg.vector_norm(m - torch.eye(m.shape[0], dtype=m.dtype), dim=0)))
    return torch.eye(m.shape[0], dtype=m.dtype)[:, j]


def _complex_pick(m: torch.Tensor) -> torch.Tensor:
    # a unit x with xᴴMx real: two eigenvectors on either side of the real axis
    lam, vec = torch.linalg.eig(m)
    lam, vec = lam.to(m.dtype), vec.to(m.dtype)
    moved = (lam - 1).abs() > 1e-6  # eigenvalue 1: the directions already fixed
    im = lam.imag
    a = int(torch.argmax(torch.where(moved, im, torch.full_like(im, -torch.inf))))
    b = int(torch.argmin(torch.where(moved, im, torch.full_like(im, torch.inf))))
    ia, ib = float(lam[a].imag), float(lam[b].imag)
    if ia < -1e-9 or ib > 1e-9:  # the numerical range misses the real axis
        raise Unreachable(
            "the point is not a product of complex reflections with this phase buffer"
        )
    ia, ib = max(ia, 0.0), min(ib, 0.0)
    if ia - ib <= 1e-9:  # a real eigenvalue (−1): its eigenvector
        return vec[:, a if abs(float(lam[a].imag)) <= abs(float(lam[b].imag)) else b]
    x = (-ib) ** 0.5 * vec[:, a] + ia**0.5 * vec[:, b]
    return x / torch.linalg.vector_norm(x)


def _fixed_square(
    q: torch.Tensor, d: torch.Tensor, budget: int, tol: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    r"""Q = H(v₁)⋯H(v_r)·diag(d) with the given d, r = rank(QD⁻¹ − I) ≤ budget, or Unreachable.

    Note [Fewer reflections: rank reduction]
    A product of L reflections differs from I by rank ≤ L, so P = QD⁻¹ is
    reachable only if r = rank(P − I) ≤ L. Conversely, on W = range(P − I)
    (P is normal, so W ⊥ fix(P) and PW = W), any x ∈ W with xᴴPx real and
    Px ≠ x gives the reflection H(Px − x), which swaps Px and x and fixes
    fix(P) (Px − x ⊥ fix(P)); H·P then fixes x too: the rank drops by one. Real
    x always qualifies (the column of P − I of largest norm); for complex P, x
    mixes two eigenvectors of P|_W whose eigenvalues lie on either side of the
    real axis, weighted so that Im xᴴPx = 0. Everything runs in an orthonormal
    basis of W, so each step costs O(r³), not O(n³).
    """
    n = q.shape[-1]
    p = q * d.conj().unsqueeze(-2)
    basis, _ = _moved(p - torch.eye(n, dtype=p.dtype), budget, tol, "Q·D⁻¹ − I")
    return _rank_reduction(basis, basis.mH @ p @ basis), d


def _fixed_tall(
    q: torch.Tensor, d: torch.Tensor, budget: int, tol: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    r"""Q = H(v₁)⋯H(v_r)[diag(d); 0] with the given d, r = rank(Q − E_d) ≤ budget, or Unreachable.

    Note [Fewer reflections on a tall point]
    On W = range(Q − E_d) (orthonormal basis U, r = dim W) the columns of Q and
    E_d differ, and off W they agree; a = UᴴE_d and b = UᴴQ have aᴴa = bᴴb
    (both have orthonormal columns with equal parts off W), so the Procrustes
    factor T = polar(b aᴴ) is unitary with T a = b. G = I + U(T − I)Uᴴ is then
    unitary with G E_d = E_d + U(b − a) = Q, and rank(G − I) = r (T − I maps
    a onto b − a, of rank r). The reflections of G come from Note [Fewer
    reflections: rank reduction] on T: a real point with rank(Q − E_d) ≤ L is
    found with the map's current signs. A complex G need not be a product of r
    complex reflections (their eigenvalue is −1), so a complex point may be
    refused here; `_greedy`, which chooses the phases anew, is then tried.
    """
    m = q.shape[-1]
    e = torch.zeros_like(q)
    e[range(m), range(m)] = d
    basis, r = _moved(q - e, budget, tol, "Q − E_d")
    if r == 0:
        return [], d
    x, _, yh = torch.linalg.svd((basis.mH @ q) @ (basis.mH @ e).mH)
    return _rank_reduction(basis, x @ yh), d


def _moved(a: torch.Tensor, budget: int, tol: float, what: str) -> tuple[torch.Tensor, int]:
    """An orthonormal basis of range(``a``) and its dimension r, or Unreachable if r > budget."""
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    r = int((s > tol).sum())
    if r > budget:
        raise Unreachable(
            f"the point is not reachable with reflections={budget}: {what} has rank {r} "
            f"(singular values above {tol:.1e}: {s[:r].tolist()[:4]}...)"
        )
    return u[:, :r], r


def _rank_reduction(basis: torch.Tensor, m: torch.Tensor) -> list[torch.Tensor]:
    """The reflections of I + basis (M − I) basisᴴ, M unitary with M − I invertible (r×r)."""
    vs = []
    pick = _complex_pick if m.is_complex() else _real_pick
    for _ in range(m.shape[-1]):
        x = pick(m)
        v = m @ x - x
        m = _reflect(m, v)
        vs.append(basis @ v)
    return vs


def reflections_from_point(
    q: torch.Tensor,
    reflections: int,
    tol: float,
    generator: torch.Generator | None = None,
    diagonal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""V (…, n, L) and d (…, m) with H(v₁)⋯H(v_L)[diag(d); 0] = Q, for each matrix of a batch.

    With L ≥ m (L = n for square Q) the stable elimination always succeeds and
    chooses d. With fewer reflections on a square Q the current ``diagonal``
    (default: ones) is kept, up to the sign of its first entry (Note [Padding to
    exactly L reflections]), and `Unreachable` is raised when QD⁻¹ is not
    a product of L reflections (Note [Fewer reflections: rank reduction]); on a
    tall Q the current ``diagonal`` is tried first, then a greedy search chooses d
    (Note [Fewer reflections than columns]).

    Note [Padding to exactly L reflections]
    A decomposition with r < L reflections is padded: if L − r is odd, by
    H(e₁) with d₁ → −d₁ (H(e₁)E_d' = E_d since E_d has a single entry d₁ in row 1);
    then by pairs H(w)H(w) = I, or, for a tall Q (m < n), by reflections
    supported on the rows m+1…n, which fix E_d. The w are random (from a fixed
    seed unless a generator is given) so that no two columns start out equal.
    """
    batch, (n, m) = q.shape[:-2], q.shape[-2:]
    full = reflections >= m
    if full:
        v_full, d_full = _stable(q)
        if reflections == m:
            return v_full, d_full
        v_full, d_full = v_full.reshape(-1, n, m), d_full.reshape(-1, m)
    q = q.cpu()
    flat = q.reshape(-1, n, m)
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    if diagonal is None:
        diagonal = torch.ones(*batch, m, dtype=q.dtype)
    diag = diagonal.to(dtype=q.dtype, device="cpu").expand(*batch, m).reshape(-1, m)
    out_v, out_d = [], []
    for i, (qi, di) in enumerate(zip(flat, diag, strict=False)):
        if full:
            vs, d = list(v_full[i].cpu().unbind(-1)), d_full[i].cpu()
        elif m == n:
            vs, d = _fixed_square(qi, di, reflections, tol)
        else:  # the map's diagonal first: every point it reaches with it is found
            try:
                vs, d = _fixed_tall(qi, di, reflections, tol)
            except Unreachable:
                vs, d = _greedy(qi, reflections, tol)
        extra = reflections - len(vs)
        if m < n:
            for _ in range(extra):
                w = torch.zeros(n, dtype=q.dtype)
                w[m:] = torch.randn(n - m, generator=gen, dtype=w.real.dtype).to(w.dtype)
                vs.append(w)
        else:
            if extra % 2:
                vs.append(torch.eye(n, dtype=q.dtype)[:, 0])
                d = d.clone()
                d[0] = -d[0]
                extra -= 1
            for _ in range(extra // 2):
                w = torch.randn(n, generator=gen, dtype=q.real.dtype).to(q.dtype)
                vs += [w, w.clone()]
        out_v.append(torch.stack(vs, dim=-1))
        out_d.append(d)
    v = torch.stack(out_v).reshape(*batch, n, reflections)
    return v, torch.stack(out_d).reshape(*batch, m)


def complete(q: torch.Tensor) -> torch.Tensor:
    """A square unitary P whose first m columns are Q (Q itself if square)."""
    n, m = q.shape[-2:]
    if m == n:
        return q
    full, r = torch.linalg.qr(q, mode="complete")
    return torch.cat((q, full[..., m:]), dim=-1)


def cayley_scaling(p: torch.Tensor) -> torch.Tensor:
    r"""Signs / phases d with I + P·diag(d) well conditioned (Kahan 2006, scoRNN / scuRNN).

    Note [Choosing the scaling D of the scaled Cayley transform]
    Every unitary P equals (I + A)⁻¹(I − A)D with K = PD⁻¹ having no
    eigenvalue −1, i.e. I + PD̄ invertible (D̄ = D⁻¹). Gaussian elimination on
    M = I + P·diag(c) is run column by column: after the row operations so far,
    column j of M is a + c_j b (a from I, b from P), so the pivot is a_j + c_j b_j;
    choosing c_j = phase(a_j b̄_j) makes |pivot| = |a_j| + |b_j|, never smaller
    than without the scaling. Returning d = c̄ gives I + P D⁻¹ = M. This is the
    constructive proof of Kahan's theorem (Theorem 1 of the scaled Cayley paper).
    """
    n = p.shape[-1]
    aw = torch.eye(n, dtype=p.dtype, device=p.device).expand_as(p).clone()
    bw = p.clone()
    c = torch.empty(p.shape[:-1], dtype=p.dtype, device=p.device)
    for j in range(n):
        a, b = aw[..., j:, j], bw[..., j:, j]
        cj = _phase(a[..., 0] * b[..., 0].conj())
        c[..., j] = cj
        col = a + cj.unsqueeze(-1) * b
        ell = (col[..., 1:] / col[..., :1]).unsqueeze(-1)
        aw[..., j + 1 :, j + 1 :] -= ell * aw[..., j : j + 1, j + 1 :]
        bw[..., j + 1 :, j + 1 :] -= ell * bw[..., j : j + 1, j + 1 :]
    return c.conj()
