"""Models for the sequence tasks: the LSTM baseline, and the recurrent layers of stiefel.nn."""

from .rnn import LSTMBaseline, ModReLU, OrthogonalRNN, henaff_init

__all__ = ["LSTMBaseline", "ModReLU", "OrthogonalRNN", "henaff_init"]
