"""From logits to tokens: the sampler, token constraints, grammars (structured outputs), prompt logprobs."""
