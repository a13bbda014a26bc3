"""Incremental detokenization and stop strings, per sequence: the text of only the new tokens.

Why incremental: decoding a sequence's whole output again after every token is quadratic in its length and
holds the GIL that the server's event loop needs. The technique is HF's `TextStreamer` and vLLM's
detokenizer: decode a short window `tokens[prefix_offset:]` and subtract the text of `tokens[prefix_offset:
read_offset]`, the tokens already read. The window starts a few tokens back because a token's text can depend
on its neighbours (byte-level BPE pieces of one multi-byte character, SentencePiece's leading space), and new
text is taken only once it does not end in U+FFFD (half of a multi-byte character): it then never changes.

Stop strings (vLLM's rule): searched only in the new text plus the `len(longest stop) - 1` characters before
it, and only once the sequence has more than `min_new_tokens` tokens. The text is cut before the stop
string; the tokens stay. `visible_text` holds back the last `len(longest stop) - 1` characters while the
sequence runs (a stop string may be starting there), so the text a running sequence reports only ever grows:
a streaming consumer sends the difference and never has to take anything back.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_REPLACEMENT = "\ufffd"  # what decode() gives for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, built token by token (equal to `tokenizer.decode(all)`)."""

    def __init__(self, tokenizer, stop: list[str] | None = None, min_new_tokens: int = 0,
                 skip_special_tokens: bool = True, include_stop_str: bool = False,
                 kept_special_tokens: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.backend = _plain_backend(tokenizer)
        self.stop = list(stop or ())
        self.min_new_tokens = min_new_tokens
        self.skip_special_tokens = skip_special_tokens
        # special tokens that stay in the text where skip_special_tokens drops the rest (a format's markers)
        kept = tuple(kept_special_tokens) if skip_special_tokens else ()
        self.dropped_ids = _special_ids_but(tokenizer, kept) if kept else None
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # every complete character decoded so far (cut before a stop string once one is hit)
        self.prefix_offset = 0  # the window's first token: context for the tokens after read_offset
        self.read_offset = 0  # tokens before this have their text in self.text
        self.stopped = False  # a stop string was hit; self.text ends before it (or with it: include_stop_str)
        self.include_stop_str = include_stop_str  # vLLM's include_stop_str_in_output
        self.stop_string: str | None = None  # the stop string that was hit (vLLM's stop_reason)

    def update(self, new_token_ids: list[int]) -> bool:
        """Add tokens; True when a stop string appeared (the text is then cut before it and final)."""
        if self.stopped:
            return True
        start = len(self.text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.text += self._next_piece()
            if self.stop and len(self.token_ids) > self.min_new_tokens and self._find_stop(start):
                return True
            start = len(self.text)
        return False

    def finish(self) -> str:
        """The final text: whatever the window still holds (a character that never completed is U+FFFD, as in
        a full decode)."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.token_ids[self.prefix_offset:])[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.token_ids)
        return self.text

    def visible_text(self, finished: bool) -> str:
        """What may be shown now: all of it once finished, else without the last `holdback` characters."""
        if finished or self.stopped:
            return self.finish()
        return self.text[:len(self.text) - self.holdback] if self.holdback else self.text

    def _next_piece(self) -> str:
        window = self.token_ids[self.prefix_offset:]
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(window)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT) or not text.startswith(prefix):
            return ""  # nothing complete yet: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix):]

    def _find_stop(self, new_text_start: int) -> bool:
        """Search the new text (from `new_text_start`) and the `holdback` characters before it."""
        begin = max(0, new_text_start - self.holdback)
        hits = [(i, s) for i, s in ((self.text.find(s, begin), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        position, self.stop_string = min(hits, key=lambda hit: hit[0])
        self.text = self.text[:position + len(self.stop_string) if self.include_stop_str else position]
        self.stopped = True
        return True

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        skip = self.skip_special_tokens
        if self.dropped_ids is not None:  # skip the special tokens but the kept ones: drop the others' ids first
            token_ids, skip = [t for t in token_ids if t not in self.dropped_ids], False
        if self.backend is not None:
            return self.backend.decode(token_ids, skip_special_tokens=skip)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip)


def _special_ids_but(tokenizer, kept: tuple[str, ...]) -> frozenset[int]:
    """The ids skip_special_tokens drops (the special tokens and the added tokens marked special) but `kept`'s:
    decoding the rest with skip_special_tokens=False is then the skipping decode, with `kept` left in."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special.update(i for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if getattr(added, "special", False))
    kept_ids = {tokenizer.convert_tokens_to_ids(token) for token in kept}
    return frozenset(special - kept_ids)


def _plain_backend(tokenizer):
    """The Rust tokenizer where HF's `decode` is exactly its decode (a tokenizers-backed tokenizer that overrides
    neither method and cleans up no spaces), else None. Two decodes a token per sequence: HF's wrapper around
    them costs ~5x the Rust call, ~0.3 ms of a 64-sequence step."""
    kind = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or kind.decode is not PreTrainedTokenizerBase.decode
            or kind._decode is not PreTrainedTokenizerFast._decode or tokenizer.clean_up_tokenization_spaces):
        return None
    return tokenizer.backend_tokenizer
