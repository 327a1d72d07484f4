"""Maps from free parameters onto O(n), U(n) and St(N, M) (see the parametrizations issue)."""
