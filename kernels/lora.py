"""Multi-LoRA for one linear layer and one packed step: `y[t] += B[slot(t)] @ (A[slot(t)] @ x[t])` for every token
that has an adapter, all adapters in one call.

The step's tokens are grouped by adapter slot once (`lora_segments`, shared by every layer on a device); each
layer then makes one call. On CPU, for float32, float64 and bfloat16, that call is the compiled SGMV kernel
(`csrc/lora_sgmv.cpp`): it reads each slot's A and B in place, a tile of tokens at a time. Elsewhere (a GPU,
float16, no compiler) `apply_lora_reference` runs the same update with torch ops, one group of ops per slot; it
is also what the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from transformers.utils import logging

from paged_hf.kernels import native

logger = logging.get_logger(__name__)

#: dtypes the compiled kernel computes (bf16 in float32), by entry-point suffix
NATIVE_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
#: the largest rank the compiled kernel holds on its stack; larger ranks take the torch path
MAX_NATIVE_RANK = 128


@dataclass
class LoRASegments:
    """The step's adapter tokens grouped by slot: tokens order[starts[i]:starts[i + 1]] use slots[i]."""

    order: torch.Tensor  # [num_adapter_tokens] int64: token indices, grouped by slot
    slots: torch.Tensor  # [num_segments] int64 on CPU
    starts: torch.Tensor  # [num_segments + 1] int64 on CPU
    num_tokens: int  # tokens in the step, with or without an adapter
    covers_all: bool  # one slot for every token of the step (no gather needed on the torch path)
    kernel_args: tuple | None = None  # on CPU: what the compiled kernel reads of them (pointers, count)


def lora_segments(token_slots: torch.Tensor, device: torch.device) -> LoRASegments:
    """token_slots: [num_tokens] int64 on CPU, -1 for base-model tokens."""
    order = torch.argsort(token_slots, stable=True)
    sorted_slots = token_slots[order]
    first = int(torch.searchsorted(sorted_slots, torch.tensor(0)))  # base-model tokens sort first
    order, sorted_slots = order[first:], sorted_slots[first:]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = torch.zeros(len(slots) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    covers_all = len(slots) == 1 and first == 0
    order = order.to(device)
    kernel_args = (order.data_ptr(), slots.data_ptr(), starts.data_ptr(), len(slots)) if device.type == "cpu" else None
    return LoRASegments(order, slots, starts, token_slots.numel(), covers_all, kernel_args)


def kernel_weights(lora_a: torch.Tensor, lora_bt: torch.Tensor, ranks: torch.Tensor) -> tuple | None:
    """What the compiled kernel reads of one layer's slot buffers (its entry point, pointers and sizes), or None
    where it cannot serve them (a GPU, float16, a rank over MAX_NATIVE_RANK, no compiler). Made once per change of
    the buffers, not per call: a layer is called ~200 times a step."""
    if not (lora_a.device.type == "cpu" and lora_a.dtype == lora_bt.dtype and lora_a.shape[1] <= MAX_NATIVE_RANK
            and lora_a.is_contiguous() and lora_bt.is_contiguous() and ranks.device.type == "cpu"):
        return None
    function = _native_function(lora_a.dtype)
    if function is None:
        return None
    return (function, lora_a.dtype, lora_a.data_ptr(), lora_bt.data_ptr(), ranks.data_ptr(), lora_a.shape[2],
            lora_bt.shape[2], lora_a.shape[1])


def apply_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor, ranks: torch.Tensor,
               segments: LoRASegments, weights: tuple | None = None) -> None:
    """y [num_tokens, out] += the LoRA update of x [num_tokens, in], in place. lora_a: [slots, rank_cap, in];
    lora_bt: [slots, rank_cap, out] (B transposed); ranks: [slots] int64 on CPU (0: the slot skips this layer);
    weights: `kernel_weights` of the three, when the caller keeps it (else it is made here)."""
    if weights is None:
        weights = kernel_weights(lora_a, lora_bt, ranks)
    if (weights is not None and segments.kernel_args is not None and x.dtype == y.dtype == weights[1]
            and x.stride(1) == 1 and y.stride(1) == 1):
        function, _, a, bt, rank_of_slot, in_features, out_features, rank_cap = weights
        if function(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a, bt, rank_of_slot, *segments.kernel_args,
                    in_features, out_features, rank_cap, torch.get_num_threads()) == 0:
            return
    apply_lora_reference(y, x, lora_a, lora_bt, ranks, segments)


def apply_lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor,
                         ranks: torch.Tensor, segments: LoRASegments) -> None:
    """The same update with torch ops: a gather, two matmuls and an index_add_ per slot."""
    x = x.to(lora_a.dtype)
    for i, slot in enumerate(segments.slots.tolist()):
        rank = int(ranks[slot])
        if rank == 0:
            continue
        a = lora_a[slot, :rank]  # [r, in]
        bt = lora_bt[slot, :rank]  # [r, out]
        if segments.covers_all:
            y.add_(((x @ a.T) @ bt).to(y.dtype))
        else:
            index = segments.order[segments.starts[i]:segments.starts[i + 1]]
            y.index_add_(0, index, ((x.index_select(0, index) @ a.T) @ bt).to(y.dtype))  # [tokens_of_slot, out]


@functools.lru_cache(maxsize=None)
def _native_function(dtype: torch.dtype):
    """The compiled kernel's entry point for `dtype`, or None (other dtypes; no compiler: logged once)."""
    if dtype not in NATIVE_DTYPES:
        return None
    try:
        library = native.load_lora()
    except native.NativeBuildError as error:
        logger.warning(f"paged_hf: multi-LoRA runs on torch ops, the compiled kernel is unavailable: {error}")
        return None
    function = getattr(library, f"lora_sgmv_{NATIVE_DTYPES[dtype]}")
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6 + [
        ctypes.c_int64] * 4 + [ctypes.c_int]
    return function
