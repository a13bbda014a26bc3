"""The CPU kernel: the torch kernel, with decodes, and bf16 prefill chunks, run by compiled kernels.

Decode attention is where a CPU step spends its memory bandwidth: the torch kernel gathers each row's blocks
into a dense buffer before SDPA reads them, the compiled kernel (`csrc/paged_decode.cpp`) reads the blocks in
place, once. A bf16/fp16 cache is read at its own width and widened to float32 in registers (products and
sums in float32); an int8/fp8 cache likewise, with its per-(block, KV head) scales applied per score and per
softmax weight. Prefill chunks (and speculative decoding's multi-token queries) are compute-bound: in bf16, on
a CPU with AVX512-BF16, they go to `csrc/paged_prefill.cpp` (bf16 dot products into float32 sums, read from the
cache in place), because torch's SDPA runs bf16 no faster than float32; everywhere else they stay with SDPA.
The torch kernel remains the reference this one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import native
from .torch_kernel import TorchKernel, TorchPlan

#: query heads per KV head the prefill kernel's tiles hold (48 rows); more go to SDPA
MAX_PREFILL_GROUP = 48


@dataclass
class NativeDecodes:
    rows: torch.Tensor  # [num_rows] token index of each decode query in the packed row
    block_tables: torch.Tensor  # [num_rows, max_blocks] int64, padded with block 0 (never read)
    context_lens: torch.Tensor  # [num_rows] int64


@dataclass
class NativePrefills:
    query_starts: torch.Tensor  # [num_chunks] int64: each chunk's first row in the packed query
    query_lens: torch.Tensor  # [num_chunks] int64
    context_lens: torch.Tensor  # [num_chunks] int64, the chunk's own tokens included
    block_tables: torch.Tensor  # [num_chunks, max_blocks] int64, padded with block 0 (never read)


@dataclass
class CpuPlan(TorchPlan):
    native_prefills: NativePrefills | None = None


class CpuKernel(TorchKernel):
    name = "cpu"

    def __init__(self, dtype: torch.dtype, head_dims: list[int], kv_dtype: torch.dtype | None = None):
        """Builds (or loads the cached build of) the decode library for each head_dim, and for a bf16 model and
        cache the prefill library (used where the CPU has AVX512-BF16); raises native.NativeBuildError when that
        is impossible here, ValueError for what it cannot serve.
        `kv_dtype`: the cache's storage dtype when it differs from the model's `dtype` (int8/fp8)."""
        reason = self.unsupported_reason(torch.device("cpu"), dtype, head_dims, kv_dtype)
        if reason is not None:
            raise ValueError(reason)
        kv_dtype = kv_dtype or dtype
        suffix = native.QUANTIZED_DTYPES.get(kv_dtype) or native.DTYPES[kv_dtype]
        self._functions = {
            head_dim: getattr(native.load_paged_decode(head_dim), f"paged_decode_{suffix}") for head_dim in set(head_dims)
        }
        self._prefill_functions = {}  # head_dim -> the compiled bf16 prefill kernel, where it serves the model
        if dtype == torch.bfloat16 and kv_dtype == dtype and all(native.prefill_head_dim_fits(d) for d in head_dims):
            libraries = {head_dim: native.load_paged_prefill(head_dim) for head_dim in set(head_dims)}
            if all(libraries.values()):  # None: this CPU has no AVX512-BF16
                self._prefill_functions = {d: library.paged_prefill_bfloat16 for d, library in libraries.items()}

    @property
    def serves_prefills(self) -> bool:
        """Whether prefill chunks run compiled (a bf16 model and cache on a CPU with AVX512-BF16) or in SDPA."""
        return bool(self._prefill_functions)

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

    def plan(self, metadata, device: torch.device) -> CpuPlan:
        plan = super().plan(metadata, device)
        plan = CpuPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)})
        if self._prefill_functions and plan.prefills:
            chunks = plan.prefills
            plan.native_prefills = NativePrefills(
                query_starts=torch.tensor([c.query_start for c in chunks], dtype=torch.long),
                query_lens=torch.tensor([c.query_len for c in chunks], dtype=torch.long),
                context_lens=torch.tensor([c.context_len for c in chunks], dtype=torch.long),
                block_tables=torch.nn.utils.rnn.pad_sequence([c.block_ids.cpu() for c in chunks], batch_first=True),
            )
        return plan

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

    def attend_prefills(self, query, key, value, output, key_cache, value_cache, plan, *, scaling, sliding_window,
                        softcap, scales=None) -> None:
        """bf16 chunks go to the compiled prefill kernel, which reads their context from the cache in place."""
        prefills: NativePrefills | None = getattr(plan, "native_prefills", None)
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = key_cache.shape[2]
        if (prefills is None or scales is not None or num_heads // num_kv_heads > MAX_PREFILL_GROUP
                or query.stride(-1) != 1 or output.stride(-1) != 1):
            super().attend_prefills(query, key, value, output, key_cache, value_cache, plan, scaling=scaling,
                                    sliding_window=sliding_window, softcap=softcap, scales=scales)
            return
        assert key_cache.is_contiguous() and value_cache.is_contiguous() and key_cache.dtype == query.dtype
        status = self._prefill_functions[head_dim](
            query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            prefills.block_tables.data_ptr(), prefills.query_starts.data_ptr(), prefills.query_lens.data_ptr(),
            prefills.context_lens.data_ptr(), output.data_ptr(), output.stride(0), output.stride(1),
            prefills.query_lens.shape[0], prefills.block_tables.shape[1], num_heads, num_kv_heads,
            key_cache.shape[1], scaling, sliding_window or 0, softcap or 0.0, torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged prefill kernel failed (status {status}: "
                               f"{'out of memory' if status == 1 else 'too many query heads per KV head'})")
