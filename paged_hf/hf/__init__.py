"""The transformers face: `wrap`, `PagedModel`, and the drop-in `generate` (beam search included)."""
