r"""The float32 master copy of a float16/bfloat16 manifold parameter, and who wrote it last.

Note [float32 master copy of a low-precision parameter]
A float16/bfloat16 point cannot hold orthonormal columns to better than
~√M·eps(bf16) ≈ 1e-2, and a step computed from such a point and written
back in bf16 loses the step itself when lr·‖d‖ is below the rounding of
the entries. So the optimizer steps a float32 master copy kept in the
parameter's state (``state["master"]``, saved in state_dict) and stores the
rounding of the master in the parameter. The moments live in the master's
dtype too. The optimizer's step reads the point with `working` and writes the
result with `store`.

Who wrote a point last is recorded by `stiefel.optimizers.buckets.record_versions`
(Note [Points as the optimizer left them]).

Note [The master follows its parameter]
When p was changed from outside (its version or storage is not the recorded
one: a checkpoint's weights loaded into the model, a re-initialisation, an
assignment to ``p.data``), the master may hold the old weights; stepping it
would silently discard the new ones. The master is kept only if its rounding is
p exactly (an optimizer state loaded together with its model's weights: the
master is the more precise copy of the same point), and is otherwise replaced
by p in float32. An in-place write through ``p.data`` moves neither: seeing it
would take a comparison of p with the master's rounding at every step, three
passes over a point whose step makes about eight, and the master is written
back over it (as float32 masters elsewhere are).

Example:
    ```python
    import torch
    from stiefel.optimizers import master

    p = torch.nn.Parameter(torch.eye(3, 2, dtype=torch.bfloat16))
    state: dict = {}
    x, g = master.working(p, torch.zeros_like(p), state)
    assert x.dtype == torch.float32 and state["master"] is x
    with torch.no_grad():
        master.store(p, state, x * 0.5)
        assert master.unchanged(p, state)
        p.copy_(torch.eye(3, 2))  # replaced from outside: the master follows
    x, _ = master.working(p, torch.zeros_like(p), state)
    assert torch.equal(x, torch.eye(3, 2))
    ```
"""

from __future__ import annotations

import torch

from .._core.checks import LOW_PRECISION
from ..manifolds.sharded import is_dtensor
from .buckets import record_versions, unchanged, write

__all__ = [
    "working",
    "point",
    "store",
    "store_all",
    "unchanged",
    "strip",
    "restore_dtypes",
    "LOW_PRECISION",
]


def point(p: torch.Tensor, state: dict) -> torch.Tensor:
    """The point a rule steps: ``p.detach()``, or the float32 master of a low-precision p.

    Creates the master on first use and replaces it when p was changed from outside
    and the master no longer rounds to it (Note [The master follows its parameter]).
    """
    if p.dtype not in LOW_PRECISION:
        return p.detach()
    master = state.get("master")
    if master is not None and torch.compiler.is_compiling():
        # no version counters nor host reads in a traced step: the same rule by torch.where
        # (a working copy; `store` writes the result into the master)
        same = (master.to(p.dtype) == p.detach()).all()
        return torch.where(same, master, p.detach().to(torch.float32))
    if master is not None and not unchanged(p, state):
        if not torch.equal(master.to(p.dtype), p.detach()):
            master = None
    if master is None:
        master = state["master"] = p.detach().to(torch.float32).clone()
    return master


