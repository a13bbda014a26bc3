"""The CPU kernel: the torch kernel, with its attention run by compiled kernels that read the paged cache in place.

Decode attention is where a CPU step spends its memory bandwidth: the torch kernel gathers each row's blocks
into a dense buffer before SDPA reads them, the compiled kernel (`csrc/paged_decode.cpp`) reads the blocks in
place, once. A bf16/fp16 cache is read at its own width and widened to float32 in registers (products and
sums in float32); an int8/fp8 cache likewise, with its per-(block, KV head) scales applied per score and per
softmax weight. The same kernel serves multi-token queries (prompt chunks, speculative decoding's last token
plus drafts) computed in float32, in tiles with the query rows in the vector lanes: 1.7-2.5x torch's float32
SDPA on SmolLM2's shapes (17 to 512 tokens, with and without a past), and no gathered copy, on an AVX-512 CPU
(without AVX-512 the tiles lose to SDPA, which then takes prompt chunks). In bf16, on a CPU
with AVX512-BF16, prompt chunks go to `csrc/paged_prefill.cpp` instead (bf16 dot products into float32 sums), on
AMX tiles where the CPU has them (`prefill_isa`).
float64 (tests) keeps SDPA for queries longer than MAX_FLOAT64_QUERY_LEN.
The torch kernel remains the reference this one is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_hf.kernels import native
from paged_hf.utils import cpu_flags
from paged_hf.kernels.spec import NO_TERMS, AttentionSpec, ScoreTerms
from paged_hf.kernels.torch_kernel import PrefillChunk, Query, TorchKernel, TorchPlan, prefill_chunk

#: query heads per KV head the prefill kernel's tiles hold (48 rows); more go to SDPA
MAX_PREFILL_GROUP = 48
#: float64 queries up to this many tokens read their context in the decode kernel's rows, longer ones go to SDPA;
#: computed in float32, queries of any length go to its tiles (see plan_queries)
MAX_FLOAT64_QUERY_LEN = 8


@dataclass
class NativeDecodes:
    rows: torch.Tensor  # [num_rows] token index of each query token in the packed row, sequence by sequence
    context_lens: torch.Tensor  # [num_rows] int64: the keys each row attends to (causal within a sequence)
    seq_starts: torch.Tensor  # [num_seqs + 1] int64: sequence s is the rows [seq_starts[s], seq_starts[s + 1])
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0 (never read)
    in_order: bool = False  # rows are 0, 1, 2, ...: with every token of the step a decode, no gather/scatter


@dataclass
class NativePrefills:
    query_starts: torch.Tensor  # [num_chunks] int64: each chunk's first row in the packed query
    query_lens: torch.Tensor  # [num_chunks] int64
    context_lens: torch.Tensor  # [num_chunks] int64, the chunk's own tokens included
    block_tables: torch.Tensor  # [num_chunks, max_blocks] int64, padded with block 0 (never read)


@dataclass
class CpuPlan(TorchPlan):
    native_prefills: NativePrefills | None = None


@dataclass
class DecodeRows:
    """The decode kernel's call in a step whose every query it serves, its per-step arguments gathered once (the
    lean layers call it in every layer, worker/fast_paths/lean_layers.py): q rows read in place at their row
    stride (a bf16 model's) or copied out of them (float32)."""
    function: Callable
    in_place: bool  # the bf16-rows entry point: q read at its row stride, the output written in bf16
    dtype: torch.dtype  # of the q rows and the output
    step: tuple  # (block_tables, context_lens, seq_starts) pointers
    num_rows: int  # the step's tokens
    num_seqs: int
    max_blocks: int
    tensors: tuple  # what the pointers point into, held for the step

    def __call__(self, rows: torch.Tensor, num_heads: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 scaling: float, out: torch.Tensor) -> None:
        """rows [num_tokens, >= num_heads * head_dim] (q's heads first, unit stride) -> out [num_tokens, num_heads,
        head_dim] (contiguous, `dtype`): each token's attention over its sequence's cached keys (its own
        included)."""
        num_kv_heads, head_dim = key_cache.shape[2:]
        query = rows if self.in_place else rows[:, :num_heads * head_dim].contiguous()
        stride = (query.stride(0),) if self.in_place else ()
        _check_status(self.function(query.data_ptr(), *stride, key_cache.data_ptr(), value_cache.data_ptr(), None,
                                    None, *self.step, out.data_ptr(), self.num_seqs, self.max_blocks, num_heads,
                                    num_kv_heads, key_cache.shape[1], scaling, 0, 0.0, torch.get_num_threads()))


class CpuKernel(TorchKernel):
    name = "cpu"

    def __init__(self, dtype: torch.dtype, head_dims: list[int], kv_dtype: torch.dtype | None = None,
                 prefill_isa: str | None = None):
        """Builds (or loads the cached build of) the decode library for each head_dim, and for a bf16 model and
        cache the prefill library (used where the CPU has AVX512-BF16); raises native.NativeBuildError when that
        is impossible here, ValueError for what it cannot serve.
        `kv_dtype`: the cache's storage dtype when it differs from the model's `dtype` (int8/fp8).
        `prefill_isa`: the prefill kernel's instructions, "amx_bf16" or "avx512_bf16" (None: the fastest this CPU
        has), or "amx_bf16_emulated" (AMX's tiles in plain C++, for tests); ValueError where unavailable."""
        reason = _dtype_reason(dtype, head_dims, kv_dtype)
        if reason is not None:
            raise ValueError(reason)
        kv_dtype = kv_dtype or dtype
        self.compute_dtype = native.COMPUTE_DTYPES.get(kv_dtype, torch.float32)  # of queries and outputs
        # the multi-token tiles are 16 floats a vector, one AVX-512 register; built for AVX2 each takes two, and
        # SDPA is faster for prompt chunks (AMD EPYC Zen 4 VM without AVX-512: a 2,692-token float32 prompt of the
        # default model 61.7 s in the tiles, 8.2 s with SDPA)
        self.tiles_beat_sdpa = "avx512f" in cpu_flags()
        suffix = native.QUANTIZED_DTYPES.get(kv_dtype) or native.DTYPES[kv_dtype]
        self._functions = {
            head_dim: getattr(native.load_paged_decode(head_dim), f"paged_decode_{suffix}") for head_dim in set(head_dims)
        }
        # a bf16 model's query and output rows as they are (the cast and copy around the call done inside it)
        self._bf16_row_functions = {} if dtype != torch.bfloat16 or suffix not in native.BF16_ROWS_CACHES else {
            head_dim: getattr(native.load_paged_decode(head_dim), f"paged_decode_{suffix}_bf16_rows")
            for head_dim in set(head_dims)
        }
        self._prefill_functions = {}  # head_dim -> the compiled bf16 prefill kernel, where it serves the model
        self.prefill_isa = None  # the instructions it computes with
        wanted = prefill_isa.removesuffix("_emulated") if prefill_isa else None
        if dtype == torch.bfloat16 and kv_dtype == dtype and all(native.prefill_head_dim_fits(d) for d in head_dims):
            flags = native.EMULATE_AMX if prefill_isa == "amx_bf16_emulated" else ()
            libraries = {head_dim: native.load_paged_prefill(head_dim, flags) for head_dim in set(head_dims)}
            if all(libraries.values()):  # None: this CPU has no AVX512-BF16
                by_isa = {d: native.prefill_isas(library) for d, library in libraries.items()}
                available = next(iter(by_isa.values()))  # the same for every head_dim: one CPU
                isa = wanted or next(iter(available))
                if isa in available:
                    self.prefill_isa = isa
                    self._prefill_functions = {d: functions[isa] for d, functions in by_isa.items()}
        if wanted is not None and wanted != self.prefill_isa:
            raise ValueError(f"the prefill kernel cannot compute with {prefill_isa} here "
                             f"(this CPU, this dtype and head_dim: {self.prefill_isa})")

    @staticmethod
    def unsupported_reason(spec: AttentionSpec) -> str | None:
        """None where the compiled kernels compute the layer: on the CPU, in a dtype and head_dim they are built
        for, K and V of one width, no chunks and no score terms (those are the torch kernel's)."""
        if spec.device.type != "cpu":
            return f"the CPU kernel runs on CPU, the model is on {spec.device}"
        reason = _dtype_reason(spec.dtype, [spec.head_dim], spec.kv_dtype)
        if reason is not None:
            return reason
        if spec.value_head_dim != spec.head_dim:
            return "K and V have different head_dims (MLA): the torch kernel serves them"
        if spec.chunk_size is not None:
            return "chunked attention (Llama 4): the torch kernel serves it"
        if spec.score_terms:
            return f"{_terms_named(spec.score_terms)} in the scores: the torch kernel serves them"
        if spec.bidirectional_spans:
            return "bidirectional spans (an image's tokens see each other, Gemma 3): the torch kernel serves them"
        return None

    def plan_queries(self, slot_mapping: torch.Tensor, queries: list[Query], device: torch.device) -> CpuPlan:
        """Decodes go to the compiled decode kernel; so do multi-token queries (prompt chunks, a request's last
        token with its drafts) computed in float32 on an AVX-512 CPU, whose tiles serve them faster than SDPA at
        every length, and elsewhere (float64, float32 without AVX-512) those of up to MAX_FLOAT64_QUERY_LEN
        tokens. The rest are prefill chunks: the bf16 prefill kernel's where it serves the model, else SDPA's."""
        assert not any(q.spans for q in queries), "bidirectional spans are the torch kernel's (unsupported_reason)"
        if self._prefill_functions:
            limit = 1
        elif self.compute_dtype == torch.float64:
            limit = MAX_FLOAT64_QUERY_LEN
        elif self.tiles_beat_sdpa:
            limit = math.inf
        else:
            limit = MAX_FLOAT64_QUERY_LEN
        chunks = [prefill_chunk(q, device) for q in queries if q.length > limit]
        native_prefills = _native_prefills(chunks) if self._prefill_functions and chunks else None
        return CpuPlan(slot_mapping, _native_decodes([q for q in queries if q.length <= limit]), chunks,
                       native_prefills=native_prefills)

    def attend_decodes(self, query, output, key_cache, value_cache, plan, *, scaling, sliding_window, softcap,
                       scales=None, chunk_size=None, terms: ScoreTerms = NO_TERMS) -> None:
        assert terms.none and chunk_size is None, "score terms and chunks are the torch kernel's (unsupported_reason)"
        decodes: NativeDecodes | None = plan.decodes
        if decodes is None:
            return
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        assert (scales is not None) == (key_cache.dtype in native.QUANTIZED_DTYPES)
        assert scales is not None or query.dtype == key_cache.dtype
        whole = decodes.in_order and decodes.rows.numel() == query.shape[0]
        scale_pointers = (None, None) if scales is None else (scales.key.data_ptr(), scales.value.data_ptr())
        arguments = (key_cache.data_ptr(), value_cache.data_ptr(), *scale_pointers, decodes.block_tables.data_ptr(),
                     decodes.context_lens.data_ptr(), decodes.seq_starts.data_ptr())
        sizes = (decodes.block_tables.shape[0], decodes.block_tables.shape[1], query.shape[1], num_kv_heads,
                 block_size, scaling, sliding_window or 0, softcap or 0.0, torch.get_num_threads())
        if (whole and head_dim in self._bf16_row_functions and _bf16_rows(query) and output.dtype == torch.bfloat16
                and output.is_contiguous()):
            status = self._bf16_row_functions[head_dim](query.data_ptr(), query.stride(0), *arguments,
                                                        output.data_ptr(), *sizes)
            _check_status(status)
            return
        # [num_rows, num_heads, head_dim], contiguous, in the compute dtype (float32 for a bf16/fp16/int8/fp8 cache);
        # a step of decodes only reads the query and writes the output in place
        q = (query if whole else query.index_select(0, decodes.rows)).to(self.compute_dtype).contiguous()
        in_place = whole and output.dtype == self.compute_dtype and output.is_contiguous()
        out = output if in_place else torch.empty_like(q)
        _check_status(self._functions[head_dim](q.data_ptr(), *arguments, out.data_ptr(), *sizes))
        if whole and not in_place:
            output.copy_(out)
        elif not whole:
            output.index_copy_(0, decodes.rows, out.to(output.dtype))

    def decode_rows(self, plan: CpuPlan, dtype: torch.dtype, cache_dtype: torch.dtype,
                    head_dim: int) -> DecodeRows | None:
        """The decode kernel's call for `plan`'s step when it serves every query of it, in order (no prefill chunk
        for another kernel), and the cache is in the model's `dtype` (bfloat16 or float32: not quantized, no
        float64); else None."""
        decodes: NativeDecodes | None = plan.decodes
        if (decodes is None or plan.prefills or not decodes.in_order or cache_dtype != dtype
                or dtype not in (torch.bfloat16, torch.float32) or head_dim not in self._functions):
            return None
        in_place = head_dim in self._bf16_row_functions
        if dtype == torch.bfloat16 and not in_place:
            return None
        function = (self._bf16_row_functions if in_place else self._functions)[head_dim]
        tensors = (decodes.block_tables, decodes.context_lens, decodes.seq_starts)
        return DecodeRows(function, in_place, dtype, tuple(t.data_ptr() for t in tensors), decodes.rows.numel(),
                          *decodes.block_tables.shape, tensors)

    def attend_prefills(self, query, key, value, output, key_cache, value_cache, plan, *, scaling, sliding_window,
                        softcap, scales=None, chunk_size=None, terms: ScoreTerms = NO_TERMS) -> None:
        """bf16 chunks go to the compiled prefill kernel, which reads their context from the cache in place."""
        prefills: NativePrefills | None = plan.native_prefills
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


def _dtype_reason(dtype: torch.dtype, head_dims: list[int], kv_dtype: torch.dtype | None) -> str | None:
    """Why the compiled kernels are not built for this model's dtype, cache dtype or head dims; None if they are."""
    if dtype not in native.DTYPES:
        return f"the CPU kernel serves float32/float64/bfloat16/float16, the model is {dtype}"
    if kv_dtype not in (None, dtype) and kv_dtype not in native.QUANTIZED_DTYPES:
        return f"the CPU kernel reads an int8/fp8 cache or one in the model's dtype, not {kv_dtype}"
    compute_of = torch.float32 if kv_dtype in native.QUANTIZED_DTYPES else dtype
    if not all(native.head_dim_fits(compute_of, d) for d in head_dims):
        compute = native.COMPUTE_DTYPES[compute_of]
        return f"the CPU kernel needs head_dim a multiple of 64 bytes of {compute}, got {sorted(set(head_dims))}"
    return None


def _terms_named(names: frozenset[str]) -> str:
    """ScoreTerms field names as a reader knows them."""
    words = {"sinks": "attention sinks", "distance_bias": "a learned bias by distance (Inkling)",
             "alibi_slopes": "ALiBi (BLOOM, MPT)", "key_mask": "keys selected per query (sparse attention)"}
    return ", ".join(words.get(name, name) for name in sorted(names))


def _bf16_rows(x: torch.Tensor) -> bool:
    """x [rows, heads, head_dim] in bf16 with each row's heads one after the other (rows any stride apart)."""
    return x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _check_status(status: int) -> None:
    if status != 0:
        reason = "out of memory" if status == 1 else "head_dim"
        raise RuntimeError(f"paged decode kernel failed (status {status}: {reason})")


def _native_decodes(queries: list[Query]) -> NativeDecodes | None:
    """Row i of a query of n tokens is its token i, which attends to context_len - n + 1 + i keys."""
    if not queries:
        return None
    max_blocks = max(len(q.block_table) for q in queries)
    rows, lens, starts = [], [], [0]
    for q in queries:
        rows.extend(range(q.start, q.start + q.length))
        lens.extend(range(q.context_len - q.length + 1, q.context_len + 1))
        starts.append(len(rows))
    return NativeDecodes(
        rows=torch.tensor(rows, dtype=torch.long), context_lens=torch.tensor(lens, dtype=torch.long),
        seq_starts=torch.tensor(starts, dtype=torch.long),
        block_tables=torch.tensor([q.block_table + [0] * (max_blocks - len(q.block_table)) for q in queries],
                                  dtype=torch.long),
        in_order=rows == list(range(len(rows))),
    )


def _native_prefills(chunks: list[PrefillChunk]) -> NativePrefills:
    return NativePrefills(
        query_starts=torch.tensor([c.query_start for c in chunks], dtype=torch.long),
        query_lens=torch.tensor([c.query_len for c in chunks], dtype=torch.long),
        context_lens=torch.tensor([c.context_len for c in chunks], dtype=torch.long),
        block_tables=torch.nn.utils.rnn.pad_sequence([c.block_ids.cpu() for c in chunks], batch_first=True),
    )
