"""U(n) → O(2n): real_embedding / complex_from_real, and a unitary RNN equals its real twin."""

import pytest
import torch

from stiefel.nn import OrthogonalRNNCell, complex_from_real, real_embedding

DT = torch.float64


def test_embedding_round_trip_and_orthogonality():
    torch.manual_seed(0)
    u = torch.linalg.qr(torch.randn(3, 4, 4, dtype=torch.complex128))[0]
    q = real_embedding(u)
    assert q.shape == (3, 8, 8) and q.dtype == DT
    assert torch.allclose(q.mT @ q, torch.eye(8, dtype=DT).expand(3, 8, 8), atol=1e-13)
    assert torch.equal(complex_from_real(q), u)
    # it is a ring homomorphism: products and adjoints are preserved
    v = torch.randn(3, 4, 2, dtype=torch.complex128)
    assert torch.allclose(real_embedding(u @ v), q @ real_embedding(v), atol=1e-13)
    assert torch.allclose(real_embedding(u.mH), q.mT)
    # and the real action on [Re z; Im z] is the complex product
    z = torch.randn(4, dtype=torch.complex128)
    r = q[0] @ torch.cat((z.real, z.imag))
    assert torch.allclose(torch.complex(r[:4], r[4:]), u[0] @ z, atol=1e-13)
    # the other way round: an O(2n) matrix of that structure maps back
    a, b = torch.randn(2, 3, 3, dtype=DT).unbind(0)
    qq = torch.cat((torch.cat((a, -b), 1), torch.cat((b, a), 1)), 0)
    assert torch.equal(real_embedding(complex_from_real(qq)), qq)


def test_embedding_bad_input():
    with pytest.raises(TypeError, match="u must be a complex tensor"):
        real_embedding(torch.randn(3, 3))
    with pytest.raises(ValueError, match="even trailing dimensions"):
        complex_from_real(torch.randn(3, 4))
    with pytest.raises(ValueError, match="not the real embedding of a complex matrix"):
        complex_from_real(torch.linalg.qr(torch.randn(4, 4, dtype=DT))[0])
    with pytest.raises(TypeError, match="q must be a real floating tensor"):
        complex_from_real(torch.randn(4, 4, dtype=torch.complex64))


def _paired_modrelu(a, bias, eps):
    """The real-space modReLU of the Householder paper §3: entries i and i + n share |·|."""
    n = a.shape[-1] // 2
    r = torch.sqrt(a[..., :n] ** 2 + a[..., n:] ** 2 + eps)
    scale = torch.relu(r + bias) / r
    return a * torch.cat((scale, scale), -1)


def test_unitary_cell_equals_its_orthogonal_twin_states_and_gradients():
    gen = torch.Generator().manual_seed(4)
    cell = OrthogonalRNNCell(2, 4, method="cayley", complex=True, generator=gen, dtype=DT)
    with torch.no_grad():
        cell.act.bias.uniform_(-0.3, 0.1, generator=gen)
    w = cell.transition_matrix().detach().requires_grad_(True)
    what = real_embedding(w.detach()).requires_grad_(True)
    vhat = torch.cat((cell.inp.real, cell.inp.imag), 0).detach()  # V̂ = [Re V; Im V]
    xs = torch.randn(6, 3, 2, dtype=DT, generator=gen)
    h = torch.complex(*torch.rand(2, 3, 4, dtype=DT, generator=gen))
    hhat = torch.cat((h.real, h.imag), -1)
    for x in xs:
        h = cell(x, h, step=lambda h: h @ w.T)
        hhat = _paired_modrelu(x @ vhat.T + hhat @ what.T, cell.act.bias.detach(), cell.act.eps)
        assert torch.allclose(torch.cat((h.real, h.imag), -1), hhat, atol=1e-12)
    # a real loss of the final state: ∂L/∂W (complex) from the twin's ∂L/∂Ŵ
    target = torch.randn(3, 8, dtype=DT, generator=gen)
    (torch.cat((h.real, h.imag), -1) - target).square().sum().backward()
    (hhat - target).square().sum().backward()
    g = what.grad
    g11, g12, g21, g22 = g[:4, :4], g[:4, 4:], g[4:, :4], g[4:, 4:]
    # Ŵ = [[A, −B], [B, A]]: ∂L/∂A = G₁₁ + G₂₂, ∂L/∂B = G₂₁ − G₁₂; torch's W.grad = ∂L/∂A + i∂L/∂B
    assert torch.allclose(w.grad, torch.complex(g11 + g22, g21 - g12), atol=1e-11)
