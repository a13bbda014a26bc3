"""Sparse attention over the tokens an indexer selects (Qwen4-Exp's QSA, DeepSeek-V3.2's DSA), in a paged step.

Each attention layer's indexer scores the query against pooled blocks of its own per-token keys (written to and
read from `cache.update_indexer`) and keeps the top ones; the attention then attends only the selected tokens.
Its forward reads one sequence with its whole history: the keys so far, and rotary positions from 0 for the
blocks' starts. In a step the stand-in runs the model's own indexer once per request, on that request's tokens,
with its history from the paged indexer keys (worker/indexer_keys.py), its positions and a causal mask over its
context; the selections go to the torch kernel as a mask over each query token's keys (`ScoreTerms.key_mask`), and
the rest of the attention is the module's own code over the packed row. DeepSeek-V3.2's attention takes its
indexer's top-k positions and hands them to its attention function as `indices` (as to a sparse kernel): there
only the indexer has a stand-in, and the paged cache turns the indices into the mask (`PagedCache.key_mask_of`).
"""

from __future__ import annotations

import torch

from paged_hf.integrations.transformers import step_cache
from paged_hf.kernels.spec import ScoreTerms
from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.stand_ins import StandIn, modeling_global


class Qwen4ExpAttention(StandIn):
    """Qwen4ExpTextAttention in a step (module docstring); its own forward outside steps (the probe).
    `rotary`: the model's rotary embedding, for the positions of the requests' histories."""

    score_terms = frozenset({"key_mask"})  # its indexer's selection (the probe refuses indexed models without one)

    def __init__(self, original: torch.nn.Module, rotary: torch.nn.Module):
        super().__init__(original)
        object.__setattr__(self, "rotary", rotary)  # the model's own module: not registered here again

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        attention = self.original
        if cache is None or cache is not step_cache():
            return attention(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        key_mask = self._selection(hidden_states, cache)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attention.head_dim)
        query, gate = torch.chunk(attention.q_proj(hidden_states).view(*input_shape, -1, attention.head_dim * 2), 2,
                                  dim=-1)
        gate = gate.reshape(*input_shape, -1)
        query = attention.q_norm(query.view(hidden_shape)).transpose(1, 2)
        key = attention.k_norm(attention.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value = attention.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = (x[:, -hidden_states.shape[1]:, :] for x in position_embeddings)
        query, key = modeling_global(attention, "apply_rotary_pos_emb")(query, key, cos, sin)
        key, value = cache.update(key, value, attention.layer_idx)
        output = cache.attend(attention, query, key, value, scaling=attention.scaling, sliding_window=None,
                              softcap=None, terms=ScoreTerms(key_mask=key_mask))
        output = output.reshape(*input_shape, -1) * torch.sigmoid(gate)
        return attention.o_proj(output), None

    def _selection(self, hidden_states: torch.Tensor, cache) -> torch.Tensor:
        """[num_tokens, longest context] bool: the tokens the indexer selects for each query token of the step."""
        attention, device = self.original, hidden_states.device
        width = max(cache.metadata.context_lens)
        cos, sin = self.rotary(hidden_states, torch.arange(width, device=device)[None])  # positions 0 .. width - 1
        key_mask = torch.zeros(hidden_states.shape[1], width, dtype=torch.bool, device=device)
        for rows, context_len, causal, history in step_requests(cache, device):
            selected = attention.indexer(hidden_states[:, rows], (cos[:, :context_len], sin[:, :context_len]), causal,
                                         history)
            key_mask[rows, :context_len] = selected[0, 0]
        return key_mask


def step_requests(cache, device: torch.device):
    """Per request of the step: (its rows of the packed row, its context length, a causal mask [1, 1, rows,
    context] of its tokens over its context, the cache its indexer call sees)."""
    metadata = cache.metadata
    starts = metadata.query_start_loc
    for i, (context_len, table) in enumerate(zip(metadata.context_lens, metadata.block_tables)):
        rows = slice(starts[i], starts[i + 1])
        query_positions = torch.arange(context_len - (rows.stop - rows.start), context_len, device=device)[:, None]
        causal = (torch.arange(context_len, device=device)[None, :] <= query_positions)[None, None]
        yield rows, context_len, causal, RequestIndexerKeys(cache, metadata.slot_mapping[rows], table, context_len)


class DeepseekV32Indexer(StandIn):
    """DeepSeek-V3.2's indexer in a step: the model's own, once per request (its tokens, their positions, a causal
    mask over its context, its history of indexer keys), each request's top-k key positions packed back in row
    order, [1, num_tokens, top-k], -1 where a request has fewer. Its attention hands them to the attention
    function as `indices` (what a sparse kernel takes), which the paged one turns into each query's keys."""

    score_terms = frozenset({"key_mask"})

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
        indexer = self.original
        if cache is None or cache is not step_cache():
            return indexer(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache)
        device = hidden_states.device
        selected = torch.full((hidden_states.shape[1], indexer.index_topk), -1, dtype=torch.int32, device=device)
        for rows, _, causal, history in step_requests(cache, device):
            top = indexer(hidden_states[:, rows], q_resid[:, rows], tuple(x[:, rows] for x in position_embeddings),
                          causal[:, 0], position_ids[:, rows], cache=history)
            selected[rows, : top.shape[-1]] = top[0]
        return selected[None]


class RequestIndexerKeys:
    """The cache one request's indexer call sees: `update_indexer` writes its new keys to their slots and returns
    its whole history, [1, context_len, dim]."""

    def __init__(self, cache, slots: torch.Tensor, block_table: list[int], context_len: int):
        self.cache, self.slots, self.block_table, self.context_len = cache, slots, block_table, context_len

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        store = self.cache.indexer_keys
        store.write(layer_idx, keys[0], self.slots)
        return store.read(layer_idx, self.block_table, self.context_len)[None]


def rotary_of(model: torch.nn.Module, attention: torch.nn.Module) -> torch.nn.Module | None:
    """The model's rotary embedding of the class `attention`'s modeling file defines beside it."""
    rotary_class = modeling_global(attention, type(attention).__name__.replace("Attention", "RotaryEmbedding"))
    return next((m for m in model.modules() if rotary_class is not None and isinstance(m, rotary_class)), None)


def _qwen4_exp(module: torch.nn.Module, config, model: torch.nn.Module) -> torch.nn.Module | None:
    rotary = rotary_of(model, module)
    return None if rotary is None else Qwen4ExpAttention(module, rotary)


FAMILY = Family(
    name="indexed",
    serves="Qwen4-Exp, DeepSeek-V3.2: sparse attention over the keys an indexer selects, run per request",
    stand_ins=(Recognised("transformers.models.qwen4_exp.modeling_qwen4_exp:Qwen4ExpTextAttention", _qwen4_exp),
               Recognised("transformers.models.deepseek_v32.modeling_deepseek_v32:DeepseekV32Indexer",
                          lambda module, config, model: DeepseekV32Indexer(module))),
)
