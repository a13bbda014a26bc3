"""The compiled multi-LoRA kernel (kernels/csrc/lora_sgmv.cpp) against the torch reference it replaces.

Each case routes the tokens of one packed step to many adapter slots at once: base-model tokens between them,
slots whose adapter skips the layer (rank 0), slots of different ranks (odd ones too) read where they lie,
dimensions that are not a multiple of the vector width (the scalar tails), single-token segments (decode) and
long ones (prefill).
"""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import native
from paged_hf.kernels.lora import (
    MAX_NATIVE_RANK,
    SlotWeights,
    _native_function,
    apply_lora,
    apply_lora_group,
    apply_lora_reference,
    kernel_call,
    lora_segments,
)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def native_available(dtype: torch.dtype) -> bool:
    try:
        native.load_lora()
    except native.NativeBuildError:
        return False
    return _native_function(dtype) is not None


def make_case(num_tokens, in_features, out_features, num_slots, max_rank, dtype, seed=0):
    """Tokens on random slots (-1: the base model), and each slot's factors of a random rank up to max_rank (0:
    the slot's adapter skips the layer)."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator)
    x = torch.randn(num_tokens, in_features, generator=generator, dtype=torch.float64).to(dtype)
    ranks = torch.randint(0, max_rank + 1, (num_slots,), generator=generator)
    ranks[0] = max_rank  # one slot of the largest rank always
    weights = SlotWeights(num_slots, in_features, out_features, dtype, torch.device("cpu"))
    for slot, rank in enumerate(ranks.tolist()):
        if rank:
            a = torch.randn(rank, in_features, generator=generator, dtype=torch.float64) / in_features ** 0.5
            bt = torch.randn(rank, out_features, generator=generator, dtype=torch.float64)
            weights.set(slot, (a.to(dtype), bt.to(dtype)))
    y = torch.randn(num_tokens, out_features, generator=generator, dtype=torch.float64).to(dtype)
    return slots, x, weights, y


def in_float64(weights: SlotWeights) -> SlotWeights:
    """The same slots in float64: what the reference computes with."""
    copy = SlotWeights(weights.num_slots, weights.in_features, weights.out_features, torch.float64, weights.device)
    for slot, pair in enumerate(weights.pairs):
        copy.set(slot, pair)
    return copy


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (64, 576, 1536, 64, 8),  # a decode step: one token per adapter
    (300, 576, 192, 4, 16),  # prefill chunks of a few adapters, among base-model tokens
    (37, 70, 33, 5, 5),  # dimensions with scalar tails, odd ranks
    (9, 128, 96, 3, 64),  # a large rank
])
def test_kernel_equals_reference(dtype, shape):
    if not native_available(dtype):
        pytest.skip("no C++ compiler: the torch path serves")
    slots, x, weights, y = make_case(*shape, dtype)
    segments = lora_segments(slots, torch.device("cpu"))
    got = y.clone()
    apply_lora(got, x, weights, segments)
    expected = y.double()
    apply_lora_reference(expected, x.double(), in_float64(weights), segments)
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
    slots, x, _, _ = make_case(num_tokens, in_features, 8, num_slots, 4, dtype)
    layers = []
    for seed, (out_features, max_rank) in enumerate([(96, 8), (33, 16), (48, 5)], start=1):
        layers.append(make_case(num_tokens, in_features, out_features, num_slots, max_rank, dtype, seed)[2])
    layers[1].set(1, None)  # a slot whose adapter skips the middle layer only
    fused = torch.randn(num_tokens, 96 + 33 + 48, dtype=torch.float64).to(dtype)
    segments = lora_segments(slots, torch.device("cpu"))
    got = fused.clone()
    apply_lora_group(list(got.split([96, 33, 48], dim=1)), x, layers, segments)
    expected = fused.double()
    for y, layer in zip(expected.split([96, 33, 48], dim=1), layers):
        apply_lora_reference(y, x.double(), in_float64(layer), segments)
    tolerance = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    assert (got.double() - expected).abs().max().item() <= tolerance
    assert torch.equal(got[slots == -1], fused[slots == -1])


def test_slots_read_in_place_on_cpu():
    """Taking an adapter into a slot on CPU copies nothing (its host tensors are what the kernel reads); another
    dtype is converted once, at the slot."""
    a, bt = torch.randn(4, 16), torch.randn(4, 8)
    weights = SlotWeights(2, 16, 8, torch.float32, torch.device("cpu"))
    weights.set(1, (a, bt))
    assert weights.pairs[1][0] is a and weights.pairs[1][1] is bt
    assert weights.addresses[:, 1].tolist() == [a.data_ptr(), bt.data_ptr()] and weights.ranks.tolist() == [0, 4]
    weights.set(1, None)
    assert weights.pairs[1] is None and weights.ranks.tolist() == [0, 0] and weights.addresses.abs().sum() == 0
    converted = SlotWeights(1, 16, 8, torch.float64, torch.device("cpu"))
    converted.set(0, (a, bt))
    assert converted.pairs[0][0].dtype == torch.float64 and torch.equal(converted.pairs[0][0], a.double())
    with pytest.raises(ValueError, match="do not fit"):
        weights.set(0, (bt, a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_over_the_kernel_limit_takes_the_torch_path(dtype):
    """A slot of rank > MAX_NATIVE_RANK among the step's slots: the kernel does nothing and the torch path does it
    all (no half-applied update)."""
    if not native_available(dtype):
        pytest.skip("no C++ compiler: the torch path serves")
    slots, x, weights, y = make_case(20, 64, 48, 3, 8, dtype)
    big_rank = MAX_NATIVE_RANK + 2
    weights.set(2, (torch.randn(big_rank, 64, dtype=torch.float64).div(64).to(dtype),
                    torch.randn(big_rank, 48, dtype=torch.float64).to(dtype)))
    slots[:4] = 2
    segments = lora_segments(slots, torch.device("cpu"))
    got = y.clone()
    assert weights.kernel is not None and not kernel_call([weights.kernel])([got], x, segments)
    assert torch.equal(got, y)  # the kernel refused before touching anything
    apply_lora(got, x, weights, segments)
    expected = y.double()
    apply_lora_reference(expected, x.double(), in_float64(weights), segments)
    assert (got.double() - expected).abs().max().item() <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
