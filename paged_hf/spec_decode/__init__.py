"""Speculative decoding: a proposer guesses k tokens, the model checks them in one multi-token query."""

from .config import SpeculativeConfig
from .metrics import SpecDecodeStats
from .ngram import NgramProposer
from .proposer import Proposer
from .speculator import Speculator, make_proposer

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "SpeculativeConfig", "Speculator", "make_proposer"]
