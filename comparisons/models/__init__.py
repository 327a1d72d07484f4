"""Models of the harness tasks: the LSTM baseline, the recurrent layers of stiefel.nn, and the
video-prediction bottleneck (ConvNERU variants and the ConvLSTM baseline)."""

from .rnn import LSTMBaseline, ModReLU, OrthogonalRNN, henaff_init
from .video import ConvLSTMCell, VideoPredictor

__all__ = [
    "LSTMBaseline",
    "ModReLU",
    "OrthogonalRNN",
    "henaff_init",
    "ConvLSTMCell",
    "VideoPredictor",
]
