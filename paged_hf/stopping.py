"""When a sequence ends: EOS, stop token ids, stop strings, max_new_tokens, max_model_len."""

from __future__ import annotations

from .request import Request


class StopChecker:
    def __init__(self, eos_token_ids: list[int], max_model_len: int, tokenizer=None):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, request: Request) -> str | None:
        """Call after each appended token: "stop", "length" or None (keep going)."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        num_generated = len(request.output_token_ids)
        if num_generated >= params.min_new_tokens:
            if not params.ignore_eos and (token_id in self.eos_token_ids or (params.eos_token_ids and token_id in params.eos_token_ids)):
                return "stop"
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return "stop"
            if params.stop and self._hits_stop_string(request):
                return "stop"
        if num_generated >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _hits_stop_string(self, request: Request) -> bool:
        """Stop strings are matched on the decoded text and cut from it (as vLLM); the tokens stay."""
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to wrap()")
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        positions = [text.find(stop) for stop in request.sampling_params.stop]
        positions = [p for p in positions if p >= 0]
        if not positions:
            return False
        request.output_text = text[: min(positions)]
        request.stop_string_hit = True
        return True
