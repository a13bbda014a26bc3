"""Pure-PyTorch paged attention over a packed row that mixes prefill chunks and decode tokens.

Decode rows (one query token each) are batched into one SDPA call over their gathered K/V, padded to the
longest context with a key mask. Prefill chunks run one SDPA call each: a fresh prompt attends to its own
new K/V with `is_causal`; a chunk with a past gathers its context from the cache with an offset causal mask.
Everything index-shaped is built once per step in `plan`; per layer only gathers and SDPA calls remain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int
    slots: torch.Tensor | None  # [context_len] flat slot of each context token; None for a fresh prompt


@dataclass
class TorchPlan:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_rows: torch.Tensor | None  # [num_decodes] token index of each decode query
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] flat slots, padded with slot 0
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunk]
    masks: dict = field(default_factory=dict)  # (kind, index, window) -> bool mask, built on first use


class TorchKernel:
    name = "torch"

    def plan(self, metadata, device: torch.device) -> TorchPlan:
        block_size = metadata.block_size
        starts = metadata.query_start_loc
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        for i, context_len in enumerate(metadata.context_lens):
            query_len = starts[i + 1] - starts[i]
            table = metadata.block_tables[i]
            if query_len == 1:
                decode_rows.append(starts[i])
                decode_tables.append(table)
                decode_lens.append(context_len)
            else:
                slots = None if query_len == context_len else _slots(table, context_len, block_size).to(device)
                prefills.append(PrefillChunk(starts[i], query_len, context_len, slots))
        decode_slots = None
        if decode_rows:
            max_context = max(decode_lens)
            decode_slots = torch.stack([
                F.pad(_slots(table, length, block_size), (0, max_context - length)) for table, length in zip(decode_tables, decode_lens)
            ]).to(device)
        return TorchPlan(
            slot_mapping=metadata.slot_mapping.to(device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device) if decode_rows else None,
            decode_slots=decode_slots,
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=device) if decode_rows else None,
            prefills=prefills,
        )

    def write_kv(self, key, value, key_cache, value_cache, plan: TorchPlan) -> None:
        num_kv_heads, head_dim = key_cache.shape[-2:]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, value)

    def attend(self, query, key, value, key_cache, value_cache, plan: TorchPlan, *, scaling, sliding_window, softcap):
        num_kv_heads, head_dim = key_cache.shape[-2:]
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
        flat_values = value_cache.view(-1, num_kv_heads, head_dim)
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if plan.decode_rows is not None:
            mask = self._decode_mask(plan, sliding_window)  # [num_decodes, 1, 1, max_context]
            q = query[plan.decode_rows].unsqueeze(2)  # [num_decodes, num_heads, 1, head_dim]
            k = flat_keys[plan.decode_slots].transpose(1, 2)  # [num_decodes, num_kv_heads, max_context, head_dim]
            v = flat_values[plan.decode_slots].transpose(1, 2)
            output[plan.decode_rows] = attention(q, k, v, mask, scaling, softcap).squeeze(2)
        for index, chunk in enumerate(plan.prefills):
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
            if chunk.slots is None:
                k, v = key[rows], value[rows]  # a fresh prompt: its context is this step's K/V
            else:
                k, v = flat_keys[chunk.slots], flat_values[chunk.slots]  # [context_len, num_kv_heads, head_dim]
            k = k.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, context_len, head_dim]
            v = v.transpose(0, 1).unsqueeze(0)
            if chunk.slots is None and sliding_window is None and softcap is None:
                out = attention(q, k, v, None, scaling, None, is_causal=True)
            else:
                out = attention(q, k, v, self._prefill_mask(plan, index, chunk, sliding_window, q.device), scaling, softcap)
            output[rows] = out[0].transpose(0, 1)
        return output

    @staticmethod
    def _decode_mask(plan: TorchPlan, window: int | None) -> torch.Tensor:
        key = ("decode", window)
        if key not in plan.masks:
            lens = plan.decode_context_lens
            key_pos = torch.arange(plan.decode_slots.shape[1], device=lens.device)
            mask = key_pos[None, :] < lens[:, None]
            if window is not None:
                mask &= key_pos[None, :] > (lens[:, None] - 1 - window)
            plan.masks[key] = mask[:, None, None, :]
        return plan.masks[key]

    @staticmethod
    def _prefill_mask(plan: TorchPlan, index: int, chunk: PrefillChunk, window: int | None, device) -> torch.Tensor:
        key = ("prefill", index, window)
        if key not in plan.masks:
            offset = chunk.context_len - chunk.query_len  # position of the chunk's first query token
            query_pos = torch.arange(offset, chunk.context_len, device=device)[:, None]
            key_pos = torch.arange(chunk.context_len, device=device)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            plan.masks[key] = mask  # [query_len, context_len]
        return plan.masks[key]


def _slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Flat slot index of positions 0..length-1 of one request."""
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length]


def attention(q, k, v, mask, scaling, softcap, is_causal=False) -> torch.Tensor:
    """SDPA with grouped KV heads; soft-capping (Gemma 2) needs the explicit softmax path."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, is_causal=is_causal,
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v)
