"""Multi-LoRA for one linear layer and one packed step: `y[t] += B[slot(t)] @ (A[slot(t)] @ x[t])` for every token
that has an adapter, all adapters in one call.

The step's tokens are grouped by adapter slot once (`lora_segments`, shared by every layer on a device); each
layer then makes one call, or one call serves several layers that read the same x (`apply_lora_group`: q/k/v,
gate/up). On CPU, for float32, float64 and bfloat16, that call is the compiled SGMV kernel
(`csrc/lora_sgmv.cpp`): it reads each slot's A and B in place, a tile of tokens at a time. Elsewhere (a GPU,
float16, no compiler) `apply_lora_reference` runs the same update with torch ops, one group of ops per slot; it
is also what the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from paged_hf.kernels import native

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
    kernel_args: ctypes.Array | None = None  # on CPU: what the compiled kernel reads of them (pointers, count)


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
    kernel_args = None
    if device.type == "cpu":
        kernel_args = (ctypes.c_int64 * 4)(order.data_ptr(), slots.data_ptr(), starts.data_ptr(), len(slots))
    return LoRASegments(order, slots, starts, token_slots.numel(), covers_all, kernel_args)


@dataclass(frozen=True)
class KernelWeights:
    """What the compiled kernel reads of one layer's slot buffers (its entry point, pointers and sizes)."""

    function: object  # the ctypes entry point for the buffers' dtype
    dtype: torch.dtype
    fields: tuple[int, int, int, int, int]  # A, Bt and ranks pointers, out_features, rank_cap
    in_features: int


def kernel_weights(lora_a: torch.Tensor, lora_bt: torch.Tensor, ranks: torch.Tensor) -> KernelWeights | None:
    """The compiled kernel's view of one layer's slot buffers, or None where it cannot serve them (a GPU, float16,
    a rank over MAX_NATIVE_RANK, no compiler). Made once per change of the buffers, not per call: a layer is
    called ~200 times a step."""
    if not (lora_a.device.type == "cpu" and lora_a.dtype == lora_bt.dtype and lora_a.shape[1] <= MAX_NATIVE_RANK
            and lora_a.is_contiguous() and lora_bt.is_contiguous() and ranks.device.type == "cpu"):
        return None
    function = _native_function(lora_a.dtype)
    if function is None:
        return None
    fields = (lora_a.data_ptr(), lora_bt.data_ptr(), ranks.data_ptr(), lora_bt.shape[2], lora_a.shape[1])
    return KernelWeights(function, lora_a.dtype, fields, lora_a.shape[2])


class KernelCall:
    """One call of the compiled kernel for one or more layers that read the same x (q/k/v, gate/up), each adding
    its update to its own output. The layers' fields are written once into the argument array the kernel reads;
    a call only writes the outputs' pointers there, and ctypes converts 7 arguments, not one per field."""

    def __init__(self, weights: list[KernelWeights]):
        """weights: of layers with one dtype and one input size (`kernel_call` checks)."""
        first = weights[0]
        self.function, self.dtype, self.in_features = first.function, first.dtype, first.in_features
        self.args = (ctypes.c_int64 * (7 * len(weights)))(*[v for w in weights for v in (*w.fields, 0, 0)])
        self.address = ctypes.addressof(self.args)

    def __call__(self, ys: list[torch.Tensor], x: torch.Tensor, segments: LoRASegments) -> bool:
        """Adds every layer's update to its y [num_tokens, out]; False (nothing done) where the kernel cannot."""
        if segments.kernel_args is None or x.dtype != self.dtype or x.stride(1) != 1:
            return False
        args = self.args
        for i, y in enumerate(ys):
            if y.dtype != self.dtype or y.stride(1) != 1:
                return False
            args[7 * i + 5] = y.data_ptr()
            args[7 * i + 6] = y.stride(0)
        return self.function(self.address, len(ys), segments.kernel_args, x.data_ptr(), x.stride(0),
                             self.in_features, torch.get_num_threads()) == 0


def kernel_call(weights: list[KernelWeights | None]) -> KernelCall | None:
    """A KernelCall for these layers, or None where the kernel cannot serve one of them."""
    if any(w is None for w in weights):
        return None
    first = weights[0]
    if any(w.function is not first.function or w.in_features != first.in_features for w in weights):
        return None
    return KernelCall(weights)


def apply_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor, ranks: torch.Tensor,
               segments: LoRASegments, call: KernelCall | None = None) -> None:
    """y [num_tokens, out] += the LoRA update of x [num_tokens, in], in place. lora_a: [slots, rank_cap, in];
    lora_bt: [slots, rank_cap, out] (B transposed); ranks: [slots] int64 on CPU (0: the slot skips this layer);
    call: the `KernelCall` of the three, when the caller keeps it (else it is made here)."""
    if call is None:
        call = kernel_call([kernel_weights(lora_a, lora_bt, ranks)])
    if call is None or not call([y], x, segments):
        apply_lora_reference(y, x, lora_a, lora_bt, ranks, segments)


def apply_lora_group(ys: list[torch.Tensor], x: torch.Tensor, layers: list[tuple[torch.Tensor, ...]],
                     segments: LoRASegments, call: KernelCall | None = None) -> None:
    """`apply_lora` for layers that read the same x, one kernel call for all: ys[i] += the update of layers[i]
    ((lora_a, lora_bt, ranks), as for apply_lora)."""
    if call is None:
        call = kernel_call([kernel_weights(*layer) for layer in layers])
    if call is None or not call(ys, x, segments):
        for y, layer in zip(ys, layers):
            apply_lora_reference(y, x, *layer, segments)


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
    library = native.load_or_warn(native.load_lora, "multi-LoRA")
    if library is None:
        return None
    # (members, num_members, segments, x, x_stride, in, num_threads): kernels/csrc/lora_sgmv.cpp
    function = native.entry_point(library, f"lora_sgmv_{NATIVE_DTYPES[dtype]}", [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int])
    return function
