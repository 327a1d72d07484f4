"""The finetune task: adapters on a tiny pretrained transformer, each run briefly."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
pytest.importorskip("sklearn")

from experiments.finetune import ADAPTERS, rotations  # noqa: E402
from stiefel.comparisons import cli, tasks  # noqa: E402
from stiefel.comparisons.grid import plan  # noqa: E402
from stiefel.comparisons.runner import RunConfig, run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT BOFT: no CUDA extension

#: tiny sizes: width 8 (heads 2), one block; the MLP's down projection has 16 inputs
TINY = {"width": 8, "layers": 1, "heads": 2, "pretrain_steps": 3, "batch": 8}
STRATEGIES = [
    "lora(r=2)+adam",
    "peft_hra(r=4)+adam",
    "peft_oft(oft_block_size=4)+adam",
    "peft_boft(boft_block_size=4)+adam",
    "rotate(method=cwy,reflections=4)+adam",
    "rotate(method=householder,reflections=4)+adam",
    "rotate(method=cayley,block_size=4)+adam",
    "rotate(method=cayley,blocks=2,butterfly=2)+adam",
    "rotate(method=riemannian)+rgd",
    "exp(side=output)+adam",  # a map's name: short for rotate(method=exp, ...)
]


def _opts(strategies, **task_options):
    return {
        "tasks": ["finetune"],
        "strategies": strategies,
        "others": "adam(lr=1e-3)",
        "task_options": {**TINY, **task_options},
        "dtypes": ["float32"],
        "seeds": 1,
        "steps": 2,
        "device": "cpu",
        "record_every": 1,
    }


def _task(**kw):
    return tasks.make("finetune", torch.float32, torch.device("cpu"), 0, **{**TINY, **kw})


def test_registered_with_its_methods():
    assert "finetune" in tasks.available()
    opts = tasks.options("finetune")
    assert {"width", "layers", "shift", "targets", "pretrain_steps"} <= set(opts)
    extra = tasks.extra_methods()
    for method in [*ADAPTERS, "rotate"]:
        assert extra[method] == ["finetune"]


def test_every_method_of_the_task_is_in_the_strategies():
    named = {s.split("(")[0].split("+")[0] for s in STRATEGIES}
    assert set(tasks.get("finetune").extra_methods) <= named


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_two_steps(strategy):
    record = run(RunConfig("finetune", strategy, steps=2, record_every=1, task_options=TINY))
    assert not record["diverged"] and all(math.isfinite(v) for v in record["loss"])
    m = record["metrics"]
    assert 0 <= m["test_accuracy"] <= 1 and 0 <= m["base_accuracy"] <= 1
    assert m["trainable_parameters"] > 0 and m["step_ms"] > 0 and m["peak_mib"] > 0
    if strategy.startswith("lora"):
        assert record["drift"] == [None, None]  # LoRA has no Q
    else:
        assert all(d is not None and math.isfinite(d) for d in record["drift"])


def test_only_the_adapters_train_and_the_base_is_untouched():
    task = _task()
    base = task.pretrained().state_dict()
    for method, options in [("lora", {"r": 2}), ("rotate", {"reflections": 4})]:
        model = task.build(method, options)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert names and all(("lora_" in n) or (".rotation." in n) for n in names)
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        for name, value in base.items():  # every base tensor kept, under PEFT's names too
            match = [p for n, p in frozen.items() if n.replace(".base_layer", "") == name]
            assert match and torch.equal(match[0], value)


@pytest.mark.parametrize(
    ("method", "options", "law"),
    [  # how each layer's output follows from its Q: F.linear(x, W·Q) or F.linear(x, W·Qᵀ)
        ("peft_hra", {"r": 4}, "WQ"),
        ("peft_oft", {"oft_block_size": 4}, "WQt"),
        ("peft_boft", {"boft_block_size": 4}, "WQt"),
        ("rotate", {"method": "cayley", "blocks": 2, "butterfly": 2}, "WQ"),
    ],
)
def test_the_recorded_q_is_the_rotation_the_layer_applies(method, options, law):
    torch.manual_seed(0)
    model = _task().build(method, options)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))  # away from the identity
    for name in ("q", "down"):
        layer = getattr(model.blocks[0], name)
        base = getattr(layer, "base_layer", layer)
        (q,) = rotations(layer)
        q = q.detach()
        assert not torch.allclose(q, torch.eye(len(q)), atol=1e-3)
        x = torch.randn(5, base.in_features)
        w = base.weight @ (q if law == "WQ" else q.T)
        if method == "peft_boft":  # BOFT scales the rotated output by boft_s (not part of Q)
            expected = F.linear(x, w) * layer.boft_s["default"].squeeze(-1) + base.bias
        else:
            expected = F.linear(x, w, base.bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        "rotate(method=cwy,reflections=4)+adam(lr=0.1)",
        "rotate(method=cayley,block_size=4)+adam(lr=0.1)",
        "rotate(method=cayley,blocks=2,butterfly=2)+adam(lr=0.1)",
        "rotate(method=riemannian)+rgd(lr=0.5)",
    ],
)
def test_rotate_stays_orthogonal_to_dtype_tolerance(strategy):
    record = run(RunConfig("finetune", strategy, steps=25, record_every=5, task_options=TINY))
    n = 2 * TINY["width"]  # the largest Q (the down projection's inputs)
    assert max(record["drift"]) <= 10 * n * torch.finfo(torch.float32).eps


def test_peft_oft_drift_is_measured():
    """The same measurement sees PEFT OFT's Cayley–Neumann series leave O(n) (large steps)."""
    strategy = "peft_oft(oft_block_size=4)+adam(lr=0.1)"
    record = run(RunConfig("finetune", strategy, steps=25, record_every=5, task_options=TINY))
    q = _task().weight(_task().build("peft_oft", {"oft_block_size": 4}))
    assert float((q.mT @ q - torch.eye(q.shape[-1])).norm(dim=(-2, -1)).max()) <= 1e-6  # Q = I
    assert max(record["drift"]) > 1e-3


