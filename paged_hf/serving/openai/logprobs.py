"""Incremental text and logprobs: what each sequence already sent, and OpenAI's logprob shapes.

`token_text` decodes one token at a time: a logprob entry names its token as the client would see it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_hf.serving.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


@dataclass
class Deltas:
    """What each sequence has already sent, so a stream sends only what is new.

    The engine's text only ever grows while a sequence runs (its detokenizer holds back what a stop string or
    half a multi-byte character could still change), so the new text is simply what follows the text sent.
    """

    text_sent: dict = field(default_factory=dict)  # index -> characters sent
    tokens_sent: dict = field(default_factory=dict)
    finish_sent: set = field(default_factory=set)  # indexes whose finish_reason went out (n > 1 finish apart)

    def text(self, completion) -> str:
        text, sent = completion.text or "", self.text_sent.get(completion.index, 0)
        self.text_sent[completion.index] = max(sent, len(text))
        return text[sent:]

    def tokens(self, completion) -> tuple[list[int], list]:
        start = self.tokens_sent.get(completion.index, 0)
        self.tokens_sent[completion.index] = len(completion.token_ids)
        return completion.token_ids[start:], (completion.logprobs or [])[start:]

    def new_pieces(self, output):
        """(completion, new text, new token ids, their logprob entries) of each sequence with something new
        to send: text, tokens, or its finish (sent once, though the output keeps listing finished sequences)."""
        for c in output.outputs:
            text = self.text(c)
            token_ids, entries = self.tokens(c)
            finishing = c.finish_reason is not None and c.index not in self.finish_sent
            if finishing:
                self.finish_sent.add(c.index)
            if text or token_ids or finishing:
                yield c, text, token_ids, entries


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        top = [TopLogprob(token=piece, logprob=lp, bytes=list(piece.encode()))
               for piece, lp in ((token_text(tokenizer, t), lp) for t, lp in _top(entry, k))]
        content.append(TokenLogprob(token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, k: int, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.get(token_id))
        result.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in _top(entry, k)} if k else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result
