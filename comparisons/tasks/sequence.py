"""Sequence tasks for recurrent models: copying, adding and pixel-by-pixel digits."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...nn import OrthogonalRNN
from ..task import Classification, Task, digits_split, positive_int, register

__all__ = ["LSTMBaseline", "Copying", "Adding", "Digits"]


class LSTMBaseline(nn.Module):
    """The LSTM baseline (forget-gate bias 1, as in the scaled Cayley paper's settings)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lstm = nn.LSTM(n_in, n_hidden, batch_first=True, dtype=dtype)
        with torch.no_grad():
            for name, p in self.lstm.named_parameters():
                if name.startswith("bias"):
                    p.zero_()
                    p[n_hidden : 2 * n_hidden] = 0.5  # two biases add up to 1
        self.out = nn.Linear(n_hidden, n_out, dtype=dtype)

    def forward(self, x: torch.Tensor, all_steps: bool = False) -> torch.Tensor:
        hs, _ = self.lstm(x.to(self.out.weight.dtype))
        y = self.out(hs)
        return y if all_steps else y[:, -1]


class _SequenceTask(Task):
    kind = "sequence"
    extra_methods = {"lstm": "the LSTM baseline"}
    n_in = 1
    n_out = 1

    def __init__(
        self, dtype, device, seed, n: int = 64, batch: int = 64,
        operator: bool | str = "auto", nonpositive_bias: bool = False,
    ):  # fmt: skip
        super().__init__(dtype, device, seed)
        self.n = positive_int(self.name, "n", n)
        self.batch = positive_int(self.name, "batch", batch)
        self.operator = operator
        self.nonpositive_bias = nonpositive_bias

    def build(self, method: str, method_options: dict) -> nn.Module:
        real, size = self.dtype.to_real(), (self.n_in, self.n, self.n_out)
        if method == "lstm":
            return LSTMBaseline(*size, dtype=real).to(self.device)
        opts = dict(operator=self.operator, nonpositive_bias=self.nonpositive_bias)
        opts.update(method=method, method_options=method_options, complex=self.dtype.is_complex)
        model = OrthogonalRNN(*size, init="henaff", generator=self.generator, dtype=real, **opts)
        return model.to(self.device)

    def constrained(self, model: nn.Module) -> nn.Module | None:
        return getattr(model, "transition", None)

    def weight(self, model: nn.Module) -> torch.Tensor | None:
        mod = self.constrained(model)
        return None if mod is None else mod()


@register("copying")
class Copying(_SequenceTask):
    r"""The copying memory task (Arjovsky et al. 2016).

    Ten symbols from 1–8, T − 1 blanks (0), a marker (9) and ten more blanks,
    during which the ten symbols must be reproduced: length T + 20, blanks are
    the target everywhere else, cross-entropy over every position. Outputting
    blanks and then random symbols gives the baseline 10·log 8 / (T + 20).
    """

    n_in = 10
    n_out = 10

    def __init__(self, dtype, device, seed, n: int = 64, batch: int = 64, T: int = 100, **kw):
        super().__init__(dtype, device, seed, n=n, batch=batch, **kw)
        self.T = positive_int(self.name, "T", T)
        self.baseline = 10 * math.log(8) / (T + 20)

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        T, g = self.T, self.generator
        seq = torch.randint(1, 9, (batch, 10), generator=g)
        x = torch.zeros(batch, T + 20, dtype=torch.long)
        x[:, :10] = seq
        x[:, T + 9] = 9  # the marker; the answer starts on the next step
        y = torch.zeros(batch, T + 20, dtype=torch.long)
        y[:, -10:] = seq
        return F.one_hot(x, 10).float().to(self.device), y.to(self.device)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        x, y = self.sample(self.batch)
        logits = model(x, all_steps=True)
        return F.cross_entropy(logits.reshape(-1, 10), y.reshape(-1))


@register("adding")
class Adding(_SequenceTask):
    r"""The adding problem (Hochreiter & Schmidhuber 1997, as in Helfrich et al. 2018).

    Two input channels of length T: values in U[0, 1) and a mask with a one in
    [0, T/2) and a one in [T/2, T); the target is the sum of the two marked
    values. Always answering 1 gives the baseline MSE 1/6 ≈ 0.167.
    """

    n_in = 2
    n_out = 1
    baseline = 1 / 6

    def __init__(self, dtype, device, seed, n: int = 64, batch: int = 64, T: int = 100, **kw):
        super().__init__(dtype, device, seed, n=n, batch=batch, **kw)
        if positive_int(self.name, "T", T) < 2:
            raise ValueError(f"task 'adding': T={T}; allowed: an integer >= 2")
        self.T = T

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        T, g = self.T, self.generator
        vals = torch.rand(batch, T, generator=g)
        mask = torch.zeros(batch, T)
        i = torch.randint(0, T // 2, (batch,), generator=g)
        j = torch.randint(T // 2, T, (batch,), generator=g)
        rows = torch.arange(batch)
        mask[rows, i] = 1
        mask[rows, j] = 1
        x = torch.stack((vals, mask), -1)
        return x.to(self.device), (vals * mask).sum(1, keepdim=True).to(self.device)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        x, y = self.sample(self.batch)
        return F.mse_loss(model(x), y)


@register("digits")
class Digits(Classification, _SequenceTask):
    """Pixel-by-pixel classification of scikit-learn's bundled 8×8 digits (64 steps).

    1797 images, split 1397 train / 400 test by the seed; ``permute=True`` applies
    one fixed random permutation to the pixel order (the permuted variant).
    Real data that is available offline.
    """

    n_in = 1
    n_out = 10

    def __init__(self, dtype, device, seed, n: int = 64, batch: int = 64, permute=False, **kw):
        super().__init__(dtype, device, seed, n=n, batch=batch, **kw)
        x, y, xt, yt = digits_split(self.name, self.generator)
        x, xt = x.reshape(-1, 64), xt.reshape(-1, 64)
        if permute:
            pixels = torch.randperm(64, generator=self.generator)
            x, xt = x[:, pixels], xt[:, pixels]
        x, xt = (x - 0.3) / 0.4, (xt - 0.3) / 0.4  # roughly zero mean, unit spread
        self.x_train, self.y_train = x[..., None].to(device), y.to(device)
        self.x_test, self.y_test = xt[..., None].to(device), yt.to(device)
        self.baseline = math.log(10)
        self.chance = {"test_accuracy": 0.1}
        self.permute = permute

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self.test_metrics(model(self.x_test))