@pytest.mark.parametrize(
    ("strategy", "error", "message"),
    [
        ("peft_oft(bogus=1)+adam", ValueError, r"unknown option\(s\) bogus of peft.OFTConfig"),
        ("lora(target_modules=q)+adam", ValueError, r"targets are the task option 'targets'"),
        ("rotate(method=cwy,bogus=1)+adam", TypeError, r"unknown option\(s\) bogus .*cwy"),
        ("rotate(method=nope)+adam", ValueError, r"method='nope' is not supported; allowed: "),
        ("rotate(block_size=3)+adam", ValueError, r"block_size=3 does not divide .* 8 features"),
        ("rotate(blocks=2,block_size=4)+adam", ValueError, r"blocks= or block_size=, not both"),
        ("rotate(method=cayley,blocks=3)+adam", ValueError, r"blocks=3 does not divide"),
        ("cwy(method=exp)+adam", ValueError, r"method= is given by the name 'cwy'"),
    ],
)
def test_bad_strategy_options_are_refused_before_training(strategy, error, message):
    with pytest.raises(error, match=message):
        plan(_opts([strategy]))


def test_bad_options_refused_by_the_command_line(tmp_path):
    argv = ["convergence", "--tasks", "finetune", "--steps", "2", "--out", str(tmp_path / "o")]
    with pytest.raises(ValueError, match=r"'peft_hra\(bogus=1\)\+adam' on task 'finetune'"):
        cli.main([*argv, "--strategies", "peft_hra(bogus=1)+adam", "--task-option", "width=8"])
    with pytest.raises(ValueError, match=r"shift='flip'; allowed: mirror, transpose, labels"):
        cli.main([*argv, "--strategies", "lora+adam", "--task-option", "shift='flip'"])
    assert not (tmp_path / "o" / "runs").exists()


def test_adapters_of_one_task_are_skipped_on_the_others():
    opts = _opts(["lora+adam", "cwy+adam"]) | {"tasks": ["procrustes"], "task_options": {"n": 4}}
    jobs, skipped = plan(opts)
    assert [j.strategy for j in jobs] == ["cwy+adam"]
    assert skipped == [
        "lora+adam on procrustes: 'lora' is a method of the task(s) finetune only "
        f"({tasks.get('finetune').extra_methods['lora']})"
    ]
    with pytest.raises(ValueError, match=r"every strategy given cannot run on it .*finetune only"):
        plan(opts | {"strategies": ["lora+adam"]})


@pytest.mark.parametrize("shift", ["mirror", "transpose", "labels"])
def test_shifts_change_the_task(shift):
    task = _task(shift=shift)
    same_x = torch.equal(task.x_train, task.x_base)
    same_y = torch.equal(task.y_train, task.y_base)
    assert not (same_x and same_y)
    assert same_y if shift != "labels" else same_x
