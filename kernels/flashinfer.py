"""FlashInfer's paged kernels on NVIDIA GPUs, over the same NHD cache layout the torch kernel uses.

One plan per step and device, reused by every layer: `BatchDecodeWithPagedKVCacheWrapper` (tensor cores for
grouped heads) for decode-only steps, `BatchPrefillWithPagedKVCacheWrapper` when the step holds prefill chunks
(it serves the decode rows too). Layers that differ in window, soft-cap or scale get their own plan, made on
first use. FlashInfer is imported only here, only when this kernel is selected.

An fp8 cache (kv_cache_dtype fp8_e4m3/fp8_e5m2) is passed to FlashInfer as it is, with its scales: FlashInfer
takes one K and one V scale per call, so this kernel keeps the cache's scales fixed at 1.0 (`KVScales.dynamic`
False: values are clipped to the fp8 range, vLLM's default without calibration). int8 is not served here.

Not verified on a GPU yet: `build_csr` is tested on CPU against the torch kernel's view of the same batch;
`make gpu-check` runs the GPU tests (tests/test_flashinfer.py) where one is available.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_hf.kernels.base import write_kv_by_slots
from paged_hf.kernels.spec import NO_TERMS, AttentionSpec, ScoreTerms
from paged_hf.utils import cdiv

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # besides the model's own dtype


@dataclass
class CSR:
    """FlashInfer's description of a paged batch (all int32)."""

    qo_indptr: torch.Tensor  # [num_requests + 1] query rows of each request
    kv_indptr: torch.Tensor  # [num_requests + 1] pages of each request in kv_indices
    kv_indices: torch.Tensor  # [total_pages] page (block) ids, request after request
    kv_last_page_len: torch.Tensor  # [num_requests] tokens in each request's last page, in 1..page_size
    decode_only: bool


def build_csr(metadata, device: torch.device | str = "cpu") -> CSR:
    """CSR metadata from the step's block tables, built once per step."""
    block_size = metadata.block_size
    kv_indptr, kv_indices, last_page_len = [0], [], []
    for table, context_len in zip(metadata.block_tables, metadata.context_lens):
        num_pages = cdiv(context_len, block_size)
        kv_indices.extend(table[:num_pages])
        kv_indptr.append(len(kv_indices))
        last_page_len.append(context_len - (num_pages - 1) * block_size)
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return CSR(
        qo_indptr=as_int32(metadata.query_start_loc),
        kv_indptr=as_int32(kv_indptr),
        kv_indices=as_int32(kv_indices),
        kv_last_page_len=as_int32(last_page_len),
        decode_only=all(length == 1 for length in metadata.query_lens),
    )


@dataclass
class FlashInferPlan:
    csr: CSR
    slot_mapping: torch.Tensor
    page_size: int
    planned: dict = field(default_factory=dict)  # wrapper key -> the wrapper, planned for this step
    quant_write: object = None  # an fp8 cache's write bookkeeping (kernels.quant.WritePlan), made on first use


class FlashInferKernel:
    name = "flashinfer"
    per_block_kv_scales = False  # one K and one V scale per call: an fp8 cache's scales stay 1.0

    def __init__(self):
        import flashinfer  # noqa: PLC0415

        self.flashinfer = flashinfer
        self.workspaces: dict[torch.device, torch.Tensor] = {}
        self.wrappers: dict[tuple, object] = {}  # made once (they own buffers), planned again every step

    @staticmethod
    def unsupported_reason(spec: AttentionSpec) -> str | None:
        """None where FlashInfer's paged wrappers compute the layer (and flashinfer imports)."""
        if spec.device.type != "cuda":
            return f"FlashInfer needs a CUDA device, the model is on {spec.device}"
        if spec.dtype not in SUPPORTED_DTYPES:
            return f"FlashInfer serves float16/bfloat16, the model is {spec.dtype}"
        if spec.kv_dtype not in (None, spec.dtype, *SUPPORTED_KV_DTYPES):
            return f"FlashInfer reads an fp8 cache or one in the model's dtype, not {spec.kv_dtype}"
        if spec.head_dim not in SUPPORTED_HEAD_DIMS or spec.value_head_dim != spec.head_dim:
            return f"FlashInfer does not support head_dim {spec.head_dim} (values {spec.value_head_dim})"
        if spec.chunk_size is not None or spec.score_terms or spec.bidirectional_spans:
            return ("chunked attention, score terms (sinks, biases, key selections) and bidirectional spans are the "
                    "torch kernel's")
        try:
            import flashinfer  # noqa: F401, PLC0415
        except ImportError as error:
            return f"flashinfer is not importable ({error})"
        return None

    def plan(self, metadata, device: torch.device) -> FlashInferPlan:
        assert not getattr(metadata, "bidirectional", None), "bidirectional spans are the torch kernel's"
        return FlashInferPlan(build_csr(metadata, device), metadata.slot_mapping.to(device), metadata.block_size)

    def write_kv(self, key, value, key_cache, value_cache, plan: FlashInferPlan, scales=None) -> None:
        write_kv_by_slots(key, value, key_cache, value_cache, plan.slot_mapping, scales, plan)

    def attend(self, query, key, value, key_cache, value_cache, plan: FlashInferPlan, *, scaling, sliding_window, softcap,
               scales=None, chunk_size=None, terms: ScoreTerms = NO_TERMS):
        assert terms.none and chunk_size is None, "score terms and chunks are the torch kernel's (unsupported_reason)"
        wrapper = self._wrapper(plan, query, key_cache, scaling, sliding_window, softcap)
        if scales is None:
            return wrapper.run(query, (key_cache, value_cache))  # [num_tokens, num_heads, head_dim]
        assert not scales.dynamic  # fixed scales: one per tensor, as FlashInfer takes them
        return wrapper.run(query, (key_cache, value_cache), k_scale=float(scales.key[0, 0]),
                           v_scale=float(scales.value[0, 0]))

    def _wrapper(self, plan: FlashInferPlan, query, key_cache, scaling, window, softcap):
        num_heads, num_kv_heads, head_dim = query.shape[1], key_cache.shape[2], key_cache.shape[3]
        csr = plan.csr
        key = (query.device, csr.decode_only, window, softcap, scaling, num_heads, num_kv_heads, query.dtype)
        if key not in plan.planned:
            wrapper = self.wrappers.get(key) or self._new_wrapper(query.device, csr.decode_only, num_heads != num_kv_heads)
            self.wrappers[key] = wrapper
            # window_left counts the keys left of the query: HF's window W (q - k < W) is W - 1
            common = dict(pos_encoding_mode="NONE", window_left=-1 if window is None else window - 1,
                          logits_soft_cap=softcap, sm_scale=scaling, q_data_type=query.dtype, kv_data_type=key_cache.dtype)
            if csr.decode_only:
                wrapper.plan(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, num_heads, num_kv_heads, head_dim,
                             plan.page_size, **common)
            else:  # prefill defaults to causal=False and float16: both passed
                wrapper.plan(csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, num_heads, num_kv_heads,
                             head_dim, plan.page_size, causal=True, **common)
            plan.planned[key] = wrapper
        return plan.planned[key]

    def _new_wrapper(self, device: torch.device, decode_only: bool, grouped_heads: bool):
        workspace = self.workspaces.get(device)
        if workspace is None:
            workspace = self.workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if decode_only:
            return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=grouped_heads)
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
