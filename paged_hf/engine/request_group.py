"""A user request: its n sequences (children) and how they are reported as one `RequestOutput`."""

from __future__ import annotations

from paged_hf.core.request import Request
from paged_hf.outputs import CompletionOutput, RequestMetrics, RequestOutput


class RequestGroup:
    def __init__(self, request_id: str, prompt_token_ids: list[int], children: list[Request]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.children = children

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)

    def output(self) -> RequestOutput:
        first = [c.first_token_time for c in self.children if c.first_token_time is not None]
        finish = [c.finish_time for c in self.children if c.finish_time is not None]
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self._completion(child) for child in self.children],
            finished=self.finished,
            metrics=RequestMetrics(
                arrival_time=self.children[0].arrival_time,
                first_token_time=min(first) if first else None,
                finish_time=max(finish) if finish and self.finished else None,
            ),
            prompt_logprobs=self._prompt_logprobs(),
            num_cached_tokens=self.children[0].num_cached_tokens or 0,
        )

    def _prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """Child 0 computed the prompt (the others fork after it); its entries, in prompt order."""
        entries = self.children[0].prompt_logprobs
        if entries is None:
            return None
        return [None] + [entries.get(p) for p in range(1, len(self.prompt_token_ids))]

    def _completion(self, child: Request) -> CompletionOutput:
        text = None
        detokenizer = child.detokenizer
        if detokenizer is not None:  # only the tokens it has not read yet are decoded
            detokenizer.update(child.output_token_ids[len(detokenizer.token_ids):])
            text = detokenizer.visible_text(child.is_finished)
        return CompletionOutput(
            index=child.index,
            token_ids=list(child.output_token_ids),
            text=text,
            finish_reason=child.finish_reason,
            logprobs=list(child.output_logprobs) if child.output_logprobs is not None else None,
            stop_reason=child.stop_reason,
        )
