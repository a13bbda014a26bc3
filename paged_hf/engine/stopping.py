"""When a sequence ends: EOS, stop token ids, stop strings, max_new_tokens, max_model_len."""

from __future__ import annotations

from paged_hf.core.request import Request
from paged_hf.outputs import FinishReason


class StopChecker:
    def __init__(self, eos_token_ids: list[int], max_model_len: int):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, request: Request) -> str | None:
        """Call after each appended token: FinishReason.STOP or LENGTH, or None (keep going); ValueError: the request fails."""
        if request.grammar is not None and request.grammar.rejected_token is not None:
            raise ValueError(f"token {request.grammar.rejected_token} is outside the request's grammar: its other "
                             "sampling constraints left no token the grammar allows")
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        num_generated = len(request.output_token_ids)
        if num_generated >= params.min_new_tokens:
            if not params.ignore_eos and (token_id in self.eos_token_ids or (params.eos_token_ids and token_id in params.eos_token_ids)):
                return FinishReason.STOP
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return FinishReason.STOP
            if request.grammar is not None and request.grammar.is_terminated:  # also with ignore_eos
                return FinishReason.STOP
        if params.stop and request.detokenizer.update(request.output_token_ids[len(request.detokenizer.token_ids):]):
            request.stop_reason = request.detokenizer.stop_string
            return FinishReason.STOP  # the detokenizer searches only the new text, past min_new_tokens (see detokenizer.py)
        if num_generated >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
