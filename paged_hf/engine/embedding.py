"""Embedding requests in the engine: built from a prompt and `PoolingParams`, run as prefill-only requests in
the same packed steps as generation, pooled when their last prompt token is computed, and finished there.

The pooling comes from the model folder's sentence-transformers config (`loader/pooling_config.py`), read once
from the model's `name_or_path`; without one a decoder model is pooled at its last token and normalized.
Encoders (bidirectional attention) are refused: the paged attention kernels are causal, and an encoder run
causally gives other vectors than sentence-transformers would.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paged_hf.core.request import Request
from paged_hf.loader.pooling_config import DEFAULT_DECODER_POOLING, PoolingConfig, read_pooling_config
from paged_hf.outputs import EmbeddingOutput, EmbeddingRequestOutput, FinishReason, RequestMetrics
from paged_hf.pooling_params import PoolingParams
from paged_hf.sampling_params import SamplingParams
from paged_hf.utils import cdiv
from paged_hf.worker.pooling import base_module, finish_vector, pool
from paged_hf.worker.step_inputs import StepInputs


class EmbeddingGroup:
    """One embedding request: its one sequence, the hidden states its pooling read so far, and its vector."""

    def __init__(self, request: Request, params: PoolingParams, config: PoolingConfig):
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.children = [request]
        self.params = params
        self.normalize = config.normalize if params.normalize is None else params.normalize
        self.chunks: list[torch.Tensor] = []  # [count, hidden_size] each, in position order
        self.embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.children[0].is_finished

    def add_hidden_states(self, position: int, hidden_states: torch.Tensor) -> None:
        """Rows from `position` on. A prompt computed again from 0 (after a preemption) starts over."""
        if position == 0:
            self.chunks = []
        if len(hidden_states):
            self.chunks.append(hidden_states)

    def pool(self) -> None:
        request = self.children[0]
        vector = pool(request.pooling, torch.cat(self.chunks))  # [hidden_size]
        self.chunks = []
        self.embedding = finish_vector(vector, self.normalize, self.params.dimensions)

    def output(self) -> EmbeddingRequestOutput:
        request = self.children[0]
        return EmbeddingRequestOutput(
            self.request_id, self.prompt_token_ids,
            None if self.embedding is None else EmbeddingOutput(self.embedding), self.finished,
            RequestMetrics(request.arrival_time, request.finish_time, request.finish_time))


def pooling_config_for(model: torch.nn.Module) -> PoolingConfig:
    """The model's pooling: its folder's sentence-transformers config, else last token; ValueError for an
    encoder or a model whose final hidden states cannot be read."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or any(
            getattr(module, "is_causal", True) is False for module in model.modules()):
        raise ValueError(f"{type(model).__name__} attends bidirectionally (an encoder): paged_hf embeds with "
                         f"decoder (causal) models only; use sentence-transformers for encoders")
    base_module(model)
    folder = getattr(model, "name_or_path", "") or ""
    found = read_pooling_config(folder) if folder and Path(folder).is_dir() else None
    return found or DEFAULT_DECODER_POOLING


def embedding_group(generator, prompt, params: PoolingParams, adapter: str | None, request_id: str | None,
                    cache_salt: str | None) -> EmbeddingGroup:
    """A checked embedding request, not queued yet. ValueError for a bad prompt, a prompt longer than
    max_model_len or the whole cache, or a model that cannot embed."""
    if generator.pooling_config is None:
        generator.pooling_config = pooling_config_for(generator.runner.model)
    config = generator.pooling_config
    prompt_ids = generator.prompt_token_ids(prompt)
    if len(prompt_ids) > generator.max_model_len:
        raise ValueError(f"the prompt ({len(prompt_ids)} tokens) is longer than max_model_len="
                         f"{generator.max_model_len}")
    needed, num_blocks = cdiv(len(prompt_ids), generator.config.block_size), generator.block_pool.num_blocks
    if needed > num_blocks:
        raise ValueError(f"a prompt of {len(prompt_ids)} tokens needs {needed} KV blocks but the whole cache has "
                         f"{num_blocks}; raise num_blocks/kv_cache_memory")
    hidden_size = getattr(getattr(generator.runner.model, "config", None), "hidden_size", None)
    if params.dimensions is not None and hidden_size is not None and params.dimensions > hidden_size:
        raise ValueError(f"dimensions={params.dimensions} is larger than the model's embedding size {hidden_size}")
    lora = generator.resolve_adapter(adapter)
    request = Request(generator.new_request_id(request_id), 0, prompt_ids, SamplingParams(max_new_tokens=1),
                      adapter, adapter_version=None if lora is None else lora.version, lora=lora,
                      cache_salt=cache_salt, pooling=config.pooling_type)
    return EmbeddingGroup(request, params, config)


def finish_pooled(inputs: StepInputs, groups: dict, scheduler, now: float) -> list[EmbeddingGroup]:
    """After a forward: hand each embedding request its rows' hidden states; those whose prompt is complete are
    pooled and finished (blocks freed). -> the groups that finished."""
    finished = []
    for span, hidden_states in zip(inputs.pooling_spans, inputs.pooled_hidden_states):
        group = groups.get(span.request.request_id)
        if not isinstance(group, EmbeddingGroup) or span.request.is_finished:
            continue
        group.add_hidden_states(span.position, hidden_states)
        if span.completes:
            group.pool()
            span.request.first_token_time = span.request.finish_time = now
            scheduler.finish(span.request, FinishReason.STOP)
            finished.append(group)
    return finished
