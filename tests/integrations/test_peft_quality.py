"""``StiefelConfig`` adapters learn as well as their PEFT twins, on a task that learns.

The task (`benchmarks.finetune_quality`): a frozen tiny Llama classifies
token sequences by a majority rule, with a held-out split; 100 full-batch
AdamW steps at lr 1e-2, the same seed and the same number of trainable values
for both adapters of a pair. The references are PEFT's own adapters of the same
map class, trained the same way: HRA for the reflection maps, OFT for the
Cayley and exp blocks, BOFT (its output scale ``boft_s`` frozen: the rotation
alone) for the butterfly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
from stiefel.benchmarks import finetune_quality as quality  # noqa: E402

LOSS_RATIO = 1.2  # ours may end at most 1.2× its twin's final training loss
ACCURACY_MARGIN = 0.02  # and at most 0.02 below its twin's held-out accuracy (1024 sequences)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the benchmark runs: the reductions' order, hence the numbers, are
    those of the table in docs/finetuning.md."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_values(model) -> int:
    """Trainable values, counting only the free part of PEFT BOFT's full s×s skew blocks."""
    total = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "boft_R" in name:  # (factors, blocks, s, s), used through (R − Rᵀ)/2
            s = p.shape[-1]
            total += p[..., 0, 0].numel() * s * (s - 1) // 2
        else:
            total += p.numel()
    return total


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ours", "twin"),
    [
        ("cwy", "hra"),
        ("householder", "hra"),
        ("cayley", "oft"),
        ("exp", "oft"),
        ("butterfly", "boft_rotation"),
    ],
)
def test_trains_as_well_as_its_peft_twin(ours, twin):
    seed = 0
    model, reference = quality.adapted(ours, seed), quality.adapted(twin, seed)
    assert quality.trainable(model) == _free_values(reference)
    mine, theirs = quality.train(model, seed), quality.train(reference, seed)
    assert theirs["accuracy"] > 0.85, theirs  # the task learns (chance: 0.5)
    assert mine["loss"] <= LOSS_RATIO * theirs["loss"], (mine, theirs)
    assert mine["accuracy"] >= theirs["accuracy"] - ACCURACY_MARGIN, (mine, theirs)


@pytest.mark.slow
def test_the_criterion_sees_a_start_ten_times_farther_out():
    """Paired vectors ten times longer (still Q = I) train as lr/10: the 1.2× bound catches it.

    The reflections depend only on v/‖v‖ and Adam moves each entry by about
    lr, so the start's scale is the map's step scale; the bound above must not
    pass a start of the wrong scale.
    """
    seed = 0
    model = quality.adapted("cwy", seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "stiefel_R" in name:
                p.mul_(10.0)
    mine = quality.train(model, seed)
    reference = quality.train(quality.adapted("hra", seed), seed)
    assert mine["loss"] > LOSS_RATIO * reference["loss"], (mine, reference)


@pytest.mark.slow
def test_the_adapters_matter_on_the_task():
    """PEFT HRA beats the trained head alone on held-out sequences (the task needs the adapter)."""
    seed = 0
    head = quality.head_only(seed)
    hra = quality.train(quality.adapted("hra", seed), seed)
    assert head["trainable"] == 64
    assert hra["accuracy"] > head["accuracy"] + 0.05, (hra, head)
    assert hra["loss"] < head["loss"] / 2, (hra, head)
