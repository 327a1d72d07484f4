"""One-step-ahead video prediction on moving scikit-learn digits (offline stand-in for KTH).

Sequences of ``size``×``size`` frames in which 1–2 of scikit-learn's bundled
8×8 digits (brightness in [0, 1]) move with constant integer velocity and
bounce off the borders; overlapping digits combine by max. Train and test
sequences use disjoint digit images (1397 / 400, split by the seed); the test
set is a fixed set of sequences. The model predicts frame t + 1 from frames
1…t.

Note [Loss of the moving digits]

The CWY paper trains its KTH models with the ℓ₁ loss. On sparse frames (a
digit covers ≤ 2·64 of 1024 pixels) the ℓ₁ minimiser of an uncertain pixel is
its median, 0: every model of a small CPU budget collapsed to the black frame
(test MAE 0.0343 = the black-frame MAE, for every strategy). The default loss
is therefore the mean squared error, whose minimiser is the conditional mean
(a blurred digit where the motion is uncertain, which has a smaller MAE than
black); ``loss="l1"`` gives the paper's loss. The metric stays the test MAE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from experiments import real_dtype
from experiments.video_models import VARIANTS, VideoPredictor, parameter_count
from stiefel.comparisons.task import Task, digits_split, positive_int, register

__all__ = ["MovingDigits", "moving_digits"]


def _digit_images(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    train, _, test, _ = digits_split("moving_digits", generator)
    return train, test


def moving_digits(
    images: torch.Tensor,
    batch: int,
    frames: int,
    size: int = 32,
    max_digits: int = 2,
    max_speed: int = 3,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sequences of bouncing digits: (batch, frames, 1, size, size) in [0, 1].

    Args:
        images: digit images (N, 8, 8) in [0, 1].
        batch: number of sequences.
        frames: frames per sequence.
        size: frame height and width (≥ 8).
        max_digits: each sequence has 1…max_digits digits.
        max_speed: velocities are integers in [−max_speed, max_speed] per axis
            (0 ≤ max_speed ≤ size − 8: one bounce per step keeps a digit inside).
        generator: random generator.

    Returns:
        The sequences.
    """
    span = size - 8
    if not 0 <= max_speed <= span:
        raise ValueError(f"max_speed={max_speed}; allowed: an int in [0, {span}] (size - 8)")
    video = torch.zeros(batch, frames, 1, size, size)
    for b in range(batch):
        count = int(torch.randint(1, max_digits + 1, (1,), generator=generator))
        for _ in range(count):
            img = images[int(torch.randint(len(images), (1,), generator=generator))]
            pos = torch.randint(0, span + 1, (2,), generator=generator)
            vel = torch.randint(-max_speed, max_speed + 1, (2,), generator=generator)
            for t in range(frames):
                r, c = int(pos[0]), int(pos[1])
                patch = video[b, t, 0, r : r + 8, c : c + 8]
                torch.maximum(patch, img, out=patch)
                pos = pos + vel
                for axis in range(2):  # bounce: reflect the position and the velocity
                    if pos[axis] < 0:
                        pos[axis], vel[axis] = -pos[axis], -vel[axis]
                    elif pos[axis] > span:
                        pos[axis], vel[axis] = 2 * span - pos[axis], -vel[axis]
    return video


_LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss}


