"""`ContinuousBatchGenerator`: wraps `model.forward` with a scheduler, a paged cache and a sampler.

One step is three calls (nano-vllm's shape): schedule -> run the model once on the packed row -> postprocess
(append sampled tokens, check stops, free what finished). The model runner never touches the block manager.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from transformers.utils import logging

from paged_hf.config import PagedConfig
from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager
from paged_hf.core.request import Request
from paged_hf.core.scheduler import Scheduler
from paged_hf.engine import beam_search as _beam_search
from paged_hf.engine.detokenizer import IncrementalDetokenizer
from paged_hf.engine.request_checks import check_fits, check_token_ids, per_prompt, prompt_list, prompt_token_ids
from paged_hf.engine.request_group import RequestGroup
from paged_hf.engine.stopping import StopChecker
from paged_hf.engine.token_stream import TokenStream
from paged_hf.outputs import CompletionOutput, FinishReason, RequestOutput
from paged_hf.sample.prompt_logprobs import record_prompt_logprobs
from paged_hf.sample.sampler import Sampler, SamplingRow, make_generator
from paged_hf.sample.structured_output import GrammarCompiler, grammar_compiler
from paged_hf.sample.token_constraints import bad_words_token_ids
from paged_hf.sampling_params import SamplingParams, check_stop_limits
from paged_hf.spec_decode import Speculator, make_proposer
from paged_hf.worker.cache_sizing import num_blocks_from_memory
from paged_hf.worker.distributed import broadcast_tokens
from paged_hf.worker.model_info import inspect_model
from paged_hf.worker.model_runner import ModelRunner

logger = logging.get_logger(__name__)


class ContinuousBatchGenerator:
    def __init__(self, model: torch.nn.Module, config: PagedConfig | None = None, tokenizer=None):
        peft_model, model = _split_peft_model(model)
        self.serves_peft_model = peft_model is not None
        self.config = config or PagedConfig()
        self.tokenizer = tokenizer
        self.info = inspect_model(model)
        self.max_model_len = self.config.max_model_len or self.info.max_positions or 2048
        num_blocks = self.config.num_blocks or num_blocks_from_memory(self.info, self.config, self.max_model_len)
        self.runner = ModelRunner(model, self.info, num_blocks, self.config)
        self.block_pool = BlockPool(num_blocks, self.config.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(self.block_pool, self.config.block_size)
        self.scheduler = Scheduler(self.kv_cache_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   max_loras=self.config.max_loras)
        self.sampler = Sampler(self.info.eos_token_ids)
        self.stop_checker = StopChecker(self.info.eos_token_ids, self.max_model_len)
        self.grammar_compiler: GrammarCompiler | None = None  # made with the first structured-output request
        speculative = self.config.speculative
        self.speculator = None if speculative is None else Speculator(
            speculative, self.kv_cache_manager, make_proposer(speculative, self.config, self.info, num_blocks))
        self.groups: dict[str, RequestGroup] = {}  # unfinished requests by id
        # Outputs step() owes: requests of add_request that changed while generate()/stream() stepped the
        # engine, and aborts. Requests of generate()/stream() (claimed) are reported by those calls only.
        self._undelivered: dict[RequestGroup, None] = {}
        self._claimed: set[RequestGroup] = set()
        self._in_step = False
        self._deferred_releases: list[RequestGroup] = []  # streams dropped (finalized) during a step
        self._errors: dict[str, Exception] = {}  # request id -> what failed it alone (reported with its output)
        self._ids = itertools.count()
        if peft_model is not None:
            self._lora_manager().add_peft_model(peft_model)
        if not isinstance(self.config.adapters, dict):
            raise ValueError(f"adapters must be a dict {{name: peft folder}}, got {self.config.adapters!r}")
        for name, path in self.config.adapters.items():
            self.load_adapter(name, path)

    # --- submission -----------------------------------------------------------------------------------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None, adapter: str | None = None,
                    request_id: str | None = None, *, cache_salt: str | None = None) -> str:
        """Validate and queue one request. Bad input raises ValueError and queues nothing.

        n > 1: n sequences (children); only child 0 is queued, the others fork from it once it computed the
        prompt (sharing its KV blocks), so the prompt is computed once. `cache_salt`: prefix-cache blocks are
        shared only between requests with the same salt (e.g. one per tenant).
        """
        return self._submit(prompt, sampling_params, adapter, request_id, cache_salt).request_id

    def _submit(self, prompt, sampling_params, adapter, request_id, cache_salt=None) -> RequestGroup:
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        check_stop_limits(params.stop, self.config.max_stop_strings, self.config.max_stop_string_chars)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer: pass tokenizer= to wrap()")
        prompt_ids = self._prompt_token_ids(prompt)
        self._check_fits(prompt_ids, params)
        check_token_ids(params, self.info.vocab_size)
        lora = self._adapter(adapter)
        if lora is not None and self.speculator is not None and not self.speculator.proposer.serves_adapters:
            raise ValueError(f"adapter {adapter!r}: this engine speculates with a draft model, which serves "
                             f"base-model requests only (the ngram method serves any adapter)")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        grammar = self._compile_grammar(params)
        device = self.runner.logits_device
        children = [
            Request(request_id, i, list(prompt_ids), params, adapter, cache_salt=cache_salt, lora=lora,
                    adapter_version=None if lora is None else lora.version,
                    generator=make_generator(params.seed, i, device) if params.seed is not None else None,
                    detokenizer=None if self.tokenizer is None else
                    IncrementalDetokenizer(self.tokenizer, params.stop, params.min_new_tokens,
                                           params.skip_special_tokens, params.include_stop_str_in_output),
                    grammar=None if grammar is None else self.grammar_compiler.matcher(grammar))  # one per child
            for i in range(params.n)
        ]
        parent, *siblings = children
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer)
        for child in children:
            child.bad_words_token_ids = bad_words
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = {}
        parent.pending_forks = siblings
        for child in siblings:
            child.fork_parent = parent
        group = self.groups[request_id] = RequestGroup(request_id, prompt_ids, children)
        self.scheduler.add(parent)
        return group

    def _prompt_token_ids(self, prompt) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.info.vocab_size)

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_fits(prompt_ids, params, self.max_model_len, self.config.block_size, self.block_pool.num_blocks)

    def _compile_grammar(self, params: SamplingParams):
        """The request's compiled grammar (cached per spec), or None; ValueError for an invalid spec."""
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer: pass tokenizer= to wrap()")
            self.grammar_compiler = grammar_compiler(self.tokenizer, self.info.vocab_size, tuple(self.info.eos_token_ids))
        return self.grammar_compiler.compile(params.structured_outputs)

    # --- LoRA adapters --------------------------------------------------------------------------------
    def load_adapter(self, name: str, path) -> None:
        """Load the peft LoRA folder `path` under `name`. Under a name already loaded, the new weights serve
        new requests while running ones finish with the old (a new version: no prefix-cache block is shared
        between them). An unusable folder raises ValueError and changes nothing."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        self._lora_manager().load(name, path)

    def _lora_manager(self):
        """Created with the first adapter (peft is imported only for LoRA); with no adapter loaded it only
        costs a check per step."""
        if self.runner.lora is None:
            from paged_hf.integrations.lora import LoRAManager  # noqa: PLC0415

            self.runner.lora = LoRAManager(self.runner.model, self.config.max_loras, self.config.max_lora_rank)
        return self.runner.lora

    def unload_adapter(self, name: str) -> None:
        """New requests can no longer use `name`; requests already submitted finish with its weights."""
        if name not in self.adapter_names():
            raise ValueError(f"unknown adapter {name!r}; loaded adapters: {self.adapter_names()}")
        self.runner.lora.unload(name)

    def adapter_names(self) -> list[str]:
        return sorted(self.runner.lora.adapters) if self.runner.lora is not None else []

    def _adapter(self, name):
        """The loaded adapter a request names (None: the base model)."""
        if name is None:
            return None
        if not isinstance(name, str) or name not in self.adapter_names():
            raise ValueError(f"unknown adapter {name!r}; loaded adapters: {self.adapter_names()}")
        return self.runner.lora.adapters[name]

    # --- running --------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; the outputs (cumulative) of every request of `add_request` that changed,
        since the last step() (so also while generate() or stream() stepped the engine)."""
        touched = self._step()
        ready, self._undelivered = self._undelivered, {}
        ready.update((group, None) for group in touched if group not in self._claimed)
        self._apply_deferred_releases()
        return [self._output(group) for group in ready]

    def _output(self, group: RequestGroup) -> RequestOutput:
        """The group's output; an exception that belongs to this one request (its text could not be decoded)
        fails only it: aborted, blocks freed, reported with `error`."""
        error = self._errors.pop(group.request_id, None)
        if error is None:
            try:
                return group.output()
            except Exception as exc:  # noqa: BLE001
                error = exc
        logger.error("request %s failed: %r", group.request_id, error)
        for child in group.children:
            if not child.is_finished:
                self.scheduler.finish(child, FinishReason.ABORT)
        if self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
        self._undelivered.pop(group, None)
        completions = [CompletionOutput(c.index, list(c.output_token_ids), finish_reason=c.finish_reason)
                       for c in group.children]
        return RequestOutput(group.request_id, group.prompt_token_ids, completions, finished=True,
                             error=f"{type(error).__name__}: {error}")

    def _step_for_call(self) -> list[RequestGroup]:
        """A step taken by generate() or stream(): what it does to other requests waits for step()."""
        touched = self._step()
        self._undelivered.update((group, None) for group in touched if group not in self._claimed)
        self._apply_deferred_releases()
        return touched

    def _step(self) -> list[RequestGroup]:
        """One iteration of the engine; -> the requests that changed."""
        self._apply_deferred_releases()  # left over by a step that raised
        self._in_step = True
        try:
            return self._schedule_run_postprocess()
        finally:
            self._in_step = False

    def _apply_deferred_releases(self) -> None:
        deferred, self._deferred_releases = self._deferred_releases, []
        for group in deferred:
            self._release(group)

    def _schedule_run_postprocess(self) -> list[RequestGroup]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._may_speculate, self.config.max_num_batched_tokens)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        logits, inputs = self.runner.run(out)  # [num_kept, vocab_size]
        if inputs.prompt_logprob_spans:
            record_prompt_logprobs(logits, inputs.prompt_logprob_spans)
            logits = logits[inputs.sample_rows.to(logits.device)]  # [num_sampled (+ num_spec_rows), vocab_size]
        spec_logits = None
        if inputs.num_spec_rows:  # the drafts' rows come last
            logits, spec_logits = logits[: -inputs.num_spec_rows], logits[-inputs.num_spec_rows:]
        for scheduled in out.scheduled:
            self.scheduler.advance(scheduled)
        requests = [scheduled.request for scheduled in inputs.sampled]
        requests, logits, beam_groups = _beam_search.route_beam_rows(self, requests, logits)
        touched: dict[RequestGroup, None] = dict.fromkeys(beam_groups)  # beam searches that ended
        if not requests:
            return self._drop_finished(touched)
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator, r.grammar,
                            r.bad_words_token_ids)
                for r in requests]
        if spec_logits is not None:
            emitted = self.speculator.verify(self.sampler, requests, rows, logits, spec_logits)
        else:
            sampled = self.sampler(logits, rows)
            token_ids = broadcast_tokens(sampled.token_ids, logits.device)  # tensor parallel: rank 0's tokens
            emitted = [[pair] for pair in zip(token_ids, sampled.logprobs)]
        now = time.monotonic()
        for request, tokens in zip(requests, emitted):  # one token each; more where drafts were accepted
            for token_id, logprobs in tokens:
                if self._append_token(request, token_id, logprobs, now):
                    break
            else:
                if spec_logits is not None:
                    self.speculator.commit(request, len(tokens))
            touched[self.groups[request.request_id]] = None
        return self._drop_finished(touched)

    def _append_token(self, request: Request, token_id: int, logprobs, now: float) -> bool:
        """Append one generated token and check the stop conditions -> whether the request finished."""
        request.append_token(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        try:
            reason = self.stop_checker.check(request)
        except Exception as exc:  # noqa: BLE001 - this request's own (its stop strings' text): fail only it
            self._errors[request.request_id] = exc
            reason = FinishReason.ABORT
        if reason is None:
            return False
        request.finish_time = now
        self.scheduler.finish(request, reason)
        return True

    def _may_speculate(self, request: Request) -> bool:
        """Beams of a beam search choose among all their continuations: no drafts for them."""
        return isinstance(self.groups.get(request.request_id), RequestGroup)

    def _drop_finished(self, touched: dict) -> list:
        for group in touched:
            if group.finished:
                del self.groups[group.request_id]
        return list(touched)

    def add_beam_request(self, prompt, params, adapter: str | None = None, request_id: str | None = None) -> str:
        """Queue one beam search (`BeamSearchParams`); step() reports it once, finished, with its best
        hypotheses as outputs. Its beams run in the same steps as every other request."""
        return _beam_search.add_beam_request(self, prompt, params, adapter, request_id)

    def beam_search(self, prompts: Sequence, params, adapters=None, use_tqdm: bool = False) -> list:
        """Beam search over each prompt (vLLM's `LLM.beam_search`) -> list[BeamSearchOutput], in prompt order."""
        return _beam_search.beam_search(self, prompts, params, adapters, use_tqdm)

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; its final output (finish_reason "abort") comes with the next step.
        An unknown or finished id is ignored."""
        group = self.groups.get(str(request_id))
        if group is not None:
            self._abort_group(group)

    def _abort_group(self, group: RequestGroup) -> None:
        if self.groups.get(group.request_id) is not group:
            return  # finished already (the id may serve a newer request now)
        del self.groups[group.request_id]
        for child in reversed(group.children):  # siblings waiting for their fork first
            if not child.is_finished:
                self.scheduler.finish(child, FinishReason.ABORT)
        if group not in self._claimed:
            self._undelivered[group] = None

    def _release(self, group: RequestGroup) -> None:
        """generate() or stream() is done with its request: abort it if it still runs, forget it."""
        if self._in_step:  # a finalizer (a dropped stream) ran inside a step: not under the scheduler's feet
            self._deferred_releases.append(group)
            return
        self._abort_group(group)
        self._claimed.discard(group)

    def generate(self, prompts, sampling_params=None, adapters=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. A single prompt (a string, a list of token ids)
        is one request. On any error the call's requests are aborted."""
        prompts = prompt_list(prompts)
        params = per_prompt(sampling_params, len(prompts), "sampling_params")
        adapter_names = per_prompt(adapters, len(prompts), "adapters")
        groups: list[RequestGroup] = []
        try:
            for prompt, p, adapter in zip(prompts, params, adapter_names):
                groups.append(self._submit(prompt, p, adapter, None))
                self._claimed.add(groups[-1])
            return self._run_to_completion(groups, use_tqdm)
        finally:
            for group in groups:
                self._release(group)

    def _run_to_completion(self, groups: list[RequestGroup], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm  # noqa: PLC0415

        pending = set(groups)
        results: dict[RequestGroup, RequestOutput] = {}
        with tqdm(total=len(groups), desc="paged_hf", unit="req", disable=not use_tqdm) as bar:
            while pending:
                touched = self._step_for_call()
                # nothing ran: the rest ended outside of a step (aborted)
                for group in touched if touched else list(pending):
                    if group.finished and group in pending:
                        results[group] = output = self._output(group)
                        pending.discard(group)
                        bar.update(1)
                        if output.error is not None:  # generate() raises; its caller aborts the call's others
                            raise RuntimeError(f"request {group.request_id} failed: {output.error}")
        return [results[group] for group in groups]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, adapter: str | None = None) -> TokenStream:
        """Submit one request now (bad input raises here) and iterate over its new token ids as they come;
        other requests keep running too. The request ends when the stream is closed, left (`with`) or
        dropped (a `break` out of `for tokens in gen.stream(...)`); it leaves no output for step()."""
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError("stream() serves one sequence: use n=1 (or step() for n > 1)")
        group = self._submit(prompt, sampling_params, adapter, None)
        self._claimed.add(group)
        return TokenStream(self, group)

    def stats(self) -> dict:
        return {
            "num_blocks": self.block_pool.num_blocks,
            "num_free_blocks": self.block_pool.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "max_num_running": self.scheduler.max_num_running,  # the most at once so far
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
        }


def _split_peft_model(model: torch.nn.Module):
    """-> (the PeftModel or None, the model the engine runs): a PeftModel's adapters are served by name, and
    its base model (with peft's layers bypassed in every step) runs underneath."""
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        return model, model.get_base_model()
    return None, model
