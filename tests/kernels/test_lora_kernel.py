"""The compiled multi-LoRA kernel (kernels/csrc/lora_sgmv.cpp) against the torch reference it replaces.

Each case routes the tokens of one packed step to many adapter slots at once: base-model tokens between them,
slots whose adapter skips the layer (rank 0), ranks below the slot capacity (zero padding), dimensions that are
not a multiple of the vector width (the scalar tails), single-token segments (decode) and long ones (prefill).
"""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import native
from paged_hf.kernels.lora import (
    _native_function,
    apply_lora,
    apply_lora_group,
    apply_lora_reference,
    lora_segments,
)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def native_available(dtype: torch.dtype) -> bool:
    try:
        native.load_lora()
    except native.NativeBuildError:
        return False
    return _native_function(dtype) is not None


def make_case(num_tokens, in_features, out_features, num_slots, rank_cap, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator)
    x = torch.randn(num_tokens, in_features, generator=generator, dtype=torch.float64).to(dtype)
    a = (torch.randn(num_slots, rank_cap, in_features, generator=generator, dtype=torch.float64) / in_features ** 0.5)
    bt = torch.randn(num_slots, rank_cap, out_features, generator=generator, dtype=torch.float64)
    ranks = torch.randint(0, rank_cap + 1, (num_slots,), generator=generator)
    ranks[0] = rank_cap  # one full-rank slot always
    for slot, rank in enumerate(ranks.tolist()):  # the wrapper's zero padding past each slot's rank
        a[slot, rank:] = 0
        bt[slot, rank:] = 0
    y = torch.randn(num_tokens, out_features, generator=generator, dtype=torch.float64).to(dtype)
    return slots, x, a.to(dtype), bt.to(dtype), ranks.to(torch.int64), y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (64, 576, 1536, 64, 8),  # a decode step: one token per adapter
    (300, 576, 192, 4, 16),  # prefill chunks of a few adapters, among base-model tokens
    (37, 70, 33, 5, 5),  # dimensions with scalar tails, odd rank capacity
    (9, 128, 96, 3, 64),  # a large rank
])
def test_kernel_equals_reference(dtype, shape):
    if not native_available(dtype):
        pytest.skip("no C++ compiler: the torch path serves")
    num_tokens, in_features, out_features, num_slots, rank_cap = shape
    slots, x, a, bt, ranks, y = make_case(*shape, dtype)
    segments = lora_segments(slots, torch.device("cpu"))
    got = y.clone()
    apply_lora(got, x, a, bt, ranks, segments)
    expected = y.double()
    apply_lora_reference(expected, x.double(), a.double(), bt.double(), ranks, segments)
    scale = max(1.0, expected.abs().max().item())
    # bf16: the output rounded once (half an ulp of its magnitude); float: summation order only
    tolerance = TOLERANCE[dtype] * scale
    assert (got.double() - expected).abs().max().item() <= tolerance
    untouched = slots == -1
    assert torch.equal(got[untouched], y[untouched])  # base-model tokens keep their base output exactly


def test_segments_group_tokens_by_slot():
    slots = torch.tensor([3, -1, 0, 3, -1, 0, 0, 7])
    segments = lora_segments(slots, torch.device("cpu"))
    assert segments.slots.tolist() == [0, 3, 7]
    assert segments.starts.tolist() == [0, 3, 5, 6]
    assert segments.order.tolist() == [2, 5, 6, 0, 3, 7]  # stable: in token order within a slot
    assert not segments.covers_all
    assert lora_segments(torch.tensor([2, 2, 2]), torch.device("cpu")).covers_all


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_one_call_for_layers_that_share_x_equals_reference(dtype):
    """q/k/v-like layers in one call: other output sizes and rank capacities, slots with rank 0 in one layer only,
    outputs that are column slices of one fused tensor (a row stride wider than the layer)."""
    if not native_available(dtype):
        pytest.skip("no C++ compiler: the torch path serves")
    num_tokens, in_features, num_slots = 45, 96, 6
    slots, x, _, _, _, _ = make_case(num_tokens, in_features, 8, num_slots, 4, dtype)
    layers = []
    for seed, (out_features, rank_cap) in enumerate([(96, 8), (33, 16), (48, 5)], start=1):
        _, _, a, bt, ranks, _ = make_case(num_tokens, in_features, out_features, num_slots, rank_cap, dtype, seed)
        layers.append((a, bt, ranks))
    layers[1][2][1] = 0  # a slot whose adapter skips the middle layer only
    fused = torch.randn(num_tokens, 96 + 33 + 48, dtype=torch.float64).to(dtype)
    segments = lora_segments(slots, torch.device("cpu"))
    got = fused.clone()
    apply_lora_group(list(got.split([96, 33, 48], dim=1)), x, layers, segments)
    expected = fused.double()
    for y, (a, bt, ranks) in zip(expected.split([96, 33, 48], dim=1), layers):
        apply_lora_reference(y, x.double(), a.double(), bt.double(), ranks, segments)
    tolerance = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    assert (got.double() - expected).abs().max().item() <= tolerance
    assert torch.equal(got[slots == -1], fused[slots == -1])
