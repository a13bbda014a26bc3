"""Structured outputs: a grammar per request, enforced by masking the logits of the tokens it forbids.

The grammar engine is xgrammar (vLLM's and SGLang's default). It was picked over llguidance by measurement on
the default model's tokenizer (49,152 tokens), on a 2-core CPU: a nested JSON schema compiles in ~5 ms
(llguidance: ~80 ms with its matchers) and filling the next-token bitmask of 64 matchers takes ~0.1 ms per
step (llguidance: ~1.3 ms). xgrammar is imported only when a request carries a grammar.

- `StructuredOutputsParams` is what a request asks for (vLLM's names: json, json_object, regex, choice,
  grammar); exactly one of them.
- `GrammarCompiler` (one per engine, so per tokenizer) compiles a spec once and caches it (LRU per spec).
- `GrammarState` is one sequence's matcher: it advances with each accepted token. The engine never takes a
  generated token back (a preempted request keeps its tokens and only recomputes their K/V), so the matcher
  always stands at the end of the sequence's tokens; `rollback` exists for callers that do remove tokens.
- `apply_grammar_masks` turns the matchers' bitmasks into -inf logits, for the grammar rows only.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict

import numpy as np
import torch

from paged_hf.sampling_params import StructuredOutputsParams

_INSTALL_HINT = "structured outputs need xgrammar: pip install 'paged-hf[structured]' (or pip install xgrammar)"


def _xgrammar():
    try:
        import xgrammar  # noqa: PLC0415
    except ImportError:
        raise ValueError(_INSTALL_HINT) from None
    return xgrammar


@functools.lru_cache(maxsize=8)
def grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> "GrammarCompiler":
    """The compiler (and so the compiled grammars) of one tokenizer, shared by every engine that uses it."""
    return GrammarCompiler(tokenizer, vocab_size, list(eos_token_ids))


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; compiled grammars are cached (LRU) per spec."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer: pass tokenizer= to wrap()")
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, spec: StructuredOutputsParams):
        """-> an xgrammar CompiledGrammar; ValueError naming the problem for an invalid spec."""
        key = spec.key()
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            compiled = self._compile(spec)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid structured_outputs.{spec.kind}: {_clean(exc)}") from None
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        compact = spec.disable_any_whitespace
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else {"type": "object"}
            return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=not compact)
        if spec.regex is not None:
            return self._compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return self._compiler.compile_grammar(choice_grammar(spec.choice))
        return self._compiler.compile_grammar(spec.grammar)

    def matcher(self, compiled) -> "GrammarState":
        return GrammarState(_xgrammar().GrammarMatcher(compiled), self.vocab_size)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def _clean(exc: Exception) -> str:
    """xgrammar's C++ messages start with '[time] /path/file.cc:line: '; the client needs the rest."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text).splitlines()[0] if text else type(exc).__name__


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self.rejected_token: int | None = None  # set when a token the grammar forbids was generated

    def accept(self, token_id: int) -> bool:
        """Advance over a generated token; False (and no move) if the grammar forbids it. That happens only when
        the request's other constraints masked every token the grammar allows (the row was all -inf)."""
        ok = bool(self.matcher.accept_token(token_id))
        self.num_accepted += ok
        if not ok:
            self.rejected_token = token_id
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: np.ndarray, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)


def apply_grammar_masks(logits: torch.Tensor, row_index: list[int], states: list[GrammarState]) -> torch.Tensor:
    """A copy of `logits` [num_rows, vocab_size] where row row_index[j] keeps only what states[j] allows.

    One bitmask [num_grammar_rows, ceil(vocab/32)] int32 (bit t % 32 of word t // 32 = token t allowed),
    unpacked to booleans with numpy and applied to the grammar rows only: rows without a grammar cost nothing
    but the copy. On CPU the masking runs in numpy (one thread, ~4x faster than torch's indexing here).
    """
    vocab_size = logits.shape[-1]
    num_words = (states[0].vocab_size + 31) // 32
    bitmask = np.full((len(states), num_words), -1, dtype=np.int32)
    for j, state in enumerate(states):
        state.fill(bitmask, j)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little").view(np.bool_)[:, :vocab_size]
    if allowed.shape[-1] < vocab_size:  # logits wider than the grammar's vocabulary: the rest is never allowed
        allowed = np.pad(allowed, ((0, 0), (0, vocab_size - allowed.shape[-1])))
    masked = logits.clone()
    if masked.device.type == "cpu" and masked.dtype in (torch.float32, torch.float64):
        view = masked.numpy()  # shares memory with `masked`
        view[row_index] = np.where(allowed, view[row_index], -np.inf)
        return masked
    index = torch.tensor(row_index, device=logits.device)
    allowed_t = torch.from_numpy(allowed).to(logits.device)  # [num_grammar_rows, vocab_size]
    masked[index] = logits[index].masked_fill(~allowed_t, float("-inf"))
    return masked
