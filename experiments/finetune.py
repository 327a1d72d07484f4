r"""Fine-tuning a small pretrained transformer on a shifted task with adapters.

The base is a `experiments.transformer.TinyEncoder` trained
from its seed on scikit-learn's 8×8 digits (tokens = the 8 rows of 8 pixels;
a few seconds on a CPU, then kept in memory for the process). It is then
frozen and fine-tuned on a *shifted* task with an adapter on the Linear
layers of its blocks (task option ``targets``), and the held-out accuracy on
the shifted task is measured.

Strategies name the adapter as their method part:

- ``lora``, ``peft_hra``, ``peft_oft``, ``peft_boft``: HuggingFace PEFT's
  adapters; the options are those of its ``LoraConfig``, ``HRAConfig``,
  ``OFTConfig``, ``BOFTConfig`` (defaults in `ADAPTERS`);
- ``rotate``: `stiefel.rotate` on every target, with its options
  (``method``, ``side``, ``blocks``, ``butterfly``, the map's options) and
  ``block_size=s``, which gives each layer ``blocks = features / s`` (the way
  PEFT's OFT and BOFT size their blocks);
- a registered map or ``riemannian``: short for ``rotate(method=NAME, ...)``.

Note [Orthogonality error of the adapters' Q]
The drift recorded at every recorded step is max over the adapted layers of
‖QᵀQ − I‖_F, Q the layer's dense rotation: `stiefel.rotation` for
`stiefel.rotate`, and for PEFT's layers Q rebuilt with PEFT's own functions
(HRA ``get_delta_weight``, OFT ``oft_R[a].get_weight()``, BOFT
``get_delta_weight``'s rotation; BOFT's scale ``boft_s`` is not part of Q).
PEFT's OFT builds its blocks with a truncated Cayley–Neumann series, which
is orthogonal only while its parameters are small; LoRA has no Q (none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments import real_dtype
from experiments.transformer import BLOCK_LINEARS, TinyEncoder
from stiefel._core import checks as _checks
from stiefel.comparisons.cost import fastest_time, peak_bytes
from stiefel.comparisons.task import (
    Classification,
    Task,
    digits_split,
    positive_int,
    register,
)
from stiefel.parametrizations import Rotation, available, rotate

__all__ = ["Finetune", "ADAPTERS", "SHIFTS"]

#: PEFT adapters by strategy method: the config class of ``peft`` and the task's defaults
ADAPTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora": ("LoraConfig", {"r": 8, "lora_alpha": 8}),
    "peft_hra": ("HRAConfig", {"r": 8}),
    "peft_oft": ("OFTConfig", {"r": 0, "oft_block_size": 8}),
    "peft_boft": ("BOFTConfig", {"boft_block_size": 8, "boft_n_butterfly_factor": 1}),
}
ROTATE = "rotate"

#: the shifted tasks: (images, labels) ↦ (images, labels)
SHIFTS = {
    "mirror": lambda x, y: (x.flip(-1), y),  # each row (token) read right to left
    "transpose": lambda x, y: (x.transpose(-1, -2), y),  # columns as tokens
    "labels": lambda x, y: (x, (y + 1) % 10),  # same images, every label moved by one
}

_BASES: dict[tuple, tuple[dict[str, torch.Tensor], float]] = {}


def _digits(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    x, y, xt, yt = digits_split("finetune", generator)
    return (x - 0.3) / 0.4, y, (xt - 0.3) / 0.4, yt


@register("finetune")
class Finetune(Classification, Task):
    """Adapters on a pretrained tiny transformer, fine-tuned on shifted digits.

    Metrics: ``test_accuracy`` on the shifted test set, ``base_accuracy`` (the
    frozen base on the same set, before fine-tuning), ``trainable_parameters``,
    ``step_ms`` (forward + backward of one batch, the fastest of 5) and
    ``peak_mib`` (the harness's peak memory of that step). Drift: Note
    [Orthogonality error of the adapters' Q].
    """

    kind = "finetune"
    extra_methods = {
        "lora": "PEFT LoRA (peft.LoraConfig options)",
        "peft_hra": "PEFT HRA (peft.HRAConfig options)",
        "peft_oft": "PEFT OFT (peft.OFTConfig options)",
        "peft_boft": "PEFT BOFT (peft.BOFTConfig options)",
        ROTATE: "stiefel.rotate on every target (its options, block_size=s)",
    }
    table_metrics = ("test_accuracy", "base_accuracy", "trainable_parameters", "step_ms")
    table_metrics += ("peak_mib",)

    def __init__(
        self,
        dtype,
        device,
        seed,
        width: int = 32,
        layers: int = 2,
        heads: int = 4,
        pretrain_steps: int = 400,
        batch: int = 64,
        shift: str = "mirror",
        targets: str = ",".join(BLOCK_LINEARS),
    ):
        super().__init__(dtype, device, seed)
        real_dtype(self.name, dtype)
        self.width = positive_int(self.name, "width", width)
        self.layers = positive_int(self.name, "layers", layers)
        self.heads = positive_int(self.name, "heads", heads)
        self.pretrain_steps = positive_int(self.name, "pretrain_steps", pretrain_steps)
        self.batch = positive_int(self.name, "batch", batch)
        if width % heads:
            raise ValueError(f"task 'finetune': width={width} is not divisible by heads={heads}")
        if shift not in SHIFTS:
            raise ValueError(f"task 'finetune': shift={shift!r}; allowed: {', '.join(SHIFTS)}")
        names = [t.strip() for t in str(targets).split(",") if t.strip()]
        bad = [t for t in names if t not in BLOCK_LINEARS]
        if not names or bad:
            raise ValueError(
                f"task 'finetune': targets={targets!r}; allowed: a comma-separated subset of "
                f"{', '.join(BLOCK_LINEARS)}"
            )
        self.shift, self.targets, self._targets = shift, targets, names
        x, y, xt, yt = _digits(self.generator)
        self.x_base, self.y_base = x.to(device, dtype), y.to(device)
        sx, sy = SHIFTS[shift](x, y)
        self.x_train, self.y_train = sx.to(device, dtype), sy.to(device)
        sxt, syt = SHIFTS[shift](xt, yt)
        self.x_test, self.y_test = sxt.to(device, dtype), syt.to(device)
        self.x_base_test, self.y_base_test = xt.to(device, dtype), yt.to(device)
        self.baseline = math.log(10)
        self.chance = {"test_accuracy": 0.1}

    # ----------------------------------------------------------------- the base
    def _model(self) -> TinyEncoder:
        return TinyEncoder(8, 8, 10, self.width, self.layers, self.heads, self.dtype).to(
            self.device
        )

    def _key(self) -> tuple:
        return (self.seed, self.dtype, str(self.device), self.width, self.layers, self.heads)

    def pretrained(self) -> TinyEncoder:
        """The frozen base: trained from the seed on the unshifted digits (cached per process)."""
        key = (*self._key(), self.pretrain_steps)
        if key not in _BASES:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = self._model()
                gen = torch.Generator().manual_seed(self.seed)
                opt = torch.optim.Adam(model.parameters(), lr=3e-3)
                for _ in range(self.pretrain_steps):
                    idx = torch.randint(0, len(self.y_base), (self.batch,), generator=gen)
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(self.x_base[idx]), self.y_base[idx]).backward()
                    opt.step()
            with torch.no_grad():
                acc = float((model(self.x_base_test).argmax(-1) == self.y_base_test).float().mean())
            _BASES[key] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, acc)
        model = self._model()
        model.load_state_dict(_BASES[key][0])
        return model.requires_grad_(False)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        key = (*self._key(), self.pretrain_steps)
        if key in _BASES:
            out["pretrained_accuracy"] = _BASES[key][1]  # the base on the unshifted test set
        return out

    # ----------------------------------------------------------------- adapters
    def _layers(self, model: nn.Module) -> list[nn.Linear]:
        return [getattr(block, t) for block in model.blocks for t in self._targets]

    def adapt(self, model: nn.Module, method: str, options: dict[str, Any]) -> nn.Module:
        """Put the strategy's adapter on ``model``'s targets (ValueError/TypeError if it cannot)."""
        listed = ", ".join(f"{k}={v}" for k, v in options.items())
        where = f"finetune strategy method {method}({listed})"
        if method in ADAPTERS:
            return self._peft(model, method, options, where)
        if method == ROTATE:
            kw = dict(options)
        elif method in available():
            if "method" in options:
                raise ValueError(f"{where}: method= is given by the name {method!r}; drop it")
            kw = {"method": method, **options}
        else:
            allowed = [*self.extra_methods, *available()]
            raise ValueError(f"{where}: unknown method {method!r}; allowed: {', '.join(allowed)}")
        size = kw.pop("block_size", None)
        if size is not None and "blocks" in kw:
            raise ValueError(f"{where}: give blocks= or block_size=, not both")
        if size is not None:
            try:
                _checks.positive_int("block_size", size)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        for layer in self._layers(model):
            args = dict(kw)
            if size is not None:
                features = layer.out_features if kw.get("side") == "output" else layer.in_features
                if features % size:
                    raise ValueError(
                        f"{where}: block_size={size} does not divide a target's {features} "
                        "features; allowed: a divisor of every target's features"
                    )
                args["blocks"] = features // size
            try:
                rotate(layer, **args)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {exc}") from exc
        return model

    def _peft(self, model: nn.Module, method: str, options: dict, where: str) -> nn.Module:
        import peft

        cls_name, defaults = ADAPTERS[method]
        cls = getattr(peft, cls_name)
        fields = {f.name for f in dataclasses.fields(cls)} - {"target_modules"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(
                f"{where}: unknown option(s) {', '.join(unknown)} of peft.{cls_name}; allowed: "
                f"{', '.join(sorted(fields))} (targets are the task option 'targets')"
            )
        try:
            config = cls(target_modules=list(self._targets), **{**defaults, **options})
            peft.inject_adapter_in_model(config, model)  # marks only its own parameters trainable
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
        return model

    def check_method(self, method: str, options: dict[str, Any]) -> None:
        """Build the adapter on an untrained base: bad names and options raise here."""
        self.adapt(self._model().requires_grad_(False), method, dict(options))

    def build(self, method: str, method_options: dict) -> nn.Module:
        return self.adapt(self.pretrained(), method, dict(method_options))

    def constrained(self, model: nn.Module) -> nn.Module:
        """The adapters (every trainable parameter): the strategy's optimizer trains them."""
        return nn.ParameterList([p for p in model.parameters() if p.requires_grad])

    def weight(self, model: nn.Module) -> torch.Tensor | None:
        """Every adapter's Q, padded with I to one size: (layers, N, N); None without a Q."""
        qs = [q for m in model.modules() for q in rotations(m)]
        if not qs:
            return None
        size = max(q.shape[-1] for q in qs)
        out = torch.eye(size, dtype=qs[0].dtype, device=qs[0].device).repeat(len(qs), 1, 1)
        for i, q in enumerate(qs):
            out[i, : q.shape[-1], : q.shape[-1]] = q
        return out

    # ----------------------------------------------------------------- training
    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        logits = model(self.x_test)
        base = self.pretrained()(self.x_test)
        x, y = self.minibatch()

        def step() -> None:
            with torch.enable_grad():
                F.cross_entropy(model(x), y).backward()

        seconds = fastest_time(step, repeats=5)
        peak = peak_bytes(step, self.device)
        model.zero_grad(set_to_none=True)
        return {
            **self.test_metrics(logits),
            "base_accuracy": float((base.argmax(-1) == self.y_test).float().mean()),
            "trainable_parameters": float(
                sum(p.numel() for p in model.parameters() if p.requires_grad)
            ),
            "step_ms": 1e3 * seconds,
            "peak_mib": peak / 2**20,
        }


def rotations(module: nn.Module) -> list[torch.Tensor]:
    """The dense Q of each adapter of ``module`` itself (not its children); [] for none.

    `stiefel.rotate`'s Q; PEFT's HRA, OFT and BOFT Q rebuilt by PEFT's own
    functions (Note [Orthogonality error of the adapters' Q]).
    """
    rot = getattr(module, "rotation", None)
    if isinstance(rot, Rotation):
        return [rot.matrix()]
    if not type(module).__module__.startswith("peft.tuners."):
        return []
    from peft.tuners.boft.layer import BOFTLayer
    from peft.tuners.hra.layer import HRALayer
    from peft.tuners.oft.layer import OFTLayer

    if isinstance(module, HRALayer):
        return [module.get_delta_weight(a) for a in module.active_adapters if a in module.hra_u]
    if isinstance(module, OFTLayer):
        return [module.oft_R[a].get_weight() for a in module.active_adapters if a in module.oft_R]
    if isinstance(module, BOFTLayer):
        return [module.get_delta_weight(a)[0] for a in module.active_adapters if a in module.boft_R]
    return []
