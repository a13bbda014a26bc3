"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): computed during prefill, chunk by chunk.

The step keeps the logits of every prompt position of such a request (step_inputs), and this turns them into
`{token_id: logprob}` entries: the prompt's own next token plus the top-k, from log_softmax of the raw logits.
A request that wants them does not read the prefix cache until it has them all (as in vLLM), so a cache hit
never skips positions; a preempted request recomputes the same values.
"""

from __future__ import annotations

import torch


def record_prompt_logprobs(logits: torch.Tensor, spans: list, into: dict | None = None) -> None:
    """logits: [num_kept, vocab_size], the step's kept rows; spans: StepInputs.prompt_logprob_spans. The entries go
    to each request's `prompt_logprobs`, or to `into[request_id]` (a pipeline adds them when the batch completes)."""
    for request, row, position, count in spans:
        target = request.prompt_logprobs if into is None else into.setdefault(request.request_id, {})
        k = request.sampling_params.prompt_logprobs
        logprobs = logits[row:row + count].float().log_softmax(dim=-1)  # [count, vocab_size]
        targets = torch.tensor(request.all_token_ids[position + 1:position + 1 + count], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k else (None, None)
        for j, (token_id, value) in enumerate(zip(targets.tolist(), chosen)):
            entry = {token_id: value}
            if k:
                entry.update(zip(top_ids[j].tolist(), top_values[j].tolist()))
            target[position + 1 + j] = entry
