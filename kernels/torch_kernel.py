"""Pure-PyTorch paged attention over a packed row that mixes prefill chunks and decode tokens.

Decode rows (one query token each) are grouped by context length and each group runs one SDPA call over
its K/V, gathered block by block (whole blocks are contiguous, so the gather is a memcpy per block) and
padded to the group's longest context with a key mask; grouping keeps that padding small. Prefill chunks
run one SDPA call each: a fresh prompt attends to its own new K/V with `is_causal`; a chunk with a past
gathers its context's blocks with an offset causal mask. Everything index-shaped is built once per step in
`plan`; per layer only gathers and SDPA calls remain.

Bidirectional spans (`AttentionSpec.bidirectional_spans`, Gemma 3's images): a step's metadata may name, per
sequence, spans of positions whose tokens all see each other. A chunk's mask is then HF's: (causal OR same span)
AND window AND chunk, the window bounding only the keys behind a query. The scheduler never ends a chunk inside a
span, so a span's later keys are in the context of every query that needs them; a one-token query has no later
key in its context, so decodes need no span.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from paged_hf.kernels.base import write_kv_by_slots
from paged_hf.kernels.quant import KVScales, as_bytes, dequantize
from paged_hf.kernels.spec import NO_TERMS, AttentionSpec, ScoreTerms
from paged_hf.utils import cdiv

MAX_DECODE_PADDING = 1.25  # a decode group's padded K/V may be at most this much larger than its real K/V


@dataclass
class Query:
    """One sequence's tokens in the step: rows [start, start + length) of the packed row, attending to the first
    context_len tokens of its blocks (its own included; causal within the query)."""
    start: int
    length: int
    context_len: int
    block_table: list[int]  # the blocks that hold its context_len tokens
    spans: tuple[tuple[int, int], ...] = ()  # [start, end) positions whose tokens all see each other


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [num_rows] token index of each decode query in the packed row
    block_ids: torch.Tensor  # [num_rows * max_blocks] each row's blocks, padded with block 0
    context_lens: torch.Tensor  # [num_rows]
    max_blocks: int


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks] the context's blocks
    fresh: bool  # a whole prompt in one chunk: without quantization its context is this step's K/V
    spans: tuple[tuple[int, int], ...] = ()  # [start, end) positions whose tokens all see each other


@dataclass
class TorchPlan:
    slot_mapping: torch.Tensor  # [num_tokens]
    decodes: Any  # what `attend_decodes` needs: here a list[DecodeGroup]; subclasses plan their own
    prefills: list[PrefillChunk]
    masks: dict = field(default_factory=dict)  # (kind, index, window, chunk) -> bool mask, built on first use
    buffers: dict = field(default_factory=dict)  # (kind, index, shape, dtype) -> gather destinations, reused by every layer
    quant_write: Any = None  # a quantized cache's write bookkeeping (kernels.quant.WritePlan), made on first use


class TorchKernel:
    name = "torch"
    per_block_kv_scales = True  # reads a quantized cache's scale per (block, KV head) (kernels/quant.py)

    def plan(self, metadata, device: torch.device) -> TorchPlan:
        block_size = metadata.block_size
        starts = metadata.query_start_loc
        queries = []
        spans = getattr(metadata, "bidirectional", None)  # None: every query is causal
        for i, context_len in enumerate(metadata.context_lens):
            table = metadata.block_tables[i][: cdiv(context_len, block_size)]
            queries.append(Query(starts[i], starts[i + 1] - starts[i], context_len, table,
                                 tuple(spans[i]) if spans else ()))
        return self.plan_queries(metadata.slot_mapping.to(device), queries, device)

    def plan_queries(self, slot_mapping: torch.Tensor, queries: list[Query], device: torch.device) -> TorchPlan:
        """One-token queries are decodes (grouped by context length), longer ones prefill chunks (a one-token
        query's context holds no later key of its span: its spans are dropped)."""
        decodes = [(q.context_len, q.start, q.block_table) for q in queries if q.length == 1]
        prefills = [prefill_chunk(q, device) for q in queries if q.length > 1]
        return TorchPlan(slot_mapping, self.plan_decodes(decodes, device), prefills)

    def plan_decodes(self, decodes: list[tuple[int, int, list[int]]], device: torch.device) -> list[DecodeGroup]:
        """decodes: (context_len, row, block_table) of every one-token query of the step."""
        return [_decode_group(group, device) for group in _group_by_length(decodes)]

    def write_kv(self, key, value, key_cache, value_cache, plan: TorchPlan, scales: KVScales | None = None) -> None:
        write_kv_by_slots(key, value, key_cache, value_cache, plan.slot_mapping, scales, plan)

    @staticmethod
    def unsupported_reason(spec: AttentionSpec) -> str | None:
        """None: the reference computes every spec (any device, dtype, head dims, window, chunk and score term)."""
        return None

    def attend(self, query, key, value, key_cache, value_cache, plan: TorchPlan, *, scaling, sliding_window, softcap,
               scales: KVScales | None = None, chunk_size: int | None = None, terms: ScoreTerms = NO_TERMS):
        """`terms`: what some models add to the scores (sinks, a bias by distance, ALiBi, a selection of keys)."""
        # [num_tokens, num_heads, value_head_dim]
        output = query.new_empty(*query.shape[:-1], value_cache.shape[-1])
        masking = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap, scales=scales,
                       chunk_size=chunk_size, terms=terms)
        self.attend_decodes(query, output, key_cache, value_cache, plan, **masking)
        self.attend_prefills(query, key, value, output, key_cache, value_cache, plan, **masking)
        return output

    def attend_decodes(self, query, output, key_cache, value_cache, plan: TorchPlan, *, scaling, sliding_window,
                       softcap, scales=None, chunk_size=None, terms: ScoreTerms = NO_TERMS) -> None:
        """Writes the output rows of the one-token queries."""
        num_kv_heads, head_dim = key_cache.shape[-2:]
        value_head_dim = value_cache.shape[-1]
        for index, group in enumerate(plan.decodes):
            num_rows = group.rows.shape[0]
            q = query.index_select(0, group.rows).unsqueeze(2)  # [num_rows, num_heads, 1, head_dim]
            # [num_rows, num_kv_heads, max_blocks * block_size, head_dim]
            k, v = _gather_blocks(plan, ("decode", index), key_cache, value_cache, group.block_ids, scales, query.dtype)
            k = k.view(num_rows, -1, num_kv_heads, head_dim).transpose(1, 2)
            v = v.view(num_rows, -1, num_kv_heads, value_head_dim).transpose(1, 2)
            mask = self._decode_mask(plan, index, group, k.shape[2], sliding_window, chunk_size)
            sinks_, bias = terms.sinks, None
            if terms.per_query:  # [num_rows, num_heads, 1, ...] over the group's padded keys
                distance = (group.context_lens[:, None] - 1) - torch.arange(k.shape[2], device=q.device)[None, :]
                bias, row_sinks, selected = terms_of_rows(terms, lambda t: t.index_select(0, group.rows), distance)
                if selected is not None:
                    mask = mask & selected[:, None, None, :]
                sinks_ = sinks_ if row_sinks is None else row_sinks.unsqueeze(2)
                bias = None if bias is None else bias.unsqueeze(2)
            out = attention(q, k, v, mask, scaling, softcap, sinks=sinks_, bias=bias)
            output.index_copy_(0, group.rows, out.squeeze(2))

    def attend_prefills(self, query, key, value, output, key_cache, value_cache, plan: TorchPlan, *, scaling,
                        sliding_window, softcap, scales=None, chunk_size=None, terms: ScoreTerms = NO_TERMS) -> None:
        """Writes the output rows of the prefill chunks."""
        if not plan.prefills:  # a step of decodes: nothing to set up
            return
        num_kv_heads, head_dim = key_cache.shape[-2:]
        value_head_dim = value_cache.shape[-1]
        for index, chunk in enumerate(plan.prefills):
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
            if chunk.fresh and scales is None:
                k, v = key[rows], value[rows]  # a fresh prompt: its context is this step's K/V
            else:  # [context_len, num_kv_heads, head_dim]; a quantized cache is read back, as a decode will
                k, v = _gather_blocks(plan, ("prefill", index), key_cache, value_cache, chunk.block_ids, scales,
                                      query.dtype)
                k = k.view(-1, num_kv_heads, head_dim)[: chunk.context_len]
                v = v.view(-1, num_kv_heads, value_head_dim)[: chunk.context_len]
            k = k.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, context_len, head_dim]
            v = v.transpose(0, 1).unsqueeze(0)
            plain = (sliding_window is None and softcap is None and chunk_size is None and terms.none
                     and not chunk.spans)
            if chunk.fresh and plain:
                out = attention(q, k, v, None, scaling, None, is_causal=True)
            else:
                mask = self._prefill_mask(plan, index, chunk, sliding_window, chunk_size, q.device)
                sinks_, bias = terms.sinks, None
                if terms.per_query:  # [rows, heads, ...] -> [1, heads, rows, ...] over the context's keys
                    offset = chunk.context_len - chunk.query_len
                    distance = (torch.arange(offset, chunk.context_len, device=q.device)[:, None]
                                - torch.arange(chunk.context_len, device=q.device)[None, :])
                    bias, row_sinks, selected = terms_of_rows(terms, lambda t: t[rows], distance)
                    if selected is not None:
                        mask = mask & selected
                    sinks_ = sinks_ if row_sinks is None else row_sinks.transpose(0, 1).unsqueeze(0)
                    bias = None if bias is None else bias.transpose(0, 1).unsqueeze(0)
                out = attention(q, k, v, mask, scaling, softcap, sinks=sinks_, bias=bias)
            output[rows] = out[0].transpose(0, 1)

    @staticmethod
    def _decode_mask(plan: TorchPlan, index: int, group: DecodeGroup, padded_len: int, window: int | None,
                     chunk_size: int | None = None) -> torch.Tensor:
        """Keys within the row's context, within its sliding window, within its attention chunk (Llama 4's
        chunked layers: a query sees the keys of its own chunk of `chunk_size` positions)."""
        key = ("decode", index, window, chunk_size)
        if key not in plan.masks:
            lens = group.context_lens
            key_pos = torch.arange(padded_len, device=lens.device)
            mask = key_pos[None, :] < lens[:, None]
            if window is not None:
                mask &= key_pos[None, :] > (lens[:, None] - 1 - window)
            if chunk_size is not None:
                mask &= key_pos[None, :] >= (lens[:, None] - 1) // chunk_size * chunk_size
            plan.masks[key] = mask[:, None, None, :]  # [num_rows, 1, 1, padded_len]
        return plan.masks[key]

    @staticmethod
    def _prefill_mask(plan: TorchPlan, index: int, chunk: PrefillChunk, window: int | None, chunk_size: int | None,
                      device) -> torch.Tensor:
        key = ("prefill", index, window, chunk_size)
        if key not in plan.masks:
            offset = chunk.context_len - chunk.query_len  # position of the chunk's first query token
            query_pos = torch.arange(offset, chunk.context_len, device=device)[:, None]
            key_pos = torch.arange(chunk.context_len, device=device)[None, :]
            mask = key_pos <= query_pos
            for start, end in chunk.spans:  # a span's tokens see each other: its later keys too
                mask |= (query_pos >= start) & (query_pos < end) & (key_pos >= start) & (key_pos < end)
            if window is not None:
                mask &= key_pos > query_pos - window
            if chunk_size is not None:
                mask &= key_pos >= query_pos // chunk_size * chunk_size
            plan.masks[key] = mask  # [query_len, context_len]
        return plan.masks[key]


