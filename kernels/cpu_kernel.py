"""The CPU kernel: the torch kernel, with one-token queries (decodes) run by a compiled paged decode kernel.

Decode attention is where a CPU step spends its memory bandwidth: the torch kernel gathers each row's blocks
into a dense buffer before SDPA reads them, the compiled kernel (`csrc/paged_decode.cpp`) reads the blocks in
place, once. A bf16/fp16 cache is read at its own width and widened to float32 in registers (products and
sums in float32); an int8/fp8 cache likewise, with its per-(block, KV head) scales applied per score and per
softmax weight. Prefill chunks are compute-bound and stay with SDPA. The torch kernel remains the reference this
one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native
from .torch_kernel import TorchKernel


@dataclass
class NativeDecodes:
    rows: torch.Tensor  # [num_rows] token index of each decode query in the packed row
    block_tables: torch.Tensor  # [num_rows, max_blocks] int64, padded with block 0 (never read)
    context_lens: torch.Tensor  # [num_rows] int64


class CpuKernel(TorchKernel):
    name = "cpu"

    def __init__(self, dtype: torch.dtype, head_dims: list[int], kv_dtype: torch.dtype | None = None):
        """Builds (or loads the cached build of) the decode library for each head_dim; raises
        native.NativeBuildError when that is impossible here, ValueError for what it cannot serve.
        `kv_dtype`: the cache's storage dtype when it differs from the model's `dtype` (int8/fp8)."""
        reason = self.unsupported_reason(torch.device("cpu"), dtype, head_dims, kv_dtype)
        if reason is not None:
            raise ValueError(reason)
        kv_dtype = kv_dtype or dtype
        suffix = native.QUANTIZED_DTYPES.get(kv_dtype) or native.DTYPES[kv_dtype]
        self._functions = {
            head_dim: getattr(native.load_paged_decode(head_dim), f"paged_decode_{suffix}") for head_dim in set(head_dims)
        }

    @staticmethod
    def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dims: list[int],
                           kv_dtype: torch.dtype | None = None) -> str | None:
        if device.type != "cpu":
            return f"the CPU kernel runs on CPU, the model is on {device}"
        if dtype not in native.DTYPES:
            return f"the CPU kernel serves float32/float64/bfloat16/float16, the model is {dtype}"
        if kv_dtype not in (None, dtype) and kv_dtype not in native.QUANTIZED_DTYPES:
            return f"the CPU kernel reads an int8/fp8 cache or one in the model's dtype, not {kv_dtype}"
        compute_of = torch.float32 if kv_dtype in native.QUANTIZED_DTYPES else dtype
        if not all(native.head_dim_fits(compute_of, d) for d in head_dims):
            compute = native.COMPUTE_DTYPES[compute_of]
            return f"the CPU kernel needs head_dim a multiple of 64 bytes of {compute}, got {sorted(set(head_dims))}"
        return None

    def plan_decodes(self, decodes: list[tuple[int, int, list[int]]], device: torch.device) -> NativeDecodes | None:
        if not decodes:
            return None
        max_blocks = max(len(table) for _, _, table in decodes)
        return NativeDecodes(
            rows=torch.tensor([row for _, row, _ in decodes], dtype=torch.long),
            block_tables=torch.tensor([table + [0] * (max_blocks - len(table)) for _, _, table in decodes],
                                      dtype=torch.long),
            context_lens=torch.tensor([length for length, _, _ in decodes], dtype=torch.long),
        )

    def attend_decodes(self, query, output, key_cache, value_cache, plan, *, scaling, sliding_window, softcap,
                       scales=None) -> None:
        decodes: NativeDecodes | None = plan.decodes
        if decodes is None:
            return
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        assert (scales is not None) == (key_cache.dtype in native.QUANTIZED_DTYPES)
        assert scales is not None or query.dtype == key_cache.dtype
        # [num_rows, num_heads, head_dim], contiguous, in the compute dtype (float32 for a bf16/fp16/int8/fp8 cache)
        q = query.index_select(0, decodes.rows).to(native.COMPUTE_DTYPES.get(key_cache.dtype, torch.float32))
        out = torch.empty_like(q)
        scale_pointers = () if scales is None else (scales.key.data_ptr(), scales.value.data_ptr())
        status = self._functions[head_dim](
            q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), *scale_pointers, decodes.block_tables.data_ptr(),
            decodes.context_lens.data_ptr(), out.data_ptr(), q.shape[0], decodes.block_tables.shape[1],
            q.shape[1], num_kv_heads, block_size, scaling, sliding_window or 0, softcap or 0.0,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged decode kernel failed (status {status}: {'out of memory' if status == 1 else 'head_dim'})")
        output.index_copy_(0, decodes.rows, out.to(output.dtype))
