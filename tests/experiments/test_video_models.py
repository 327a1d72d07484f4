"""The moving-digits generator, the video bottleneck (ConvNERU variants, ConvLSTM) and the task."""

import pytest
import torch

from experiments.moving_digits import MovingDigits, moving_digits
from experiments.video_models import VideoPredictor, parameter_count
from stiefel.manifolds.kernels import orthogonality_error


def test_moving_digits_bounce_inside_the_frame():
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(5, 8, 8)
    video = moving_digits(images, 6, 30, size=16, max_digits=1, generator=gen)
    assert video.shape == (6, 30, 1, 16, 16)
    assert video.min() >= 0 and video.max() <= 1
    # one digit, never clipped: every frame holds one whole image of the set
    totals = video.sum((-3, -2, -1))
    assert torch.allclose(totals, totals[:, :1].expand_as(totals), rtol=1e-5)
    assert any(torch.isclose(totals[0, 0], img.sum(), rtol=1e-5) for img in images)
    moved = (video[:, 1:] - video[:, :-1]).abs().sum((-3, -2, -1)) > 0
    assert moved.float().mean() > 0.5  # digits move (a zero velocity is rare)
    two = moving_digits(images, 4, 3, size=16, max_digits=2, generator=gen)
    assert two.max() <= 1


@pytest.mark.parametrize(
    "recurrent", ["convlstm", "zeros", "glorot", "orthinit", "tcwy", "riemannian"]
)
def test_video_predictor_variants(recurrent):
    torch.manual_seed(0)
    model = VideoPredictor(recurrent, channels=(2, 4, 8), generator=torch.Generator())
    frames = torch.rand(2, 3, 1, 16, 16)
    y = model(frames)
    assert y.shape == frames.shape and torch.isfinite(y).all()
    (y - frames).abs().mean().backward()
    convs = model.recurrent_convolutions()
    if recurrent == "convlstm":
        assert convs == []
    elif recurrent == "glorot":
        assert all(c.weight.requires_grad for c in convs)
    elif recurrent == "zeros":
        assert all(c.weight.abs().sum() == 0 and not c.weight.requires_grad for c in convs)
    elif recurrent == "orthinit":  # unconstrained, but started with √k·K̂ on St(9c, c)
        for c in convs:
            t = c.weight.detach().reshape(c.weight.shape[0], -1).T * 3
            assert float(orthogonality_error(t.double())) < 1e-5
    else:
        for c in convs:
            t = c.parametrizations.weight[0].kernel_matrix(c.weight).detach()
            assert float(orthogonality_error(t.double())) < 1e-5


def test_convneru_bottleneck_has_fewer_parameters_than_convlstm():
    neru = parameter_count(VideoPredictor("tcwy", channels=(8, 16, 32)))
    lstm = parameter_count(VideoPredictor("convlstm", channels=(8, 16, 32)))
    assert lstm > 2 * neru


def test_task_loss_metrics_and_drift():
    task = MovingDigits(
        torch.float32,
        torch.device("cpu"),
        0,
        frames=3,
        batch=2,
        size=16,
        width=2,
        test_sequences=2,
    )
    model = task.build("tcwy", {})
    loss = task.loss(model, 0)
    assert torch.isfinite(loss) and loss.requires_grad
    metrics = task.evaluate(model)
    assert set(metrics) == {
        "test_mae",
        "test_frame_mae",
        "parameters",
        "peak_memory_mb",
        "copy_last_mae",
        "black_mae",
    }
    assert metrics["peak_memory_mb"] > 0  # measured on CPU too (cost.peak_bytes)
    assert metrics["black_mae"] == pytest.approx(float(task.test[:, 1:].mean()))
    assert metrics["test_frame_mae"] == pytest.approx(metrics["test_mae"] * 256, rel=1e-4)
    black_mse = float(task.test[:, 1:].pow(2).mean())  # the default loss is the MSE
    assert 0 < task.baseline <= black_mse
    assert float(orthogonality_error(task.weight(model).detach().double())) < 1e-5
    assert len(list(task.constrained(model).parameters())) > 0
    free = task.build("glorot", {})
    assert task.weight(free) is None and len(list(task.constrained(free).parameters())) == 0
    with pytest.raises(ValueError, match="size=20; allowed: a multiple of 8"):
        MovingDigits(torch.float32, torch.device("cpu"), 0, size=20)
