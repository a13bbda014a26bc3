"""Tensor parallelism inside a pipeline stage (loader/stage_shards.py): what each rank keeps, and the refusals.
The sums over ranks run in tests/serving/test_pp_tp_serve.py (4 ranks under torchrun)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from paged_hf.loader.stage_shards import RowwiseShard, shard_stage


def test_each_rank_keeps_whole_heads_and_its_share_of_every_product():
    whole = tiny_model("llama")  # 4 query heads, 2 KV heads of 16
    layer = whole.model.layers[0]
    x, hidden = torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 128, dtype=torch.float64)
    parts = []
    for rank in range(2):
        model = tiny_model("llama")
        shard_stage(model, rank, 2, group=None)
        attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert (attention.q_proj.out_features, attention.k_proj.out_features) == (32, 16)  # 2 heads, 1 KV head
        assert torch.equal(attention.q_proj(x), layer.self_attn.q_proj(x)[:, rank * 32:(rank + 1) * 32])
        assert isinstance(mlp.down_proj, RowwiseShard) and mlp.down_proj.in_features == 64
        share = hidden[:, rank * 64:(rank + 1) * 64]
        parts.append(torch.nn.functional.linear(share, mlp.down_proj.weight, mlp.down_proj.bias))
    expected = layer.mlp.down_proj(hidden)
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-12, atol=1e-12)


def test_what_cannot_be_split_is_refused_by_name():
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads"):
        shard_stage(tiny_model("llama"), 0, 3, group=None)
    model = tiny_model("llama")
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise_gather_output"}
    with pytest.raises(ValueError, match="style 'colwise_gather_output'"):
        shard_stage(model, 0, 2, group=None)
