"""`ContinuousBatchGenerator`: wraps `model.forward` with a scheduler, a paged cache and a sampler.

The engine's face: it owns the parts, takes requests, and keeps the books of which call reports which output.
One iteration (schedule -> run the model once on the packed row -> postprocess) is `EngineStep` (step.py);
a request group is built from a prompt by `RequestBuilder` (request_builder.py); beam searches are run by
beam_search.py, streams by token_stream.py, both through the engine's API for its own callers below.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging

from paged_hf.beam.group import BeamGroup
from paged_hf.config import PagedConfig
from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager
from paged_hf.core.request import Request
from paged_hf.core.scheduler import Scheduler
from paged_hf.core.state_slots import StateSlots
from paged_hf.engine import beam_search as _beam_search
from paged_hf.engine.adapter_store import AdapterStore
from paged_hf.engine.adapter_store import is_ready as adapter_is_ready
from paged_hf.engine.adapters import adapter_slots, lora_manager, split_peft_model
from paged_hf.engine.embedding import embedding_group
from paged_hf.engine.face import EngineFace, EngineLimits, Preparation
from paged_hf.engine.hybrid import hybrid_config
from paged_hf.engine.image_prompts import check_adapter, processed_prompt, prompt_and_items, prompt_processor
from paged_hf.engine.pipeline_step import PipelineStep, pipeline_config
from paged_hf.engine.request_builder import RequestBuilder
from paged_hf.engine.request_checks import check_fits, check_token_ids, per_prompt, prompt_list, prompt_token_ids
from paged_hf.engine.request_group import RequestGroup
from paged_hf.engine.step import EngineStep
from paged_hf.engine.stopping import StopChecker
from paged_hf.engine.token_stream import TokenStream
from paged_hf.loader.pipeline_stage import stage_of
from paged_hf.multimodal.registry import split_processor
from paged_hf.outputs import CompletionOutput, EmbeddingRequestOutput, FinishReason, RequestOutput
from paged_hf.pooling_params import PoolingParams
from paged_hf.sample.sampler import Sampler
from paged_hf.sampling_params import SamplingParams
from paged_hf.spec_decode import Speculator, make_proposer
from paged_hf.worker.cache_sizing import num_blocks_from_memory, state_slot_count
from paged_hf.worker.model_info import inspect_model
from paged_hf.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from paged_hf.integrations.peft import LoRAAdapter

logger = logging.get_logger(__name__)


class ContinuousBatchGenerator(EngineFace):
    def __init__(self, model: torch.nn.Module, config: PagedConfig | None = None, tokenizer=None):
        peft_model, model = split_peft_model(model)
        self.serves_peft_model = peft_model is not None
        self.tokenizer, processor = split_processor(tokenizer)  # wrap(model, processor) for images
        self.prompt_processor = prompt_processor(model, processor)  # None for text only
        self.info = inspect_model(model)
        self.config = hybrid_config(config or PagedConfig(), self.info)
        stage = stage_of(model)  # a pipeline stage (one run of the layers, in a process of its own) or None
        if stage is not None:
            self.config = pipeline_config(self.config, self.info, stage)
        self.max_model_len = self.config.max_model_len or self.info.max_positions or 2048
        num_blocks = self.config.num_blocks or num_blocks_from_memory(self.info, self.config, self.max_model_len)
        self.runner = ModelRunner(model, self.info, num_blocks, self.config)
        self.adapter_store = AdapterStore(self.runner, self.config.lora)
        self.block_pool = BlockPool(num_blocks, self.config.enable_prefix_caching)
        state_slots = StateSlots(state_slot_count(self.config)) if self.info.is_hybrid else None
        transfer = self.config.kv_transfer_config
        self._kv_producer = transfer is not None and transfer.is_producer  # finished outputs carry their blocks' keys
        self.kv_cache_manager = KVCacheManager(self.block_pool, self.config.block_size, self.runner.kv_tier, state_slots)
        self.scheduler = Scheduler(self.kv_cache_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   max_loras=adapter_slots(self.config.lora, self.info), is_ready=adapter_is_ready,
                                   policy=self.config.scheduling_policy, tenant_weights=self.config.tenant_weights,
                                   max_stream_gap_s=self.config.max_stream_gap_s,
                                   micro_batches=self.config.pipeline_batches_in_flight or 1)
        self.sampler = Sampler(self.info.eos_token_ids)
        self.stop_checker = StopChecker(self.info.eos_token_ids, self.max_model_len)
        speculative = self.config.speculative
        self.speculator = None if speculative is None else Speculator(
            speculative, self.kv_cache_manager, make_proposer(speculative, self.config, self.info, num_blocks))
        self.groups: dict[str, RequestGroup | BeamGroup] = {}  # unfinished requests by id
        self.pooling_config = None  # embeddings: the model's pooling, read on first use (engine/embedding.py)
        self.request_builder = RequestBuilder(self.config.limits, self.config.scheduler, self.tokenizer,
                                              self.info.vocab_size, self.info.eos_token_ids, self.runner.logits_device)
        parts = (self.scheduler, self.runner, self.sampler, self.stop_checker, self.speculator, self.groups,
                 self.config.max_num_batched_tokens, self.adapter_store)
        self.engine_step = EngineStep(*parts) if stage is None else PipelineStep(
            *parts, links=self.runner.links, depth=self.config.pipeline_batches_in_flight)
        # Outputs step() owes: requests of add_request that changed while generate()/stream() stepped the
        # engine, and aborts. Requests of generate()/stream() (claimed) are reported by those calls only.
        self._undelivered: dict[RequestGroup | BeamGroup, None] = {}
        self._claimed: set[RequestGroup | BeamGroup] = set()
        self._in_step = False
        self._deferred_releases: list[RequestGroup | BeamGroup] = []  # streams dropped (finalized) during a step
        self._ids = itertools.count()
        if peft_model is not None:
            lora_manager(self.runner, self.config.lora).add_peft_model(peft_model)
        if not isinstance(self.config.adapters, dict):
            raise ValueError(f"adapters must be a dict {{name: peft folder}}, got {self.config.adapters!r}")
        for name, path in self.config.adapters.items():
            self.load_adapter(name, path)

    # --- submission -----------------------------------------------------------------------------------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None, adapter: str | None = None,
                    request_id: str | None = None, *, cache_salt: str | None = None, priority: int = 0,
                    tenant: str | None = None) -> str:
        """Validate and queue one request. Bad input raises ValueError and queues nothing.

        n > 1: n sequences (children); only child 0 is queued, the others fork from it once it computed the
        prompt (sharing its KV blocks), so the prompt is computed once. `cache_salt`: prefix-cache blocks are
        shared only between requests with the same salt (e.g. one per tenant). `priority` (lower first, vLLM's
        meaning) needs scheduling_policy "priority"; `tenant` (default: the adapter) is who shares under "fair".
        """
        return self._submit(prompt, sampling_params, adapter, request_id, cache_salt, priority, tenant).request_id

    def _submit(self, prompt, sampling_params, adapter, request_id, cache_salt=None, priority=0,
                tenant=None) -> RequestGroup:
        self.request_builder.check_scheduling(priority, tenant)
        if isinstance(sampling_params, PoolingParams):  # an embedding request: prefill only, pooled
            self._check_not_pipelined("embedding requests")
            group = embedding_group(self, prompt, sampling_params, adapter, request_id, cache_salt)
            self.request_builder.assign_scheduling(group, priority, tenant, adapter)
            self.enqueue(group, group.children[0])
            return group
        params = self.request_builder.sampling_params(sampling_params, cache_salt)
        processed = prompt_and_items(self, prompt)  # a dict prompt may hold images (and its family's positions)
        self.check_fits(processed.token_ids, params)
        check_token_ids(params, self.info.vocab_size)
        lora = self.resolve_adapter(adapter)
        check_adapter(self.runner.vision, lora, processed.items)  # images meet no adapter of the vision encoder
        if adapter is not None and self.speculator is not None and not self.speculator.proposer.serves_adapters:
            raise ValueError(f"adapter {adapter!r}: this engine speculates with a draft model, which serves "
                             f"base-model requests only (the ngram method serves any adapter)")
        request_id = self.new_request_id(request_id)
        group = self.request_builder.group(request_id, processed, params, adapter, lora, cache_salt)
        self.request_builder.assign_scheduling(group, priority, tenant, adapter)
        self.enqueue(group, group.children[0])
        return group

    def add_beam_request(self, prompt, params, adapter: str | None = None, request_id: str | None = None) -> str:
        """Queue one beam search (`BeamSearchParams`); step() reports it once, finished, with its best
        hypotheses as outputs. Its beams run in the same steps as every other request."""
        self._check_not_pipelined("beam search")
        return _beam_search.add_beam_request(self, prompt, params, adapter, request_id)

    # --- the engine's API for its own callers (beam_search.py, token_stream.py, the drop-in generate) -----
    def _check_not_pipelined(self, what: str) -> None:
        if isinstance(self.engine_step, PipelineStep):
            raise ValueError(f"{what}: not served pipeline-parallel (a pipeline's stages exchange sampled tokens only)")

    def prompt_token_ids(self, prompt) -> list[int]:
        """A prompt (text, token ids, 1-D tensor) as token ids; ValueError for an empty or out-of-vocabulary one."""
        return prompt_token_ids(prompt, self.tokenizer, self.info.vocab_size)

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError unless prompt + max_new_tokens fits max_model_len and the whole cache."""
        check_fits(prompt_ids, params, self.max_model_len, self.config.block_size, self.block_pool.num_blocks)

    def resolve_adapter(self, name: str | None) -> LoRAAdapter | None:
        """The in-memory adapter a request names; None for the base model, and while the adapter's folder is
        read (the request then waits in the queue, unbound: engine.adapter_store); ValueError for an unknown name."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"unknown adapter {name!r}; loaded adapters: {self.adapter_names()}")
        return self.adapter_store.adapter_for(name)

    def new_request_id(self, request_id: str | None = None) -> str:
        """A new request's id: the one given (ValueError if an unfinished request has it), else the next number."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def enqueue(self, group: RequestGroup | BeamGroup, first: Request) -> None:
        """Track the checked request under its id and queue its first sequence (the others fork from it)."""
        self.groups[group.request_id] = group
        self.scheduler.add(first)

    def claim(self, group: RequestGroup | BeamGroup) -> None:
        """The calling method (generate, stream, beam_search) reports this request itself; step() never will."""
        self._claimed.add(group)

    def release(self, group: RequestGroup | BeamGroup) -> None:
        """The claiming call is done with its request: abort it if it still runs, forget it."""
        if self._in_step:  # a finalizer (a dropped stream) ran inside a step: not under the scheduler's feet
            self._deferred_releases.append(group)
            return
        self._abort_group(group)
        self._claimed.discard(group)

    def step_for_call(self) -> list[RequestGroup | BeamGroup]:
        """A step taken by generate(), stream() or beam_search(): what it does to other requests waits for
        step(); -> the requests that changed."""
        touched = self._step()
        self._undelivered.update((group, None) for group in touched if group not in self._claimed)
        self._apply_deferred_releases()
        return touched

    # --- LoRA adapters --------------------------------------------------------------------------------
    def load_adapter(self, name: str, path) -> None:
        """Load the peft LoRA folder `path` under `name`. Under a name already loaded, the new weights serve
        new requests while running ones finish with the old (a new version: no prefix-cache block is shared
        between them). An unusable folder raises ValueError and changes nothing."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        self.adapter_store.register(name, path)

    def unload_adapter(self, name: str) -> None:
        """New requests can no longer use `name`; requests already submitted finish with its weights."""
        if name not in self.adapter_names():
            raise ValueError(f"unknown adapter {name!r}; loaded adapters: {self.adapter_names()}")
        self.adapter_store.unregister(name)

    def adapter_names(self) -> list[str]:
        """Adapters loaded or registered by name (not every folder under `lora_root`: those are found on use)."""
        return self.adapter_store.names()

    def serves_adapter(self, name: str) -> bool:
        """Whether a request may name `name`: loaded, registered, or a folder under `lora_root`."""
        return name in self.adapter_names() or self.adapter_store.folder(name) is not None

    # --- running --------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._undelivered) or self.engine_step.has_work()

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; the outputs (cumulative) of every request of `add_request` that changed,
        since the last step() (so also while generate() or stream() stepped the engine)."""
        touched = self._step()
        ready, self._undelivered = self._undelivered, {}
        ready.update((group, None) for group in touched if group not in self._claimed)
        self._apply_deferred_releases()
        return [self._output(group) for group in ready]

    def _step(self) -> list[RequestGroup | BeamGroup]:
        """One iteration of the engine; -> the requests that changed."""
        self._apply_deferred_releases()  # left over by a step that raised
        self._in_step = True
        try:
            return self.engine_step.run()
        finally:
            self._in_step = False

    def _apply_deferred_releases(self) -> None:
        deferred, self._deferred_releases = self._deferred_releases, []
        for group in deferred:
            self.release(group)

    def _output(self, group: RequestGroup | BeamGroup) -> RequestOutput:
        """The group's output; an exception that belongs to this one request (its text could not be decoded)
        fails only it: aborted, blocks freed, reported with `error`."""
        error = self.engine_step.errors.pop(group.request_id, None)
        if error is None:
            try:
                output = group.output()
                if output.finished and self._kv_producer and isinstance(group, RequestGroup):
                    output.kv_transfer_params = self.runner.kv_tier.prompt_params(group.children[0])
                return output
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

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; its final output (finish_reason "abort") comes with the next step.
        An unknown or finished id is ignored."""
        group = self.groups.get(str(request_id))
        if group is not None:
            self._abort_group(group)

    def _abort_group(self, group: RequestGroup | BeamGroup) -> None:
        if self.groups.get(group.request_id) is not group:
            return  # finished already (the id may serve a newer request now)
        del self.groups[group.request_id]
        for child in reversed(group.children):  # siblings waiting for their fork first
            if not child.is_finished:
                self.scheduler.finish(child, FinishReason.ABORT)
        if group not in self._claimed:
            self._undelivered[group] = None

    # --- calls that run their requests to the end -----------------------------------------------------
    def generate(self, prompts, sampling_params=None, adapters=None, use_tqdm: bool = True,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. A single prompt (a string, a list of token ids)
        is one request. On any error the call's requests are aborted."""
        prompts = prompt_list(prompts)
        params = per_prompt(sampling_params, len(prompts), "sampling_params")
        adapter_names = per_prompt(adapters, len(prompts), "adapters")
        ranks = per_prompt(priority, len(prompts), "priority")
        groups: list[RequestGroup] = []
        try:
            for prompt, p, adapter, rank in zip(prompts, params, adapter_names, ranks):
                groups.append(self._submit(prompt, p, adapter, None, priority=rank))
                self.claim(groups[-1])
            return self._run_to_completion(groups, use_tqdm)
        finally:
            for group in groups:
                self.release(group)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              adapters=None, use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order, pooled as the model's sentence-transformers config says
        (else its last token). They run in the engine's steps beside any generation request."""
        params = per_prompt(pooling_params, len(prompt_list(prompts)), "pooling_params")
        return self.generate(prompts, [p or PoolingParams() for p in params], adapters, use_tqdm)

    def _run_to_completion(self, groups: list[RequestGroup], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm  # noqa: PLC0415

        pending, results = set(groups), {}  # results: each finished group's output
        with tqdm(total=len(groups), desc="paged_hf", unit="req", disable=not use_tqdm) as bar, \
                self.runner.call_scope.call():  # its steps run back to back (worker/call_scope.py)
            while pending:
                touched = self.step_for_call()
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
        if isinstance(sampling_params, PoolingParams):
            raise ValueError("stream() yields generated tokens and an embedding request (PoolingParams) has none: "
                             "use embed() or add_request()")
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError("stream() serves one sequence: use n=1 (or step() for n > 1)")
        group = self._submit(prompt, sampling_params, adapter, None)
        self.claim(group)
        return TokenStream(group, self.step_for_call, self.release)

    def beam_search(self, prompts: Sequence, params, adapters=None, use_tqdm: bool = False) -> list:
        """Beam search over each prompt (vLLM's `LLM.beam_search`) -> list[BeamSearchOutput], in prompt order."""
        return _beam_search.beam_search(self, prompts, params, adapters, use_tqdm)

    # --- the rest of its face to a server (engine/face.py) -------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        c = self.config
        return EngineLimits(min(self.max_model_len, self.block_pool.num_blocks * c.block_size), self.info.vocab_size,
                            c.max_num_seqs, c.max_grammar_depth, c.lora_root, self.prompt_processor is not None)

    def process_prompt(self, prompt, add_special_tokens: bool | None = None):
        return processed_prompt(self, prompt, add_special_tokens)

    def has_started(self, request_id: str) -> bool:
        return (group := self.groups.get(request_id)) is None or group.children[0].num_computed_tokens > 0

    def prepare(self, sampling_params) -> Preparation | None:
        builder = self.request_builder
        future = builder.prepare(sampling_params)
        if future is None:
            return None
        spec = sampling_params.structured_outputs
        return Preparation(future, builder.grammar_limits.compile_timeout_s, lambda: builder.compiler().timed_out(spec))

    def resident_adapter_names(self) -> list[str]:
        return sorted(self.runner.lora.resident_names) if self.runner.lora is not None else []

    def kv_transfer(self):
        transfer = self.config.kv_transfer_config
        return None if transfer is None else (transfer, self.runner.kv_tier)

    def stats(self) -> dict:
        return {
            "num_blocks": self.block_pool.num_blocks, "num_free_blocks": self.block_pool.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "max_num_running": self.scheduler.max_num_running,  # the most at once so far
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
            **(self.runner.kv_tier.stats() if self.runner.kv_tier is not None else {}),
            **(self.runner.encoder_cache.stats() if self.runner.encoder_cache is not None else {}),
            **self.adapter_store.stats(self.scheduler.running, self.scheduler.waiting),
        }

