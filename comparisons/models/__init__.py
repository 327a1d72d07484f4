"""Models for the sequence tasks: orthogonal/unitary RNNs and the LSTM baseline."""

from .rnn import LSTMBaseline, ModReLU, OrthogonalRNN, henaff_init

__all__ = ["LSTMBaseline", "ModReLU", "OrthogonalRNN", "henaff_init"]
