r"""What a map refuses to compute with: tensors never initialised, unusable buffers, shards.

`Guards` is the part of `OrthogonalMap` that checks the map's inputs once
rather than at every step: the first forward after the map is built, moved or
loaded checks its original and its own tensors (Note [Free parameters are
checked at first use]); loading a state dict checks the loaded buffers at
once and puts the old ones back when they are refused; a sharded original is
refused where the map holds local tensors (Note [A sharded weight is read
after unshard()]). It is a mixin: only `OrthogonalMap` uses it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import nn

from ..manifolds.binding import is_dtensor

__all__ = ["Guards", "checks_deferred"]

_APPLYING = threading.local()  # how many modules' ``_apply`` this thread is inside


@contextlib.contextmanager
def checks_deferred() -> Iterator[None]:
    """Inside: a weight computed is not checked, nor marked checked (the next use is).

    Note [Weights computed inside _apply]
    ``nn.RNN``/``LSTM``/``GRU`` compute every weight inside their own ``_apply``
    (``_init_flat_weights`` gathers them for cuDNN), so ``rnn.to_empty(device=...)``
    computed the constrained weight from the uninitialised memory it had just
    allocated and the first-use check refused it, before ``initialize`` or
    ``reset_parameters`` could run. No forward runs inside ``_apply``: a weight
    computed there is bookkeeping, and the check waits for the next use, which
    refuses what is still uninitialised then (Note [Free parameters are checked at
    first use]). The constrained module's ``_apply`` runs in this context
    (`stiefel.parametrizations.deferred.hook_deferred_init`).
    """
    _APPLYING.depth = getattr(_APPLYING, "depth", 0) + 1
    try:
        yield
    finally:
        _APPLYING.depth -= 1


class Guards(nn.Module):
    """The first-use checks and state-dict guards of `OrthogonalMap` (a mixin, not a map).

    Reads the map's ``label`` and ``method`` for its messages; maps override
    `check_original` and `check_state` to refuse values they cannot use.
    """

    method: ClassVar[str]
    #: how error messages name the constrained weight (set by `OrthogonalMap`)
    label: str

    def __init__(self) -> None:
        super().__init__()
        self._verified = False
        self.register_load_state_dict_post_hook(_changed_outside)

    def check_original(self, original: torch.Tensor) -> str | None:
        """Why ``original`` (finite) cannot be used, or None; maps with a singular case override."""
        return None

    def check_state(self) -> str | None:
        """Why the map's own tensors (its buffers) cannot be used, or None.

        Maps whose buffers must hold particular values (signs ±1, a base point
        on the manifold) override this; it runs at the first-use check and
        when a state dict is loaded (Note [Free parameters are checked at first
        use]).
        """
        return None

    def verify(self, original: torch.Tensor) -> None:
        r"""Refuse free parameters that were never initialised (first use after a change).

        Note [Free parameters are checked at first use]
        After ``module.to_empty(device=...)`` the originals and the maps'
        buffers hold uninitialised memory, and a checkpoint can hold values no
        map accepts (a zero reflection vector: 0/0). Computing with them would
        give a NaN or an arbitrary matrix silently. So the first forward after
        the map is built, moved or converted (``_apply``: ``to``, ``to_empty``,
        ``half``…) or loaded (``load_state_dict``) checks that the original and
        the map's tensors are finite, that its buffers hold values it can use
        (`check_state`: signs ±1, a base point on the manifold) and that the
        map accepts the original (`check_original`), and raises naming the
        weight and the fix otherwise. ``load_state_dict`` runs `check_state`
        on the loaded buffers at once and puts the old ones back when it fails.
        Later forwards skip the check: no host synchronisation per step. The
        check is skipped while tracing with ``torch.compile`` (it would break
        the graph) and for values that cannot be read (meta, ``vmap``).
        """
        # tracing first: a traced forward then does not depend on (nor guard on) the flag
        if torch.compiler.is_compiling() or self._verified or original.device.type == "meta":
            return
        if getattr(_APPLYING, "depth", 0):  # Note [Weights computed inside _apply]
            return
        if torch._C._functorch.is_functorch_wrapped_tensor(original):
            return
        tensors = [("the free parameter", original.detach())]
        tensors += [(f"the map's {k}", t.detach()) for k, t in self.named_parameters()]
        tensors += [(f"the map's {k}", t) for k, t in self.named_buffers()]
        floating = [(k, t) for k, t in tensors if t.is_floating_point() or t.is_complex()]
        bad = [k for k, t in floating if not bool(torch.isfinite(t).all())]
        why = f"{', '.join(bad)} not finite" if bad else self.check_state()
        why = why if why is not None else self.check_original(original.detach())
        if why is not None:
            raise ValueError(
                f"{self.label} ({self.method!r} map) cannot be computed: {why} (never "
                "initialised, e.g. after module.to_empty(), or a bad checkpoint); call "
                "stiefel.parametrizations.initialize(model) or the module's "
                "reset_parameters(), or assign a point (module.weight = Q)"
            )
        self._verified = True

    def changed_outside(self) -> None:
        """The map's tensors were rewritten from outside (``_apply``, ``load_state_dict``).

        Forgets the first-use check (Note [Free parameters are checked at first
        use]); maps with a buffer that must stay on the manifold also repair it.
        """
        self._verified = False

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.changed_outside()
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # the map's buffers as they were, to put back if the checkpoint's are refused
        before = {k: (b, b.detach().clone()) for k, b in self._buffers.items() if b is not None}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        buffers = [b for b in self._buffers.values() if b is not None]
        if any(b.device.type == "meta" for b in buffers):
            return
        why = self.check_state()
        if why is None:
            return
        with torch.no_grad():
            for k, (old, value) in before.items():
                if self._buffers[k] is old:
                    old.copy_(value)
                else:  # load_state_dict(assign=True) replaced it
                    self._buffers[k] = old
        raise ValueError(
            f"{self.label} ({self.method!r} map): the state dict's {why}; the map's buffers "
            "are left as they were. Load a checkpoint saved from this map, or call "
            "stiefel.parametrizations.initialize(model) or the module's reset_parameters()"
        )

    def _refuse_shard(self, original: torch.Tensor) -> None:
        r"""Refuse a sharded original when the map holds local tensors.

        Note [A sharded weight is read after unshard()]
        After FSDP2's ``fully_shard`` the original is a DTensor shard outside
        the forward (inside it, FSDP2 puts the gathered Parameter there). A
        map that holds tensors of its own (signs, a base point, a scaling)
        cannot mix them with a shard (torch's "mixed torch.Tensor and DTensor"),
        and gathering the original here would hide a collective in an
        attribute read: reading ``model.layer.weight`` on one rank (logging,
        a check) would wait for the other ranks forever. So reading the weight
        there is refused with the fix: ``unshard()`` on the ``fully_shard``
        module that holds it (every rank), then read, then ``reshard()``. A map
        with no tensors of its own (the identity of ``"riemannian"`` kernels)
        computes on the shard as before.
        """
        tensors = [*self.named_parameters(), *self.named_buffers()]
        local = [k for k, t in tensors if not is_dtensor(t)]
        if not local:
            return
        raise ValueError(
            f"{self.label} ({self.method!r} map) is sharded by fully_shard: its free parameter "
            f"is a DTensor shard (placements {tuple(original.placements)}) and the map's "
            f"{', '.join(local)} are local tensors, so the weight is formed only from the "
            "gathered parameter: call unshard() first on the fully_shard module that holds it, "
            "on every rank (module.unshard(); w = module.weight; module.reshard()), or read "
            "it inside the forward"
        )


def _changed_outside(module: Guards, incompatible_keys: object) -> None:
    module.changed_outside()
