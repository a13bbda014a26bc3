"""Beam search's own arithmetic and bookkeeping: HF's scoring, and one prompt's beams inside the engine."""
