r"""The warnings about skipped steps: at once in an eager step, when read after a traced one.

A step whose gradient or result is not finite is skipped (Note [Safe step]) and
warned about once per optimizer and kind. An eager ``step()`` knows it from its
one host read and warns at once (`warn`); a step traced by ``torch.compile``
reads nothing, so it counts the skips per parameter on the device (`record`)
and `report` warns when they are read (Note [The step's flags are read once,
after the step] in `stiefel.optimizers.transaction`).

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

from .transaction import Pending

__all__ = ["warn", "record", "report"]


def warn(opt, where: str, grad_ok: bool) -> None:
    """The warning (once per optimizer and kind) for a skipped step of ``where``."""
    name = type(opt).__name__
    if not grad_ok:
        opt._warn_once("grad", f"{name}: {where} has a non-finite gradient; its step is skipped")
    else:
        opt._warn_once(
            "step",
            f"{name}: the step of {where} is not finite (huge gradient or learning rate); "
            "the parameter and its optimizer state keep their values",
        )


def record(opt, pend: Pending) -> None:
    """Count a traced step's skips per parameter in ``opt._flags_unread`` (no host read)."""
    bad_grad = torch.as_tensor(pend.grad_ok).logical_not().int()
    bad = torch.as_tensor(pend.ok).logical_not().int()
    seen = opt._flags_unread.get(id(pend.param))
    if seen is not None:
        bad_grad, bad = seen[1] + bad_grad, seen[2] + bad
    opt._flags_unread[id(pend.param)] = (pend.where, bad_grad, bad)


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
            warn(opt, where, not bad_grad)
    return skipped
