"""The engine: `ContinuousBatchGenerator` and what only it uses (detokenizer, stop checks, request groups,
token streams, input checks, beam search orchestration)."""
