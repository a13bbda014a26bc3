"""Bidirectional spans (Gemma 3's images: a span's tokens all see each other): the torch kernel against a dense
masked softmax written out key by key, as HF composes it (causal OR same span, AND the window behind the query); and
kernels that do not compute them say so: they are never selected for a step that carries spans."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_hf.kernels.cpu_kernel import CpuKernel
from paged_hf.kernels.selection import select_kernel, select_kernels
from paged_hf.kernels.spec import AttentionSpec
from paged_hf.kernels.torch_kernel import TorchKernel
from paged_hf.worker.step_inputs import AttentionMetadata

BLOCK_SIZE = 4
#: (cached tokens, new tokens, spans): a fresh prompt with an image inside; a chunk after a prefix hit that ends inside
#: its span (the span's first keys cached); a decode; a prompt with one span at its start and one at its end
SEQUENCES = [
    (0, 10, ((2, 6),)),
    (5, 7, ((3, 9),)),
    (9, 1, ()),
    (0, 7, ((0, 2), (4, 7))),
]


def _allowed(query_pos: int, key_pos: int, spans, window: int | None) -> bool:
    """HF's Gemma 3 mask for one (query, key): OR(causal, same span), AND the window (keys behind the query only)."""
    same_span = any(a <= query_pos < b and a <= key_pos < b for a, b in spans)
    visible = key_pos <= query_pos or same_span
    return visible and (window is None or key_pos > query_pos - window)


def _dense(q, k, v, spans, scaling, window):
    """q [new, heads, dim] of the last `new` positions; k, v [context, kv_heads, dim] -> [new, heads, dim]."""
    new, context = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    mask = torch.tensor([[_allowed(context - new + i, j, spans, window) for j in range(context)] for i in range(new)])
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3])
def test_the_torch_kernel_lets_a_span_see_its_later_keys(window):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, scaling = 4, 2, 8, 0.4
    num_blocks = sum(-(-(past + new) // BLOCK_SIZE) for past, new, _ in SEQUENCES) + 2
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.float64)
    value_cache = torch.zeros_like(key_cache)
    blocks = iter(torch.randperm(num_blocks).tolist())
    full, tables, slots, starts = [], [], [], [0]
    for past, new, _ in SEQUENCES:
        total = past + new
        table = [next(blocks) for _ in range(-(-total // BLOCK_SIZE))]
        k, v = torch.randn(2, total, num_kv_heads, head_dim, dtype=torch.float64)
        for pos in range(past):  # the past (a prefix hit) is already in the cache
            key_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            value_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(past, total)]
        full.append((k, v)), tables.append(table), starts.append(starts[-1] + new)
    metadata = AttentionMetadata(BLOCK_SIZE, starts, [p + n for p, n, _ in SEQUENCES], tables, torch.tensor(slots),
                                 bidirectional=[spans for _, _, spans in SEQUENCES])
    kernel = TorchKernel()
    plan = kernel.plan(metadata, torch.device("cpu"))
    new_k = torch.cat([k[past:] for (k, _), (past, _, _) in zip(full, SEQUENCES)])
    new_v = torch.cat([v[past:] for (_, v), (past, _, _) in zip(full, SEQUENCES)])
    query = torch.randn(starts[-1], num_heads, head_dim, dtype=torch.float64)
    kernel.write_kv(new_k, new_v, key_cache, value_cache, plan)
    out = kernel.attend(query, new_k, new_v, key_cache, value_cache, plan, scaling=scaling, sliding_window=window,
                        softcap=None)
    causal = kernel.attend(query, new_k, new_v, key_cache, value_cache,
                           kernel.plan(dataclasses.replace(metadata, bidirectional=None), torch.device("cpu")),
                           scaling=scaling, sliding_window=window, softcap=None)
    for i, ((k, v), (_, _, spans)) in enumerate(zip(full, SEQUENCES)):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows], _dense(query[rows], k, v, spans, scaling, window), rtol=1e-10, atol=1e-10)
        if spans:  # the spans change the rows of their queries: the test tells them from a causal mask
            assert not torch.allclose(out[rows], causal[rows])


def _spec(**fields) -> AttentionSpec:
    return AttentionSpec(layer_idx=0, num_kv_heads=2, head_dim=64, value_head_dim=64, device=torch.device("cpu"),
                         dtype=torch.float32, **fields)


def test_a_kernel_that_cannot_compute_spans_says_so_and_is_not_selected_for_them():
    flagged = [_spec(bidirectional_spans=True)]
    assert CpuKernel.unsupported_reason(_spec()) is None
    assert "bidirectional spans" in CpuKernel.unsupported_reason(flagged[0])
    assert TorchKernel.unsupported_reason(flagged[0]) is None
    assert select_kernel("auto", flagged).name == "torch"  # one kernel for every step: the one that computes spans
    with pytest.raises(ValueError, match="bidirectional spans"):
        select_kernel("cpu", flagged)
    kernel, span_kernel = select_kernels("auto", flagged)  # two: the torch kernel takes the steps with spans
    if kernel.name == "cpu":  # (where the CPU kernel builds; else torch alone)
        assert span_kernel.name == "torch"
    else:
        assert kernel.name == "torch" and span_kernel is None
    assert select_kernels("torch", flagged)[1] is None  # the torch kernel computes every step itself
    assert select_kernels("auto", [_spec()])[1] is None  # no spans: one kernel, as select_kernel
