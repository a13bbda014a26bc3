"""Multi-LoRA for one linear layer and one packed step: `y[t] += B[slot(t)] @ (A[slot(t)] @ x[t])` for every token
that has an adapter, all adapters in one call.

The step's tokens are grouped by adapter slot once (`lora_segments`, shared by every layer on a device); each
layer then makes one call, or one call serves several layers that read the same x (`apply_lora_group`: q/k/v,
gate/up). On CPU, for float32, float64 and bfloat16, that call is the compiled SGMV kernel
(`csrc/lora_sgmv.cpp`): it reads each slot's A and B where they lie (`SlotWeights`: on a CPU an adapter's host
copy is its slot), a tile of tokens at a time. Elsewhere (a GPU, float16, no compiler) `apply_lora_reference` runs
the same update with torch ops, one group of ops per slot; it is also what the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from paged_hf.kernels import native

#: dtypes the compiled kernel computes (bf16 in float32), by entry-point suffix
NATIVE_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
#: the largest rank the compiled kernel holds on its stack; a call with a larger one takes the torch path
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


class SlotWeights:
    """One linear's adapters by slot: slot s holds (A [rank, in], Bt [rank, out], B transposed) or nothing (its
    adapter skips this linear). The tensors are kept where they are given when they already lie on `device` in
    `dtype`, contiguous: on a CPU an adapter's host copy is its slot, and taking it into a slot copies nothing.
    The compiled kernel reads them through per-slot address tables, so slots of any rank mix in one call."""

    def __init__(self, num_slots: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device):
        self.in_features, self.out_features, self.dtype, self.device = in_features, out_features, dtype, device
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        self.ranks = torch.zeros(num_slots, dtype=torch.int64)  # 0: the slot skips this linear; read by the kernel
        self.addresses = torch.zeros(2, num_slots, dtype=torch.int64)  # each slot's A and Bt, for the kernel
        self._ranks, self._addresses = self.ranks.numpy(), self.addresses.numpy()  # element writes without ops
        self.kernel = kernel_weights(self)

    @property
    def num_slots(self) -> int:
        return len(self.pairs)

    def set(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot `slot` computes with (A [r, in], Bt [r, out]) from now on (None: nothing at this linear)."""
        if pair is None:
            self.pairs[slot] = None
            self._ranks[slot] = 0
            self._addresses[:, slot] = 0
            return
        a, bt = (t.to(self.device, self.dtype).contiguous() for t in pair)
        if a.shape[1] != self.in_features or bt.shape != (a.shape[0], self.out_features):
            raise ValueError(f"LoRA factors {tuple(a.shape)} and {tuple(bt.shape)} do not fit a "
                             f"{self.in_features} -> {self.out_features} linear")
        self.pairs[slot] = (a, bt)
        self._ranks[slot] = a.shape[0]
        self._addresses[:, slot] = a.data_ptr(), bt.data_ptr()


@dataclass(frozen=True)
class KernelWeights:
    """What the compiled kernel reads of one linear's slots (its entry point, tables and sizes)."""

    function: object  # the ctypes entry point for the slots' dtype
    dtype: torch.dtype
    fields: tuple[int, int, int, int]  # A table, Bt table and ranks pointers, out_features
    in_features: int


def kernel_weights(weights: SlotWeights) -> KernelWeights | None:
    """The compiled kernel's view of one linear's slots, or None where it cannot serve them (a GPU, float16, no
    compiler). Made once: the tables it points to are updated in place as slots change."""
    if weights.device.type != "cpu":
        return None
    function = _native_function(weights.dtype)
    if function is None:
        return None
    addresses = weights.addresses
    fields = (addresses[0].data_ptr(), addresses[1].data_ptr(), weights.ranks.data_ptr(), weights.out_features)
    return KernelWeights(function, weights.dtype, fields, weights.in_features)


#: int64 fields per member in the kernel's argument array (kFields in csrc/lora_sgmv.cpp)
_FIELDS = 6


class KernelCall:
    """One call of the compiled kernel for one or more linears that read the same x (q/k/v, gate/up), each adding
    its update to its own output. The linears' fields are written once into the argument array the kernel
    reads; a call only writes the outputs' pointers there, and ctypes converts 7 arguments, not one per field."""

    def __init__(self, weights: list[KernelWeights]):
        """weights: of linears with one dtype and one input size (`kernel_call` checks)."""
        first = weights[0]
        self.function, self.dtype, self.in_features = first.function, first.dtype, first.in_features
        self.args = (ctypes.c_int64 * (_FIELDS * len(weights)))(*[v for w in weights for v in (*w.fields, 0, 0)])
        self.address = ctypes.addressof(self.args)

    def __call__(self, ys: list[torch.Tensor], x: torch.Tensor, segments: LoRASegments) -> bool:
        """Adds every linear's update to its y [num_tokens, out]; False (nothing done) where the kernel cannot (a
        slot's rank over MAX_NATIVE_RANK among them)."""
        if segments.kernel_args is None or x.dtype != self.dtype or x.stride(1) != 1:
            return False
        args = self.args
        for i, y in enumerate(ys):
            if y.dtype != self.dtype or y.stride(1) != 1:
                return False
            args[_FIELDS * i + 4] = y.data_ptr()
            args[_FIELDS * i + 5] = y.stride(0)
        return self.function(self.address, len(ys), segments.kernel_args, x.data_ptr(), x.stride(0),
                             self.in_features, torch.get_num_threads()) == 0


def kernel_call(weights: list[KernelWeights | None]) -> KernelCall | None:
    """A KernelCall for these linears, or None where the kernel cannot serve one of them."""
    if any(w is None for w in weights):
        return None
    first = weights[0]
    if any(w.function is not first.function or w.in_features != first.in_features for w in weights):
        return None
    return KernelCall(weights)


def apply_lora(y: torch.Tensor, x: torch.Tensor, weights: SlotWeights, segments: LoRASegments,
               call: KernelCall | None = None) -> None:
    """y [num_tokens, out] += the LoRA update of x [num_tokens, in], in place, every slot's tokens with that slot's
    weights; call: the `KernelCall` of `weights`, when the caller keeps it (else it is made here)."""
    if call is None:
        call = kernel_call([weights.kernel])
    if call is None or not call([y], x, segments):
        apply_lora_reference(y, x, weights, segments)


def apply_lora_group(ys: list[torch.Tensor], x: torch.Tensor, weights: list[SlotWeights], segments: LoRASegments,
                     call: KernelCall | None = None) -> None:
    """`apply_lora` for linears that read the same x, one kernel call for all: ys[i] += the update of weights[i]."""
    if call is None:
        call = kernel_call([w.kernel for w in weights])
    if call is None or not call(ys, x, segments):
        for y, layer in zip(ys, weights):
            apply_lora_reference(y, x, layer, segments)


def apply_lora_reference(y: torch.Tensor, x: torch.Tensor, weights: SlotWeights, segments: LoRASegments) -> None:
    """The same update with torch ops: a gather, two matmuls and an index_add_ per slot."""
    x = x.to(weights.dtype)
    for i, slot in enumerate(segments.slots.tolist()):
        pair = weights.pairs[slot]
        if pair is None:
            continue
        a, bt = pair  # [r, in], [r, out]
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
