"""A rotary embedding's tables at single positions (paged_hf.worker.fast_paths.rotary_table): the module's own
forward's bits, kept per position, made again when its buffer or scaling changes; other calls go to its forward."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import VOCAB, hf_greedy, random_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.worker.fast_paths.fused_layers import FusedLayers
from paged_hf.worker.fast_paths.rotary_table import RotaryTable, keeps_positions


def _llama(**extra) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=80, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _assert_same_bits(table: RotaryTable, rotary: torch.nn.Module, x: torch.Tensor, positions) -> None:
    for position in positions:
        position_ids = torch.tensor([[position]])
        for got, expected in zip(table(x, position_ids=position_ids), rotary(x, position_ids=position_ids)):
            assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_positions_give_the_modules_bits_and_follow_its_changes(dtype):
    rotary = _llama().model.rotary_emb
    table = RotaryTable(rotary)
    x = torch.zeros(1, 1, 8, dtype=dtype)
    _assert_same_bits(table, rotary, x, range(300))
    assert len(table._positions) == 300
    _assert_same_bits(table, rotary, x, [0, 7, 299])  # kept
    with torch.no_grad():
        rotary.inv_freq.mul_(0.75)  # in place
    _assert_same_bits(table, rotary, x, [0, 7, 299])
    rotary.inv_freq = rotary.inv_freq * 1.5  # replaced
    _assert_same_bits(table, rotary, x, [0, 7, 299])
    rotary.attention_scaling = 0.5
    _assert_same_bits(table, rotary, x, [0, 7, 299])
    positions = torch.tensor([[3, 4, 5]])  # several positions: the module's forward
    assert all(torch.equal(a, b) for a, b in zip(table(x, position_ids=positions), rotary(x, position_ids=positions)))


def test_a_rope_that_updates_with_its_positions_keeps_its_own_forward():
    model = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert not keeps_positions(model.model.rotary_emb)
    assert not any(isinstance(stand_in, RotaryTable) for *_, stand_in in FusedLayers(model).sites)
    assert keeps_positions(_llama().model.rotary_emb)


def test_decode_steps_read_the_table_and_give_transformers_tokens():
    model = _llama()
    engine = paged_hf.wrap(model, num_blocks=64, max_num_batched_tokens=32).generator
    (table,) = [stand_in for *_, stand_in in engine.runner.fused_layers.sites if isinstance(stand_in, RotaryTable)]
    prompts = random_prompts([9, 5], seed=4)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 8) for p in prompts]
    one = engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=0), use_tqdm=False)
    assert one[0].outputs[0].token_ids == hf_greedy(model, prompts[0], 8)
    assert {position for position, _ in table._positions} >= set(range(9, 16))  # one sequence's decode steps
