"""Structured outputs: a grammar per request, enforced by masking the logits of the tokens it forbids.

The grammar engine is xgrammar (vLLM's and SGLang's default). It was picked over llguidance by measurement on
the default model's tokenizer (49,152 tokens), on a 2-core CPU: a nested JSON schema compiles in ~5 ms
(llguidance: ~80 ms with its matchers) and filling the next-token bitmask of 64 matchers takes ~0.1 ms per
step (llguidance: ~1.3 ms). xgrammar is imported only when a request carries a grammar.

- `StructuredOutputsParams` is what a request asks for (vLLM's names: json, json_object, regex, choice,
  grammar); exactly one of them.
- `GrammarCompiler` (one per engine, so per tokenizer) compiles a spec once, on its own small thread pool and
  within `GrammarLimits` (size, depth, time), and caches it (LRU per spec, bounded in bytes).
- `GrammarState` is one sequence's matcher: it advances with each accepted token. The engine never takes a
  generated token back (a preempted request keeps its tokens and only recomputes their K/V), so the matcher
  always stands at the end of the sequence's tokens; `rollback` exists for callers that do remove tokens.
- `apply_grammar_masks` turns the matchers' bitmasks into -inf logits, for the grammar rows only.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

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
def grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                     limits: GrammarLimits | None = None) -> "GrammarCompiler":
    """The compiler (and so the compiled grammars) of one tokenizer, shared by every engine that uses it."""
    return GrammarCompiler(tokenizer, vocab_size, list(eos_token_ids), limits=limits)


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (PagedConfig's fields of the same names).

    Measured with xgrammar on the default model's tokenizer (2-core CPU): a JSON schema of n nested arrays
    compiles in 9 ms (n = 50), 0.31 s (200), 1.1 s (300), 44 s (950); an enum of 5,000 strings in 18 ms. Depth
    and size bound the compile and the compiled grammar's memory (~1.4 MB at n = 200); the time limit is the
    backstop for what they miss (a compile cannot be interrupted: it finishes on its pool thread, discarded).
    """

    max_grammar_bytes: int = 64 << 10  # the spec's text (JSON schema, regex, EBNF, choices)
    max_grammar_depth: int = 64  # nesting of objects and arrays in a JSON schema
    compile_timeout_s: float = 10.0
    cache_bytes: int = 64 << 20  # compiled grammars kept for reuse (their xgrammar memory_size_bytes)
    num_threads: int = 2  # the compile pool (vLLM compiles on a small pool too)


def check_grammar_size(spec: StructuredOutputsParams, limits: GrammarLimits) -> None:
    """ValueError naming the field and the limit for a spec over `limits` (before any compile)."""
    depth = _depth(spec.json) if spec.json is not None else 0  # first: serializing a deep schema recurses
    if depth > limits.max_grammar_depth:
        raise ValueError(f"structured_outputs.json nests {depth} levels deep; at most max_grammar_depth="
                         f"{limits.max_grammar_depth} are accepted")
    _, text, _ = spec.key()
    size = len(text.encode())
    if size > limits.max_grammar_bytes:
        raise ValueError(f"structured_outputs.{spec.kind} is {size} bytes; at most max_grammar_bytes="
                         f"{limits.max_grammar_bytes} are accepted")


def _depth(value) -> int:
    """Nesting of dicts and lists, without recursion (a hostile schema may be deeper than Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary on a small thread pool (xgrammar releases the GIL), with
    a time limit; compiled grammars are cached (LRU) per spec, bounded in bytes. Thread-safe: the server
    compiles a request's grammar before it is queued (`compile_async`), the engine thread finds it cached."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256,
                 limits: GrammarLimits | None = None):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer: pass tokenizer= to wrap()")
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._pool = ThreadPoolExecutor(self.limits.num_threads, thread_name_prefix="paged_hf-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._in_flight: dict[tuple, Future] = {}
        self._too_slow: OrderedDict[tuple, None] = OrderedDict()  # specs that ran out of time: refused at once
        self.cache_size = cache_size  # entries, besides limits.cache_bytes
        self.cache_bytes = 0
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, spec: StructuredOutputsParams):
        """-> an xgrammar CompiledGrammar, waiting at most the time limit; ValueError naming the problem."""
        future = self.compile_async(spec)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            raise self.timed_out(spec) from None

    def compile_async(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once when cached; one compile per spec at a time). The
        size check raises here; an invalid spec fails the future with a ValueError."""
        check_grammar_size(spec, self.limits)
        key = spec.key()
        with self._lock:
            refused = key in self._too_slow
        if refused:
            raise self.timed_out(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(compiled)
                return done
            future = self._in_flight.get(key)
            if future is None:
                future = self._in_flight[key] = self._pool.submit(self._compile_and_cache, spec, key)
            return future

    def timed_out(self, spec: StructuredOutputsParams) -> ValueError:
        """The error for a spec whose compile ran past the limit; later requests with it are refused at once."""
        with self._lock:
            self._too_slow[spec.key()] = None
            while len(self._too_slow) > 1024:
                self._too_slow.popitem(last=False)
        return ValueError(f"structured_outputs.{spec.kind}: the grammar did not compile within "
                          f"grammar_compile_timeout_s={self.limits.compile_timeout_s:g} s")

    def _compile_and_cache(self, spec: StructuredOutputsParams, key: tuple):
        try:
            compiled = self._compile(spec)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid structured_outputs.{spec.kind}: {_clean(exc)}") from None
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
        with self._lock:
            self.num_compiled += 1
            if key not in self._too_slow:
                self._remember(key, compiled)
        return compiled

    def _remember(self, key: tuple, compiled) -> None:
        """Cache under the lock; evict the least recently used past cache_bytes or cache_size."""
        self._cache[key] = compiled
        self.cache_bytes += compiled.memory_size_bytes
        while self._cache and (self.cache_bytes > self.limits.cache_bytes or len(self._cache) > self.cache_size):
            _, old = self._cache.popitem(last=False)
            self.cache_bytes -= old.memory_size_bytes
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
