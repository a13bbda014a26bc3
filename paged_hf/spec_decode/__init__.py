"""Speculative decoding: a proposer guesses k tokens, the model checks them in one multi-token query."""

from paged_hf.config.speculative import SpeculativeConfig
from paged_hf.spec_decode.metrics import SpecDecodeStats
from paged_hf.spec_decode.ngram import NgramProposer
from paged_hf.spec_decode.proposer import Proposer
from paged_hf.spec_decode.speculator import Speculator, make_proposer

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "SpeculativeConfig", "Speculator", "make_proposer"]
