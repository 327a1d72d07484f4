"""How well ``StiefelConfig`` adapters learn, against their PEFT twins, on a task that learns.

The task: a frozen tiny Llama (``LlamaForSequenceClassification`` built from a
config, 2 layers, hidden 32, vocabulary 64, the model's own random init)
classifies token sequences by a majority rule: each sequence holds 16 tokens,
7 of them (at random positions) are ``1`` or ``2``, the others are fillers
drawn from ``3 … 63``; the label says whether ``1`` occurs more often than
``2``. Chance is 0.5; the frozen features with a trained head alone reach about
0.8 held out. The training split has 512 sequences, the held-out split 1024
others, drawn from other seeds.

Each adapter targets ``q_proj``, ``v_proj`` and ``up_proj`` and trains the
classification head in full (``modules_to_save=["score"]``); full-batch AdamW,
100 steps at lr 1e-2, the adapter drawn at the same seed for every row. Printed:
trainable values, lr, the final training loss and the held-out accuracy, the mean
over the seeds, and the ratio of each ``StiefelConfig`` row's loss to its PEFT
twin's (HRA for the reflections, OFT for the Cayley and exp blocks, BOFT for
the butterfly).

Run from a checkout: ``python -m benchmarks.finetune_quality [--seeds 0 1 2] [--lr 1e-2]``;
``--quick`` trains one seed for 10 steps (a smoke run: its losses mean nothing). The
header names the PEFT and transformers versions of the twins.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._timing import versions

TARGETS = ["q_proj", "v_proj", "up_proj"]
VOCAB = 64
LENGTH = 16
MARKED = 7  # odd: never a tie between the two counted tokens
TRAIN, HELD_OUT = 512, 1024


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """The frozen model: a tiny ``LlamaForSequenceClassification`` with its own random init."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_labels=2,
        pad_token_id=0,  # never drawn: the last token is the sequence's last
    )
    return transformers.LlamaForSequenceClassification(config).eval()