def _gather_blocks(plan: TorchPlan, key, key_cache, value_cache, block_ids, scales: KVScales | None = None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the listed blocks of K and V into buffers that every layer of the step reuses: allocating tens of
    MB per layer costs more than the copy (fresh pages fault in on every use). A quantized cache's blocks are
    dequantized to `dtype` (only the blocks read, never the whole cache)."""
    rows, value_rows = key_cache[0].numel(), value_cache[0].numel()
    buffer_key = (*key, rows, value_rows, key_cache.dtype)
    key_cache, value_cache = as_bytes(key_cache), as_bytes(value_cache)  # fp8 moves as bytes
    if buffer_key not in plan.buffers:
        plan.buffers[buffer_key] = (key_cache.new_empty(block_ids.shape[0], rows),
                                    value_cache.new_empty(block_ids.shape[0], value_rows))
    k, v = plan.buffers[buffer_key]
    torch.index_select(key_cache.view(key_cache.shape[0], -1), 0, block_ids, out=k)  # [num_blocks, block elements]
    torch.index_select(value_cache.view(value_cache.shape[0], -1), 0, block_ids, out=v)
    if scales is None:
        return k, v
    stored = buffer_key[-1]
    k = k.view(stored).view(-1, *key_cache.shape[1:])  # [num_read, block_size, num_kv_heads, head_dim]
    v = v.view(stored).view(-1, *value_cache.shape[1:])
    return (dequantize(k, scales.key.index_select(0, block_ids), dtype).flatten(1),
            dequantize(v, scales.value.index_select(0, block_ids), dtype).flatten(1))


def prefill_chunk(query: Query, device) -> PrefillChunk:
    block_ids = torch.tensor(query.block_table, dtype=torch.long, device=device)
    return PrefillChunk(query.start, query.length, query.context_len, block_ids, query.length == query.context_len,
                        query.spans)


def _group_by_length(decodes: list[tuple[int, int, list[int]]]) -> list[list[tuple[int, int, list[int]]]]:
    """Split decodes (context_len, row, block_table) into groups whose padding stays small."""
    groups: list[list] = []
    total = 0  # real context tokens in the last group; its first (longest) member sets the padded length
    for decode in sorted(decodes, key=lambda d: d[0], reverse=True):
        if groups and groups[-1][0][0] * (len(groups[-1]) + 1) <= MAX_DECODE_PADDING * (total + decode[0]):
            groups[-1].append(decode)
            total += decode[0]
        else:
            groups.append([decode])
            total = decode[0]
    return groups


def _decode_group(group: list[tuple[int, int, list[int]]], device) -> DecodeGroup:
    max_blocks = max(len(table) for _, _, table in group)
    block_ids = [b for _, _, table in group for b in table + [0] * (max_blocks - len(table))]
    return DecodeGroup(
        rows=torch.tensor([row for _, row, _ in group], dtype=torch.long, device=device),
        block_ids=torch.tensor(block_ids, dtype=torch.long, device=device),
        context_lens=torch.tensor([length for length, _, _ in group], dtype=torch.long, device=device),
        max_blocks=max_blocks,
    )


def terms_of_rows(terms: ScoreTerms, take, distance: torch.Tensor):
    """For the query rows `take` picks of a [num_tokens, ...] tensor, whose keys are `distance` [rows, keys]
    positions back: (bias [rows, heads, keys], per-token sinks [rows, heads, 1], selection [rows, keys]), each None
    where absent (per-head sinks stay `terms.sinks`)."""
    bias = None
    if terms.distance_bias is not None:
        bias = bias_by_distance(take(terms.distance_bias), distance[:, None, :])
    if terms.alibi_slopes is not None:
        alibi = -terms.alibi_slopes.double()[None, :, None] * distance[:, None, :]  # rounded once, to the scores
        bias = alibi if bias is None else bias + alibi
    sinks = None if terms.sinks is None or terms.sinks.dim() == 1 else take(terms.sinks)[:, :, None]
    selected = None if terms.key_mask is None else _selected(take(terms.key_mask), distance.shape[-1])
    return bias, sinks, selected


def _selected(key_mask: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The rows of a key mask over `num_keys` key positions (cut, or padded with unselected positions)."""
    if key_mask.shape[-1] >= num_keys:
        return key_mask[:, :num_keys]
    return torch.nn.functional.pad(key_mask, (0, num_keys - key_mask.shape[-1]), value=False)


def bias_by_distance(table: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """table [..., extent] (a logit per backward distance), distance [..., keys] (query minus key position,
    broadcast over the table's leading dims) -> [..., keys]: the table's logit where 0 <= distance < extent, else 0."""
    extent = table.shape[-1]
    index = distance.clamp(0, extent - 1).expand(*table.shape[:-1], distance.shape[-1])
    return table.gather(-1, index).masked_fill((distance < 0) | (distance >= extent), 0.0)


def attention(q, k, v, mask, scaling, softcap, is_causal=False, sinks=None, bias=None) -> torch.Tensor:
    """SDPA with grouped KV heads; soft-capping (Gemma 2), attention sinks (`sinks`: [num_heads], or per query as
    [..., num_heads, query_len, 1]: a logit that takes part in the softmax and whose weight is dropped, gpt-oss,
    Inkling 2) and an additive bias over the scores
    (`bias`, broadcast to [..., num_heads, query_len, key_len]) need the explicit softmax path."""
    if softcap is None and sinks is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, is_causal=is_causal,
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    dtype, compute = q.dtype, torch.promote_types(q.dtype, torch.float32)  # bf16 scores would round before tanh
    q, k, v = q.to(compute), k.repeat_interleave(groups, dim=1).to(compute), v.repeat_interleave(groups, dim=1).to(compute)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [..., num_heads, query_len, key_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(compute)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v).to(dtype)
    sink_column = (sinks.view(-1, 1, 1) if sinks.dim() == 1 else sinks).to(compute).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).to(dtype)
