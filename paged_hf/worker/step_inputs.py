"""The inputs of one step, built once: a packed row of all scheduled tokens and its attention metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_hf.core.multimodal import step_spans
from paged_hf.core.scheduler_output import SchedulerOutput
from paged_hf.worker.pooling import PoolingSpan


@dataclass
class AttentionMetadata:
    """Kernel-independent description of the packed row; kernels turn it into their own plan."""

    block_size: int
    query_start_loc: list[int]  # [num_requests + 1]: request i's tokens are [start[i], start[i + 1])
    context_lens: list[int]  # [num_requests]: K/V length of each request once this step is written
    block_tables: list[list[int]]  # [num_requests][num_blocks_of_request]
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes (block * size + offset)
    state_slots: list[int | None] | None = None  # [num_requests]: a hybrid model's recurrent-state slots
    # [num_requests][spans]: (start, end) positions whose tokens all see each other (Gemma 3's images) that each
    # request's chunk overlaps; None when no request has any (kernels whose spec has `bidirectional_spans` read it)
    bidirectional: list[tuple[tuple[int, int], ...]] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        starts = self.query_start_loc
        return [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor  # [num_sampled] int64: the last token of each request that samples
    sampled: list  # the ScheduledRequests that sample this step, in logits_indices order
    attention: AttentionMetadata
    adapter_slots: torch.Tensor | None = None  # [num_tokens] int64: LoRA slot per token, -1 = base; None: no LoRA
    # Prompt logprobs: (request, first logits row, first position, count): logits rows [row, row + count) are
    # those of positions [pos, pos + count), which predict prompt tokens pos + 1 .. pos + count.
    prompt_logprob_spans: list = field(default_factory=list)
    sample_rows: torch.Tensor | None = None  # [num_sampled]: the sampled requests' logits rows; None: all rows
    # speculative decoding: the logits rows of every draft (request order) come last, after the sampled rows
    num_spec_rows: int = 0
    # embeddings: the rows each embedding request's pooling reads, and after the forward their final hidden
    # states, one [count, hidden_size] tensor per span (both filled by the model runner, worker/pooling.py)
    pooling_spans: list[PoolingSpan] = field(default_factory=list)
    pooled_hidden_states: list[torch.Tensor] = field(default_factory=list)


def token_adapter_slots(out: SchedulerOutput, request_slots: list[int] | None) -> torch.Tensor | None:
    """Each token gets its request's adapter slot: [num_tokens] int64 (-1 = base), None when no request
    of the step has an adapter (the forward then has no LoRA work at all)."""
    if request_slots is None:
        return None
    counts = torch.tensor([s.num_new_tokens for s in out.scheduled], dtype=torch.long)
    return torch.tensor(request_slots, dtype=torch.long).repeat_interleave(counts)


def bidirectional_spans(out: SchedulerOutput) -> list[tuple[tuple[int, int], ...]] | None:
    """Each scheduled request's bidirectional spans that its chunk overlaps (core/multimodal.py); None when no
    request has any, as in every step of a model without such images (a text request costs one check)."""
    spans = []
    for scheduled in out.scheduled:
        request, start = scheduled.request, scheduled.request.num_computed_tokens
        spans.append(step_spans(request.mm_items, start, start + scheduled.num_new_tokens) if request.mm_items else ())
    return spans if any(spans) else None


def build_step_inputs(out: SchedulerOutput, block_size: int, request_slots: list[int] | None = None) -> StepInputs:
    """Packs the step's tokens with no padding; all tensors on CPU (each device copies what it needs).
    `request_slots`: the LoRA slot of each scheduled request (-1 = base), or None without adapters."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    context_lens, block_tables = [], []
    logits_indices = []
    sampled = []
    sample_rows = []
    spans = []
    spec_rows = []  # input positions of draft tokens, whose logits verify the next draft (or give a bonus token)
    for scheduled in out.scheduled:
        request = scheduled.request
        start = request.num_computed_tokens
        end = start + scheduled.num_new_tokens
        num_spec = scheduled.num_spec_tokens
        input_ids.extend(request.all_token_ids[start:end - num_spec])
        if num_spec:
            spec_rows.extend(range(len(input_ids), len(input_ids) + num_spec))
            input_ids.extend(request.spec_token_ids)
        positions.extend(range(start, end))
        block_ids = request.block_ids
        slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(len(input_ids))
        context_lens.append(end)
        block_tables.append(block_ids)
        if request.prompt_logprobs is not None:  # positions up to the last prompt token's predecessor
            count = min(end, request.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((request, len(logits_indices), start, count))
                first = len(input_ids) - (end - start)
                logits_indices.extend(range(first, first + count))
        if scheduled.samples and request.pooling is None:  # an embedding request samples nothing
            sample_rows.append(len(logits_indices))
            logits_indices.append(len(input_ids) - 1 - num_spec)
            sampled.append(scheduled)
    if spec_rows:
        sample_rows.extend(range(len(logits_indices), len(logits_indices) + len(spec_rows)))
        logits_indices.extend(spec_rows)
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        sampled=sampled,
        attention=AttentionMetadata(
            block_size=block_size,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            state_slots=[scheduled.request.state_slot for scheduled in out.scheduled],
            bidirectional=bidirectional_spans(out),
        ),
        adapter_slots=token_adapter_slots(out, request_slots),
        prompt_logprob_spans=spans,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long) if spans else None,
        num_spec_rows=len(spec_rows),
    )