@register("moving_digits")
class MovingDigits(Task):
    """One-step-ahead prediction of moving digits with the CWY paper's recurrent bottleneck.

    ``build(method)`` takes a map of ``orthogonalize`` (``"tcwy"``,
    ``"riemannian"``, ...) constraining the ConvNERU kernels, or one of the
    baselines it declares (``extra_methods``: the unconstrained rows of the
    paper's Table 5 and ConvLSTM). Metrics: test MAE per pixel, per-frame MAE (summed over a
    frame's pixels, averaged over frames, as the paper's Table 5), the number
    of parameters, and the peak memory of a training step (CUDA's allocator
    statistic; on CPU the bytes torch ops hold, `complexity.peak_bytes`), and
    the MAE of the two trivial predictors (the last frame; a black frame).
    """

    kind = "video"
    extra_methods = {
        "convlstm": "the ConvLSTM baseline",
        "zeros": "the zero-K ConvNERU baseline",
        "glorot": "the unconstrained ConvNERU (Glorot init) baseline",
        "orthinit": "the unconstrained ConvNERU (orthogonal init) baseline",
    }
    table_metrics = ("test_mae", "test_frame_mae", "parameters", "peak_memory_mb")

    def __init__(
        self,
        dtype,
        device,
        seed,
        frames: int = 8,
        batch: int = 8,
        size: int = 32,
        width: int = 8,
        kernel_size: int = 3,
        test_sequences: int = 32,
        max_speed: int = 2,
        loss: str = "mse",
    ):
        super().__init__(dtype, device, seed)
        real_dtype(self.name, dtype)
        if size % 8 or size < 16:
            raise ValueError(
                f"task 'moving_digits': size={size}; allowed: a multiple of 8, at least 16"
            )
        if isinstance(max_speed, bool) or not isinstance(max_speed, int):
            raise ValueError(f"task 'moving_digits': max_speed={max_speed!r}; allowed: an int")
        if not 0 <= max_speed <= size - 8:
            raise ValueError(
                f"task 'moving_digits': max_speed={max_speed}; allowed: an int in "
                f"[0, {size - 8}] (size - 8: a digit bounces at most once per frame)"
            )
        test_sequences = positive_int(self.name, "test_sequences", test_sequences)
        if positive_int(self.name, "frames", frames) < 2:
            raise ValueError(f"task 'moving_digits': frames={frames}; allowed: an integer >= 2")
        if loss not in _LOSSES:
            raise ValueError(f"task 'moving_digits': loss={loss!r}; allowed: {', '.join(_LOSSES)}")
        self.frames, self.size, self.loss_name = frames, size, loss
        self.batch = positive_int(self.name, "batch", batch)
        self.width = positive_int(self.name, "width", width)
        self.max_speed = max_speed
        self.channels = (width, 2 * width, 4 * width)
        self.kernel_size = kernel_size
        self.train_images, self.test_images = _digit_images(self.generator)
        test_gen = torch.Generator().manual_seed(seed + 1)
        self.test = moving_digits(
            self.test_images, test_sequences, frames, size, max_speed=max_speed, generator=test_gen
        ).to(device=device, dtype=dtype)
        # two trivial predictors: the last frame, and a black frame
        target, last = self.test[:, 1:], self.test[:, :-1]
        self.trivial = {
            "copy_last_mae": float((target - last).abs().mean()),
            "black_mae": float(target.abs().mean()),
        }
        fn = _LOSSES[loss]
        # a training loss above the better trivial predictor's is a failed run
        self.baseline = min(float(fn(last, target)), float(fn(torch.zeros_like(target), target)))

    def describe(self) -> dict:
        """The option values (``loss`` is the option's name, ``self.loss`` the method)."""
        return {**super().describe(), "loss": self.loss_name}

    def build(self, method: str, method_options: dict) -> nn.Module:
        return VideoPredictor(
            method,
            self.channels,
            self.kernel_size,
            method_options,
            generator=self.generator,
            dtype=self.dtype,
        ).to(self.device)

    def constrained(self, model: nn.Module) -> nn.Module:
        """The recurrent convolutions whose kernels are constrained (empty for the variants)."""
        if model.recurrent in VARIANTS:
            return nn.ModuleList()
        return nn.ModuleList(model.recurrent_convolutions())

    def weight(self, model: nn.Module) -> torch.Tensor | None:
        """The tall kernel matrices √k·K̂ of every unit, block-diagonal (drift of all at once)."""
        convs = list(self.constrained(model))
        if not convs:
            return None
        mats = [c.parametrizations.weight[0].kernel_matrix(c.weight) for c in convs]
        return torch.block_diag(*mats)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        video = moving_digits(
            self.train_images,
            self.batch,
            self.frames,
            self.size,
            max_speed=self.max_speed,
            generator=self.generator,
        ).to(device=self.device, dtype=self.dtype)
        return _LOSSES[self.loss_name](model(video[:, :-1]), video[:, 1:])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        err = (model(self.test[:, :-1]) - self.test[:, 1:]).abs()
        metrics = {
            "test_mae": float(err.mean()),
            "test_frame_mae": float(err.sum((-3, -2, -1)).mean()),
            "parameters": float(parameter_count(model)),
            **self.trivial,
        }
        from stiefel.comparisons.cost import peak_bytes

        state = torch.get_rng_state(), self.generator.get_state()

        def step() -> None:
            with torch.enable_grad():
                self.loss(model, 0).backward()

        metrics["peak_memory_mb"] = peak_bytes(step, self.device) / 2**20
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(state[0])
        self.generator.set_state(state[1])
        return metrics
