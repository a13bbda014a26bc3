"""The stand-in for transformers' torch_recurrent_gated_delta_rule (paged_hf.worker.hybrid.recurrence_kernels): the
reference's results to float32 rounding on decode calls, the reference itself on every other call, the input state
untouched, and the swap into a modeling module's globals undone after the step (and skipped where the user
replaced the function)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from paged_hf.worker.hybrid.recurrence_kernels import GATED_DELTA_RULE, RecurrenceKernels, gated_delta_rule_decode

REFERENCE = qwen3_5.torch_recurrent_gated_delta_rule


def inputs(dtype, seq_len=1, k_heads=2, v_heads=4, batch=5, k_dim=16, v_dim=24, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    return dict(query=rand(batch, seq_len, k_heads, k_dim), key=rand(batch, seq_len, k_heads, k_dim),
                value=rand(batch, seq_len, v_heads, v_dim), g=-rand(batch, seq_len, v_heads).abs(),
                beta=rand(batch, seq_len, v_heads).sigmoid(),
                initial_state=torch.randn(batch, v_heads, k_dim, v_dim, generator=generator))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(4, 4), (2, 4)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_a_decode_step_equals_the_reference(dtype, heads, l2norm):
    fast = gated_delta_rule_decode(REFERENCE, qwen3_5.l2norm)
    args = inputs(dtype, k_heads=heads[0], v_heads=heads[1])
    before = args["initial_state"].clone()
    expected = REFERENCE(**args, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    got = fast(**args, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert torch.equal(args["initial_state"], before)  # the pool's state is written by the cache, not here
    assert got[0].dtype == expected[0].dtype == dtype and got[1].dtype == expected[1].dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
    assert fast(**args, output_final_state=False)[1] is None


def test_other_calls_go_to_the_reference():
    calls = []

    def reference(*args, **kwargs):
        calls.append(kwargs)
        return "reference"

    fast = gated_delta_rule_decode(reference, qwen3_5.l2norm)
    assert fast(**inputs(torch.float32, seq_len=3)) == "reference"  # a prompt chunk
    assert fast(**{**inputs(torch.float32), "initial_state": None}) == "reference"  # no state yet
    assert fast(**inputs(torch.float32), cu_seqlens=torch.tensor([0, 1])) == "reference"  # packed sequences
    assert len(calls) == 3 and calls[2]["cu_seqlens"] is not None


def test_the_swap_lasts_one_step_and_leaves_a_users_function_alone():
    mixer = qwen3_5.Qwen3_5GatedDeltaNet(qwen3_5.Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_attention_heads=2, num_key_value_heads=1), layer_idx=0)
    kernels = RecurrenceKernels([mixer, mixer])
    assert len(kernels.swaps) == 1
    with kernels:
        assert getattr(qwen3_5, GATED_DELTA_RULE) is kernels.swaps[0][3]
    assert getattr(qwen3_5, GATED_DELTA_RULE) is REFERENCE

    def users_own(*args, **kwargs):
        raise AssertionError("not called here")

    qwen3_5.torch_recurrent_gated_delta_rule = users_own
    try:
        with kernels:
            assert getattr(qwen3_5, GATED_DELTA_RULE) is users_own
    finally:
        qwen3_5.torch_recurrent_gated_delta_rule = REFERENCE
