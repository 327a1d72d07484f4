"""The moving_digits task in the harness: registered, baselines declared, every strategy runs."""

import pytest
import torch

from experiments.moving_digits import moving_digits  # registers the task moving_digits
from stiefel.comparisons import tasks
from stiefel.comparisons.grid import plan
from stiefel.comparisons.runner import RunConfig, run

TINY = {"frames": 3, "batch": 2, "size": 16, "width": 2, "test_sequences": 2}
STRATEGIES = [
    "tcwy+adam",
    "riemannian+rgd",
    *(f"{b}+adam" for b in tasks.get("moving_digits").extra_methods),
]


def test_registered_with_its_baselines():
    assert "moving_digits" in tasks.available()
    declared = tasks.extra_methods()
    for baseline in ("convlstm", "zeros", "glorot", "orthinit"):
        assert declared[baseline] == ["moving_digits"]
    assert "moving_digits" not in declared["lstm"] and "copying" in declared["lstm"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_two_steps(strategy):
    rec = run(RunConfig("moving_digits", strategy, 0, 2, record_every=1, task_options=TINY))
    assert len(rec["loss"]) == 2 and not rec["diverged"]
    assert rec["failed"] is None or "above the baseline" in rec["failed"]
    m = rec["metrics"]
    assert m["test_mae"] > 0 and m["parameters"] > 0 and m["peak_memory_mb"] > 0
    assert m["black_mae"] > 0 and m["copy_last_mae"] > 0
    # drift is recorded exactly when a kernel is constrained
    constrained = strategy.split("+")[0] not in tasks.get("moving_digits").extra_methods
    assert (rec["drift"][0] is not None) == constrained
    if constrained:
        assert max(rec["drift"]) < 1e-4


def test_baselines_of_other_tasks_are_reported_not_run():
    opts = {
        "tasks": ["moving_digits", "copying"],
        "strategies": ["tcwy+adam", "convlstm+adam", "lstm+adam"],
        "others": "adam(lr=1e-3)",
        "dtypes": ["float32"],
        "seeds": 1,
        "steps": 1,
        "device": "cpu",
        "record_every": 1,
        "task_options": {},
    }
    jobs, skipped = plan(opts)
    ran = {(j.task, j.strategy) for j in jobs}
    assert ran == {
        ("moving_digits", "tcwy+adam"),
        ("moving_digits", "convlstm+adam"),
        ("copying", "tcwy+adam"),
        ("copying", "lstm+adam"),
    }
    lstm_tasks = ", ".join(tasks.extra_methods()["lstm"])
    assert skipped == [
        f"lstm+adam on moving_digits: 'lstm' is a method of the task(s) {lstm_tasks} only "
        "(the LSTM baseline)",
        "convlstm+adam on copying: 'convlstm' is a method of the task(s) moving_digits only "
        "(the ConvLSTM baseline)",
    ]
    with pytest.raises(ValueError, match=r"'convlstm' is a method of the task\(s\) moving_d"):
        run(RunConfig("copying", "convlstm+adam", steps=1))


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="loss='l2'; allowed: mse, l1"):
        run(RunConfig("moving_digits", "tcwy+adam", steps=1, task_options={**TINY, "loss": "l2"}))
    with pytest.raises(ValueError, match="frames=1; allowed: an integer >= 2"):
        run(RunConfig("moving_digits", "tcwy+adam", steps=1, task_options={**TINY, "frames": 1}))
    for speed in (-1, 9):  # a negative speed, or two bounces in one frame (size 16)
        opts = {**TINY, "max_speed": speed}
        with pytest.raises(ValueError, match=rf"max_speed={speed}; allowed: an int in \[0, 8\]"):
            run(RunConfig("moving_digits", "tcwy+adam", steps=1, task_options=opts))
    with pytest.raises(ValueError, match="test_sequences=0 is not allowed"):
        opts = {**TINY, "test_sequences": 0}
        run(RunConfig("moving_digits", "tcwy+adam", steps=1, task_options=opts))
    with pytest.raises(ValueError, match="task 'moving_digits': size=20; allowed: a multiple of 8"):
        run(RunConfig("moving_digits", "tcwy+adam", steps=1, task_options={**TINY, "size": 20}))


def test_the_fastest_digits_stay_inside_the_frame():
    """max_speed = size − 8: every step at most one bounce, every frame holds its digits."""
    images = torch.ones(3, 8, 8)
    g = torch.Generator().manual_seed(0)
    video = moving_digits(images, 16, 12, size=16, max_digits=1, max_speed=8, generator=g)
    assert torch.equal(video.sum((-3, -2, -1)), torch.full((16, 12), 64.0))
