r"""The warnings about skipped steps: at once in an eager step, when read after a traced one.

A step whose gradient or result is not finite is skipped (Note [Safe step]) and
warned about per optimizer and kind: the first time, then at the 10th, 100th, ….
An eager ``step()`` knows it from its one host read and warns at once (`warn`); a
step traced by ``torch.compile`` (or a ``capturable`` one) reads nothing, so it
counts the skips per parameter on the device (`record`) and `report` warns when they
are read (Note [The step's flags are read once, after the step] in
`stiefel.optimizers.engine`).

Example:
    ```python
    import warnings
    import torch
    from stiefel import optimizers

    w = torch.nn.Parameter(torch.zeros(3))
    opt = optimizers.create("rgd", [w], lr=0.1)
    w.grad = torch.full((3,), float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # eager: skipped, warned at once
    assert torch.equal(w.detach(), torch.zeros(3))
    assert any("non-finite gradient" in str(c.message) for c in caught)
    assert opt.report_skipped() == 0  # nothing left to read
    ```
"""

from __future__ import annotations

import torch

__all__ = ["warn", "record", "report"]


def warn(opt, where: str, grad_ok: bool, count: int = 1) -> None:
    """Warn of ``count`` skipped steps of ``where``: the first of its kind, then the 10th, 100th, …
    of the same parameter.

    A skipped step keeps its point and state, so a full-batch gradient is the same at
    the next step and may be skipped again, every time: a run that stands still. The
    count of one parameter's skips says so where the first warning alone would have
    been the only word (many parameters skipped once, one bad batch, do not add up).
    """
    name = type(opt).__name__
    kind = "grad" if not grad_ok else "step"
    counts = opt.__dict__.setdefault("_skip_counts", {})
    before = counts.get((kind, where), 0)
    n = counts[(kind, where)] = before + count
    when = "again at the 10th, 100th, ... skipped step of a parameter"
    if not grad_ok:
        message = f"{name}: {where} has a non-finite gradient; its step is skipped"
        opt._warn_once(kind, message, when)
    else:
        opt._warn_once(
            kind,
            f"{name}: the step of {where} is not finite (huge gradient or learning rate); "
            "the parameter and its optimizer state keep their values",
            when,
        )
    tens = 10 ** (len(str(n)) - 1)  # the power of ten at or below n
    if n >= 10 and before < tens:  # a power of ten crossed by this count
        cause = "a non-finite gradient" if not grad_ok else "a step that is not finite"
        opt._warn_once(
            f"{kind} {where} {tens}",
            f"{name}: {n} steps of {where} skipped so far for {cause}; a skipped step "
            "keeps its point and state, so the same gradient is skipped again: training "
            "may have stalled (lower the learning rate, or find the source of the "
            "non-finite values)",
            "again at 10× as many",
        )


def record(
    opt, wheres: list[str], grad_ok: torch.Tensor, ok: torch.Tensor, params: list[torch.Tensor]
) -> None:
    """Count a quiet step's skips per parameter in ``opt._flags_unread`` (no host read).

    Args:
        opt: the optimizer.
        wheres: the parameters, named for the warning.
        grad_ok: their gradients are finite (one flag each, or a 0-dim flag for one).
        ok: their steps were accepted.
        params: the parameters.
    """
    bad_grad = grad_ok.reshape(-1).logical_not().int()
    bad = ok.reshape(-1).logical_not().int()
    for k, (where, p) in enumerate(zip(wheres, params, strict=True)):
        seen = opt._flags_unread.get(id(p))
        g, b = bad_grad[k], bad[k]
        if seen is not None:
            g, b = seen[1] + g, seen[2] + b
        opt._flags_unread[id(p)] = (where, g, b)


def report(opt) -> int:
    """Read the counts `record` left (one host read), warn, clear; the number of skips."""
    seen = list(opt._flags_unread.values())
    opt._flags_unread.clear()
    if not seen:
        return 0
    device = seen[0][2].device
    counts = torch.stack([torch.stack([g.to(device), b.to(device)]) for _, g, b in seen])
    skipped = 0
    for (where, *_), (bad_grad, bad) in zip(seen, counts.tolist(), strict=True):
        skipped += bad
        if bad:
            warn(opt, where, not bad_grad, bad)
    return skipped