def majority(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of the majority rule and their labels (1: token 1 outnumbers token 2)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
    where = torch.rand(n, LENGTH, generator=g).argsort(dim=1)[:, :MARKED]
    marks = torch.randint(1, 3, (n, MARKED), generator=g)
    ids.scatter_(1, where, marks)
    labels = ((marks == 1).sum(1) > (marks == 2).sum(1)).long()
    return ids, labels


Split = tuple[torch.Tensor, torch.Tensor]


def splits(seed: int) -> tuple[Split, Split]:
    """The training and held-out splits of one seed (disjoint generator streams)."""
    return majority(TRAIN, 2 * seed + 1), majority(HELD_OUT, 2 * seed + 2)


def _stiefel(**options: Any) -> Callable[[], Any]:
    def make() -> Any:
        from stiefel.integrations.peft import StiefelConfig

        return StiefelConfig(target_modules=TARGETS, modules_to_save=["score"], **options)

    return make


def _peft(name: str, **options: Any) -> Callable[[], Any]:
    def make() -> Any:
        import peft

        return getattr(peft, name)(target_modules=TARGETS, modules_to_save=["score"], **options)

    return make


@dataclass(frozen=True)
class Adapter:
    """One row: how to build its config, and its PEFT twin (None: a reference row)."""

    label: str
    config: Callable[[], Any]
    twin: str | None = None
    frozen: str | None = None  # parameters whose name holds this do not train


#: the rows, in table order; a StiefelConfig row names its PEFT twin.
ADAPTERS: dict[str, Adapter] = {
    "hra": Adapter("PEFT `HRAConfig(r=8)`", _peft("HRAConfig", r=8)),
    "cwy": Adapter(
        '`StiefelConfig(method="cwy", reflections=8)`', _stiefel(method="cwy", reflections=8), "hra"
    ),
    "householder": Adapter(
        '`StiefelConfig(method="householder", reflections=8)`',
        _stiefel(method="householder", reflections=8),
        "hra",
    ),
    "oft": Adapter(
        "PEFT `OFTConfig(r=0, oft_block_size=8)`", _peft("OFTConfig", r=0, oft_block_size=8)
    ),
    "cayley": Adapter(
        '`StiefelConfig(method="cayley", blocks=4)`', _stiefel(method="cayley", blocks=4), "oft"
    ),
    "exp": Adapter(
        '`StiefelConfig(method="exp", blocks=4)`', _stiefel(method="exp", blocks=4), "oft"
    ),
    "boft": Adapter(
        "PEFT `BOFTConfig(boft_block_size=8, boft_n_butterfly_factor=1)`",
        _peft("BOFTConfig", boft_block_size=8, boft_n_butterfly_factor=1),
    ),
    "boft_rotation": Adapter(
        "PEFT `BOFTConfig(boft_block_size=8, boft_n_butterfly_factor=1)`, `boft_s` frozen",
        _peft("BOFTConfig", boft_block_size=8, boft_n_butterfly_factor=1),
        frozen="boft_s",
    ),
    "butterfly": Adapter(
        '`StiefelConfig(method="cayley", blocks=4, butterfly=1)`',
        _stiefel(method="cayley", blocks=4, butterfly=1),
        "boft_rotation",
    ),
    "butterfly2": Adapter(
        '`StiefelConfig(method="cayley", blocks=4, butterfly=2)`',
        _stiefel(method="cayley", blocks=4, butterfly=2),
    ),
    "lora": Adapter("PEFT `LoraConfig(r=4)` (reference)", _peft("LoraConfig", r=4)),
}


def adapted(name: str, seed: int) -> torch.nn.Module:
    """The frozen model with adapter ``name``, drawn at ``seed`` (the model itself at seed 0)."""
    from peft import get_peft_model

    base = tiny_llama()
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on BOFT's CUDA extension and the like
        model = get_peft_model(base, ADAPTERS[name].config())
    frozen = ADAPTERS[name].frozen
    if frozen is not None:
        for n, p in model.named_parameters():
            if frozen in n:
                p.requires_grad_(False)
    return model


def trainable(model: torch.nn.Module) -> int:
    """The number of values the optimizer updates."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def accuracy(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of sequences whose predicted class is the label."""
    with torch.no_grad():
        return (model(input_ids=ids).logits.argmax(-1) == labels).float().mean().item()


def train(
    model: torch.nn.Module, seed: int, steps: int = 100, lr: float = 1e-2
) -> dict[str, float]:
    """Full-batch AdamW on the training split of ``seed``; the final loss and held-out accuracy."""
    (ids, labels), held_out = splits(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
    model.eval()
    return {"loss": loss.item(), "accuracy": accuracy(model, *held_out)}


def run(name: str, seed: int, steps: int = 100, lr: float = 1e-2) -> dict[str, float]:
    """One adapter, one seed: trainable values, final loss, held-out accuracy."""
    model = adapted(name, seed)
    return {"trainable": trainable(model), **train(model, seed, steps, lr)}


def head_only(seed: int, steps: int = 100, lr: float = 1e-2) -> dict[str, float]:
    """The reference without adapters: only the classification head trains."""
    model = tiny_llama().requires_grad_(False)
    model.score.requires_grad_(True)
    return {"trainable": trainable(model), **train(model, seed, steps, lr)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seed 0, 10 steps (a smoke run)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2")
    parser.add_argument("--steps", type=int, default=None, help="default 100")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-2])
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if args.steps is None:
        args.steps = 10 if args.quick else 100
    print(
        f"# majority rule, frozen tiny Llama, {args.steps} full-batch AdamW steps, "
        f"seeds {args.seeds} (mean; loss ratio: StiefelConfig / its PEFT twin); "
        + versions("peft", "transformers")
    )
    columns = "adapter | trainable values | lr | final train loss | held-out accuracy | loss / twin"
    print(f"| {columns} |")
    print("|---|---|---|---|---|---|")
    for lr in args.lr:
        rows: dict[str, list[dict[str, float]]] = {}
        for name in ["head", *args.adapters]:
            if name == "head":
                rows[name] = [head_only(s, args.steps, lr) for s in args.seeds]
            else:
                rows[name] = [run(name, s, args.steps, lr) for s in args.seeds]
            loss = statistics.mean(r["loss"] for r in rows[name])
            acc = statistics.mean(r["accuracy"] for r in rows[name])
            twin = ADAPTERS[name].twin if name in ADAPTERS else None
            versus = ""
            if twin in rows:
                versus = f"{loss / statistics.mean(r['loss'] for r in rows[twin]):.2f}"
            label = "head only (`score`), no adapter" if name == "head" else ADAPTERS[name].label
            count = int(rows[name][0]["trainable"])
            print(f"| {label} | {count} | {lr:g} | {loss:.4f} | {acc:.3f} | {versus} |", flush=True)


if __name__ == "__main__":
    main()