def working(p: torch.Tensor, grad: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The point and gradient a rule works on: `point` and the gradient in its dtype.

    Args:
        p: the parameter.
        grad: its gradient.
        state: its state dict (receives ``"master"`` for a float16/bfloat16
            parameter on first use).

    Returns:
        ``(x, grad)``: ``(p.detach(), grad)`` for other dtypes; the float32 master
        and the gradient in float32 for a float16/bfloat16 parameter.
    """
    x = point(p, state)
    return x, grad if grad.dtype == x.dtype else grad.to(x.dtype)


def store(p: torch.Tensor, state: dict, new: torch.Tensor) -> None:
    """Write a point: into the master (and its rounding into p), or into p; record versions.

    Args:
        p: the parameter.
        state: its state dict.
        new: the new point, in the dtype `working` returned.
    """
    master = state.get("master")
    if master is None or p.dtype not in LOW_PRECISION:
        write([p], [state], [new])
        return
    if new is not master:
        master.copy_(new)
    p.copy_(master)  # rounds to p's dtype
    record_versions([p], [state])


def store_all(params: list[torch.Tensor], states: list[dict], news: list[torch.Tensor]) -> None:
    """`store` for the parameters of a bucket: one ``_foreach_copy_`` (two with masters).

    Args:
        params: the parameters (of one dtype).
        states: their state dicts.
        news: their new points, in the dtype `working` returned.
    """
    if params[0].dtype not in LOW_PRECISION:
        write(params, states, news)
        return
    if len(params) == 1:  # a DTensor or another subclass: its own copy_
        store(params[0], states[0], news[0])
        return
    masters = [s["master"] for s in states]
    torch._foreach_copy_(masters, news)
    torch._foreach_copy_(params, masters)  # rounds to p's dtype
    record_versions(params, states)


def strip(state: dict) -> dict:
    """A parameter's state without what the host keeps for itself (for ``state_dict``).

    The version record and the host's copy of the step count (keys starting with "_").
    """
    return {key: value for key, value in state.items() if not key.startswith("_")}


def restore_dtypes(opt: torch.optim.Optimizer, saved_groups: list, saved_state: dict) -> None:
    """Put the state torch's load cast into the dtypes the rules keep it in.

    torch's ``load_state_dict`` casts every floating state tensor of a floating
    parameter to the parameter's dtype, as its own optimizers need. Two kinds of
    state are kept in another dtype on purpose, and are reloaded in it:

    - the master and the moments of a float16/bfloat16 parameter, in float32 (the
      working dtype, Note [float32 master copy of a low-precision parameter]),
      from the saved values whatever dtype they were saved in;
    - the keys a rule names in ``wide_state`` (pogo's float64 second moment, Note
      [VectorAdam's second moment in float64]), in their saved dtype.

    Everything else follows the parameter as torch casts it, so a state saved by a
    float32 run loads into a float64 model and back. A master saved for a
    parameter that is no longer of low precision is dropped: its point is the
    parameter itself. Where the parameter holds that master's rounding (a bfloat16
    run resumed in float32, the model's weights loaded before the optimizer's state,
    as torch's recipes do), the master is written into it: the parameter goes on
    from the precise point the run had reached, not from its rounding (4e-3 off
    St(32, 8) in bfloat16, projected away at the next step).
    """
    wide = getattr(opt, "wide_state", frozenset())
    ids = [i for g in saved_groups for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in zip(ids, params, strict=False):
        if i not in saved_state:
            continue
        held = opt.state[p]
        if p.dtype not in LOW_PRECISION:
            _resume_from(p, held.pop("master", None))
        for key, value in saved_state[i].items():
            if key == "step" or key not in held or not isinstance(value, torch.Tensor):
                continue
            if not value.is_floating_point():
                continue
            if key in wide:
                dtype = value.dtype
            elif p.dtype in LOW_PRECISION:
                dtype = torch.float32
            else:
                continue  # torch's cast to the parameter's dtype stands
            if held[key].dtype != dtype:
                held[key] = value.to(device=p.device, dtype=dtype, copy=True)


@torch.no_grad()
def _resume_from(p: torch.Tensor, master: torch.Tensor | None) -> None:
    """Write a low-precision run's ``master`` into ``p`` when ``p`` holds its rounding."""
    if master is None or master.shape != p.shape or not master.is_floating_point():
        return
    if is_dtensor(p) or p.device.type == "meta":
        return  # a DTensor's shards or no values: the parameter stays as loaded
    master = master.to(p.device)
    for low in LOW_PRECISION:
        if torch.equal(master.to(low).to(p.dtype), p.detach()):
            p.copy_(master)
            return
