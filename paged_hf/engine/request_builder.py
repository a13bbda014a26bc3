"""`RequestBuilder`: a checked prompt and its sampling fields -> the `RequestGroup` of its n sequences.

Nothing is queued here, so a ValueError leaves the engine as it was. n > 1: n sequences (children); only
child 0 is queued, the others wait in its `pending_forks` and fork from it once it computed the prompt
(sharing its KV blocks), so the prompt is computed once.

`prepare` does a request's slow parts before it is submitted, on the caller's thread or the grammar pool:
the server calls it off the event loop and the engine thread, so a request whose grammar takes seconds to
compile, or whose bad_words are many, waits for that alone while the engine steps on; `group` then finds the
grammar in the compiler's cache and the bad words tokenized. Callers that skip it (the offline `LLM`) pay
both in `group`, bounded by the same limits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from paged_hf.config.groups import RequestLimits, SchedulerConfig
from paged_hf.core.request import Request
from paged_hf.engine.detokenizer import IncrementalDetokenizer
from paged_hf.engine.request_group import RequestGroup
from paged_hf.multimodal.prompts import ProcessedPrompt
from paged_hf.sample.sampler import make_rng
from paged_hf.sample.structured_output import GrammarCompiler, GrammarLimits, grammar_compiler
from paged_hf.sample.thinking import ThinkingGate
from paged_hf.sample.token_constraints import bad_words_token_ids
from paged_hf.sampling_params import SamplingParams, check_stop_limits

if TYPE_CHECKING:
    from paged_hf.integrations.peft import LoRAAdapter


class RequestBuilder:
    def __init__(self, limits: RequestLimits, scheduler: SchedulerConfig, tokenizer, vocab_size: int,
                 eos_token_ids: list[int], device: torch.device):
        self.limits, self.scheduling_policy = limits, scheduler.scheduling_policy
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device  # where the logits come out: seeded requests' rngs live there
        self.grammar_compiler: GrammarCompiler | None = None  # made with the first structured-output request
        self.grammar_limits = GrammarLimits(limits.max_grammar_bytes, limits.max_grammar_depth,
                                            limits.grammar_compile_timeout_s, limits.grammar_cache_bytes)
        self._lock = threading.Lock()  # `prepare` runs on other threads than `group`
        self._bad_words: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()  # tokenized by `prepare`

    def sampling_params(self, sampling_params: SamplingParams | None, cache_salt: str | None) -> SamplingParams:
        """The request's params (the defaults for None); ValueError for what the engine cannot serve."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        check_stop_limits(params.stop, self.limits.max_stop_strings, self.limits.max_stop_string_chars)
        if params.bad_words and len(params.bad_words) > self.limits.max_bad_words:
            raise ValueError(f"SamplingParams.bad_words has {len(params.bad_words)} entries; at most max_bad_words="
                             f"{self.limits.max_bad_words} are accepted (a PagedConfig field)")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and -1 < self.limits.max_logprobs < asked:
                raise ValueError(f"SamplingParams.{name}={asked} is more than max_logprobs={self.limits.max_logprobs} "
                                 "(a PagedConfig field; -1 lifts the limit)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer: pass tokenizer= to wrap()")
        return params

    def check_scheduling(self, priority, tenant) -> None:
        """ValueError for a priority that is not an int, or one other than 0 that the policy would ignore (as
        vLLM), and for a tenant that is not a string."""
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ValueError(f"priority must be an int (lower is served first), got {priority!r}")
        if priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine schedules "
                             f"{self.scheduling_policy!r})")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string or None, got {tenant!r}")

    @staticmethod
    def assign_scheduling(group: RequestGroup, priority: int | None, tenant: str | None, adapter: str | None) -> None:
        """Every sequence of the request gets its priority and tenant; without a tenant, the adapter is one."""
        for child in group.children:
            child.priority = priority or 0
            child.tenant = tenant if tenant is not None else adapter

    def group(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, adapter: str | None,
              lora: LoRAAdapter | None, cache_salt: str | None) -> RequestGroup:
        """The request's children, child 0 first (the one to queue); ValueError for an invalid grammar spec.
        `prompt`: its checked token ids, images and the family's own positions of it (multimodal/prompts.py), the
        same for every child."""
        grammar = self._compile_grammar(params)
        prompt_ids = prompt.token_ids
        children = [self._child(request_id, i, prompt_ids, params, adapter, lora, cache_salt, grammar)
                    for i in range(params.n)]
        for child in children:
            child.mm_items = list(prompt.items)
            child.mm_positions = prompt.positions
        parent, *siblings = children
        bad_words = self._bad_words_ids(params.bad_words, pop=True)
        for child in children:
            child.bad_words_token_ids = bad_words
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = {}
        parent.pending_forks = siblings
        for child in siblings:
            child.fork_parent = parent
        return RequestGroup(request_id, prompt_ids, children)

    def _child(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
               adapter: str | None, lora: LoRAAdapter | None, cache_salt: str | None, grammar) -> Request:
        return Request(request_id, index, list(prompt_ids), params, adapter, cache_salt=cache_salt, lora=lora,
                       adapter_version=None if lora is None else lora.version,
                       rng=make_rng(params.seed, index, self.device) if params.seed is not None else None,
                       detokenizer=None if self.tokenizer is None else
                       IncrementalDetokenizer(self.tokenizer, params.stop, params.min_new_tokens,
                                              params.skip_special_tokens, params.include_stop_str_in_output,
                                              tuple(params.kept_special_tokens or ())),
                       grammar=self._constraint(params, grammar))  # own per child

    def _constraint(self, params: SamplingParams, compiled):
        """What masks the child's tokens: its grammar's matcher, behind a thinking gate for a thinking model."""
        state = None if compiled is None else self.grammar_compiler.matcher(compiled)
        if params.thinking_end_token_ids is None or (state is None and params.thinking_token_budget is None):
            return state
        return ThinkingGate(params.thinking_end_token_ids, params.thinking_token_budget, state, self.vocab_size,
                            params.thinking_start_token_id)

    def prepare(self, sampling_params: SamplingParams | None) -> Future | None:
        """Thread-safe: check the params, tokenize their bad_words and start compiling their grammar; -> the
        compile's future (None without a grammar). ValueError for what `group` would refuse."""
        params = self.sampling_params(sampling_params, None)
        self._bad_words_ids(params.bad_words, pop=False)
        if params.structured_outputs is None:
            return None
        return self.compiler().compile_async(params.structured_outputs)

    def compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (made once, thread-safe); ValueError without a tokenizer."""
        with self._lock:
            if self.grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer: pass tokenizer= to wrap()")
                self.grammar_compiler = grammar_compiler(self.tokenizer, self.vocab_size, tuple(self.eos_token_ids),
                                                         self.grammar_limits)
            return self.grammar_compiler

    def _bad_words_ids(self, bad_words: list[str] | None, pop: bool) -> list[list[int]] | None:
        """The words' token sequences: tokenized by `prepare` (popped by `group`), else now. At most 64 kept."""
        if not bad_words:
            return None
        key = tuple(bad_words)
        with self._lock:
            ids = self._bad_words.pop(key, None) if pop else self._bad_words.get(key)
        if ids is None:
            ids = bad_words_token_ids(bad_words, self.tokenizer)
        if not pop:
            with self._lock:
                self._bad_words[key] = ids
                while len(self._bad_words) > 64:
                    self._bad_words.popitem(last=False)
        return ids

    def _compile_grammar(self, params: SamplingParams):
        """The request's compiled grammar (cached per spec), or None; ValueError for an invalid spec."""
        if params.structured_outputs is None:
            return None
        return self.compiler().compile(params.structured_outputs)
