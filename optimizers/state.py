r"""What `state_dict` saves beyond torch's, and how an older or foreign state is loaded.

Each param group records its parameters' shapes (``param_shapes``), so that a
state loaded into a model of other shapes is refused with the parameter named
rather than failing later inside a rule; the version record of Note [Points as
the optimizer left them] is never saved; groups saved before geoopt's
``stabilize`` key was kept get it back; state tensors kept in a dtype other than
their parameter's (the float32 master and moments of a low-precision parameter,
pogo's float64 second moment) are reloaded in that dtype, and the rest follows the
parameter's dtype as torch casts it (a float32 run resumes in float64).

Example:
    ```python
    import torch
    from stiefel import optimizers

    w = torch.nn.Parameter(torch.zeros(3))
    sd = optimizers.create("rgd", [w], lr=0.1).state_dict()
    assert sd["param_groups"][0]["param_shapes"] == [[3]]
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from . import master, terms

__all__ = ["pack", "unpack", "after_load"]


def pack(opt, sd: dict[str, Any]) -> dict[str, Any]:
    """torch's ``state_dict`` of ``opt``, with shapes, without version records, manifolds named.

    Note [A group's manifold is saved by name]
    A group's ``manifold`` (e.g. ``geoopt.Euclidean()`` to keep a weight free) is an
    object, which ``torch.load(weights_only=True)``, torch's default, refuses to
    unpickle. It is saved as its repr, and loaded as the object the loading optimizer's
    group holds, when the two reprs agree (`unpack`).
    """
    sd["state"] = {k: master.strip(v) for k, v in sd["state"].items()}
    for saved, group in zip(sd["param_groups"], opt.param_groups, strict=True):
        saved["param_shapes"] = [list(p.shape) for p in group["params"]]
        if saved.get("manifold") is not None:
            saved["manifold"] = repr(saved["manifold"])
    return sd


def _manifold(g: int, saved: object, group: dict) -> object:
    """The manifold object of loaded group ``g`` (Note [A group's manifold is saved by name])."""
    if not isinstance(saved, str):
        return saved  # None, or an object saved whole by an older version
    held = group.get("manifold")
    if held is None or repr(held) != saved:
        raise ValueError(
            f"load_state_dict: param group {g} was saved with manifold={saved} but this "
            f"optimizer's group {g} has manifold={held!r}; allowed: the state of an optimizer "
            "whose groups name the same manifolds"
        )
    return held


def unpack(opt, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict torch's ``load_state_dict`` gets, after checking the shapes.

    Raises:
        ValueError: a parameter's shape differs from the saved one, or a group's
            manifold from the saved one's.
    """
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) == len(opt.param_groups):
        for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
            shapes = saved.get("param_shapes")
            if shapes is None or len(shapes) != len(group["params"]):
                continue  # torch's own check reports a different count
            for i, (shape, p) in enumerate(zip(shapes, group["params"], strict=True)):
                if tuple(shape) != tuple(p.shape):
                    raise ValueError(
                        f"load_state_dict: parameter {i} of param group {g} has shape "
                        f"{tuple(p.shape)} but the state was saved for shape {tuple(shape)}; "
                        "load it into a model of the same shapes"
                    )
    groups = []
    for g, saved in enumerate(saved_groups):
        group = {k: v for k, v in saved.items() if k != "param_shapes"}
        if "manifold" in group and len(saved_groups) == len(opt.param_groups):
            group["manifold"] = _manifold(g, group["manifold"], opt.param_groups[g])
        if any(key in group for key in terms.REPAIR_KEYS):  # saved before `stabilize` was kept
            group.update(dict.fromkeys(terms.REPAIR_KEYS, terms.repair_period(group)))
        groups.append(group)
    # a step count saved as a number (torch before 1.12, a hand-made state) becomes the
    # tensor every rule keeps, as torch's own optimizers convert it
    state = {
        k: {**s, "step": torch.tensor(float(s["step"]), dtype=torch.float32)}
        if isinstance(s, dict) and isinstance(s.get("step"), int | float)
        else s
        for k, s in state_dict.get("state", {}).items()
    }
    return {**state_dict, "param_groups": groups, "state": state}


def after_load(opt, state_dict: dict[str, Any]) -> None:
    """Reload the state tensors torch's load cast in their saved dtypes (`master`)."""
    master.restore_dtypes(opt, state_dict.get("param_groups", []), state_dict.get("state", {}))
