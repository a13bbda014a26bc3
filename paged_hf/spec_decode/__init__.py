"""Speculative decoding: a proposer guesses k tokens, the model checks them in one multi-token query."""

from .config import SpeculativeConfig
from .metrics import SpecDecodeStats
from .ngram import NgramProposer
from .speculator import Speculator

__all__ = ["NgramProposer", "SpecDecodeStats", "SpeculativeConfig", "Speculator"]
