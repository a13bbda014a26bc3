"""oneDNN-packed weights for the model's CPU linear layers, swapped in for the engine's steps only.

Why: torch's float32 `F.linear` goes to MKL, which on AMD CPUs runs its AVX2 kernels. oneDNN's matmul on a
weight packed once for it uses the whole AVX-512 unit: on the build machine (AMD EPYC Zen 5, one thread, the
default model's shapes) 105 -> 245 GFLOP/s in float32, and 255 -> 375 in bfloat16 at decode-sized batches
(16 rows). It is the same float32 arithmetic in another summation order (MKL's own order already changes
with the batch size).

Like the attention switch and the LoRA wrappers, the packed layers are installed only for the duration of
a step (`parent._modules[name]` swapped and restored), so outside a step the user's model is exactly what it
was. A weight changed in place or replaced later is packed again.

The packed copies cost the linears' weights once more in memory, so they are made only once the engine needs
them (`PackingSwitch`): at the first step of more sequences than the few-row loops serve. One chat (its decodes
on the few-row loops, its prompts on the weights themselves, where packing gains ~0-20% past 64 rows) never
holds the weights twice; a server's batches pay for them when they come.
"""

from __future__ import annotations

import torch

from paged_hf.kernels import small_gemm
from paged_hf.kernels.small_gemm import SmallLinear
from paged_hf.worker.stand_ins import ModuleSwaps, StandIn

# the batch size the weights are laid out for; oneDNN runs any batch on them (measured: no slower at 1-512)
_BATCH_HINT = 64


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes this CPU's oneDNN build packs (no float64; float16 only with AVX512-FP16)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_linear_pointwise"):
        return ()
    dtypes = [torch.float32]
    if mkldnn._is_mkldnn_bf16_supported():
        dtypes.append(torch.bfloat16)
    return tuple(dtypes)


class PackingSwitch:
    """Whether a dtype's packed copies are in use yet: from the first step of more sequences than the few-row
    loops compute at that dtype (`small_gemm.max_rows`); from the start for a dtype they do not compute here."""

    def __init__(self):
        self.most_sequences = 0

    def see_step(self, sequences: int) -> None:
        self.most_sequences = max(self.most_sequences, sequences)

    def packs(self, dtype: torch.dtype) -> bool:
        return self.most_sequences > small_gemm.max_rows(dtype)


class PackedLinear(StandIn):
    """`base`'s forward on a oneDNN-packed copy of its weight (packed again when the weight changes); at a few
    rows, on the weight itself through the small-row loops (kernels/small_gemm.py) where this CPU has them (the
    only stand-in of a dtype oneDNN does not pack here: bf16 on AVX2 CPUs)."""

    def __init__(self, base: torch.nn.Linear, packs: bool = True, switch: PackingSwitch | None = None):
        """`packs`: whether oneDNN packs this dtype here; else (bf16 on a CPU without AVX-512) only the few-row
        loops serve and larger batches take `F.linear` as before. `switch`: when the packed copy is made and
        used (None: from the first call)."""
        super().__init__(base)
        object.__setattr__(self, "base", base)
        self.packs = packs
        self.switch = switch
        self._packed_from: tuple[torch.Tensor, tuple] | None = None  # (the weight, its `weight_version`)
        self.packed: torch.Tensor | None = None
        self._small: tuple[torch.Tensor, torch.Tensor | None, tuple, SmallLinear | None] | None = None

    def small_linear(self) -> SmallLinear | None:
        """The few-row loops on the weight as it is now (made again when the weight or bias, or their data, is
        replaced; they read an in-place change as is)."""
        weight, bias = self.base.weight, self.base.bias
        addresses = (weight.data_ptr(), None if bias is None else bias.data_ptr())
        small = self._small
        if small is None or small[0] is not weight or small[1] is not bias or small[2] != addresses:
            usable = SmallLinear.usable([weight], [bias])
            self._small = small = (weight, bias, addresses, SmallLinear([weight.detach()], [bias]) if usable else None)
        return small[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.base.weight, self.base.bias
        small = self.small_linear()
        if small is not None and small.serves(x):
            return small(x)
        if not self.packs or (self.switch is not None and not self.switch.packs(weight.dtype)):
            return torch.nn.functional.linear(x, weight, bias)
        source = (weight, weight_version(weight))
        if self._packed_from is None or self._packed_from[0] is not weight or self._packed_from[1] != source[1]:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
            self._packed_from = source
        if x.dtype != weight.dtype:  # what F.linear would refuse, refused the same way
            return torch.nn.functional.linear(x, weight, self.base.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.base.bias, "none", [], "")


class PackedLinears(ModuleSwaps):
    """Every plain `nn.Linear` of the model that oneDNN can pack, swapped for its `PackedLinear` in a step."""

    def __init__(self, model: torch.nn.Module, skip: set[int] = frozenset(), switch: PackingSwitch | None = None):
        """`skip`: ids of Linears computed elsewhere in a step (the fused projections of `fused_layers`);
        `switch`: when the packed copies are made (None: at the first step)."""
        packed = packable_dtypes()
        dtypes = (*packed, *(dtype for dtype in small_gemm.functions() if dtype not in packed))
        self.sites = []
        if (getattr(model, "tp_size", None) or 1) > 1:  # weight shards (DTensors): left to torch
            return
        for parent in model.modules():
            for name, child in parent._modules.items():
                if _packable(child, dtypes) and id(child) not in skip:
                    self.sites.append((parent, name, child, PackedLinear(child, child.weight.dtype in packed, switch)))


def weight_version(weight: torch.Tensor) -> tuple[int | None, int]:
    """(the weight's in-place version counter, the address of its data): what a copy of it, or a kernel's pointer
    to it, was made from. The address because `parameter.data = other` (what `Module.to()` does to parameters,
    and weight-loading code) gives the same tensor other data without counting a version. The counter is None
    for an inference tensor (a model created under `torch.inference_mode()`), which has none: only replacing
    such a weight or its data is noticed."""
    return None if weight.is_inference() else weight._version, weight.data_ptr()


def _packable(module: torch.nn.Module | None, dtypes: tuple[torch.dtype, ...]) -> bool:
    """A plain Linear with its weight in CPU memory: not a subclass (peft, quantized layers), not offloaded
    or dispatched by accelerate hooks, not a weight shard."""
    if type(module) is not torch.nn.Linear or hasattr(module, "_hf_hook"):
        return False
    weight = module.weight
    return (type(weight) in (torch.nn.Parameter, torch.Tensor) and weight.device.type == "cpu"
            and weight.dtype in dtypes and weight.dim() == 2)
