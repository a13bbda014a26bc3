"""Engine configuration: every field has a default; `paged_hf.wrap(model, **fields)` fills it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from paged_hf.config.kv_transfer import KVTransferConfig
from paged_hf.config.speculative import SpeculativeConfig
from paged_hf.kernels.quant import KV_CACHE_DTYPE_NAMES

DEFAULT_MAX_NUM_SEQS = 64
#: what `quantization` accepts (paged_hf/loader/quantized.py): W8A8, and 4-bit weights by round to nearest or GPTQ
QUANTIZATION_NAMES = ("int8", "w4a16", "w4a16_gptq")


@dataclass
class PagedConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory
    # bytes (> 1) or a fraction of free device memory (<= 1); None: half the free GPU memory, or on CPU
    # 4 GiB capped at a quarter of the available RAM (vLLM's CPU default)
    kv_cache_memory: float | int | None = None
    # requests running at once; None: 64, or max_num_batched_tokens when that is smaller (every running
    # request needs a token of each step's budget, or the tail of the running list would starve)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 512  # per-step token budget = chunk size of chunked prefill
    max_model_len: int | None = None  # default: the model's max positions
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu" | "flashinfer"
    # "auto" (the model's dtype) | "int8" | "fp8_e4m3" | "fp8_e5m2" ("fp8": e4m3, as vLLM): a quantized cache with
    # one scale per (block, KV head) holds 2x the tokens of a bf16 cache in the same memory (docs/kv_cache_dtype.md)
    kv_cache_dtype: str = "auto"
    adapters: dict[str, str] = field(default_factory=dict)
    # adapters in device slots at once (so in one step); on a CPU model a step holds max(max_loras, max_cpu_loras)
    max_loras: int = 4
    max_lora_rank: int = 64
    # adapters kept in host memory, least recently used dropped (read again from their folder when named);
    # None: all (vLLM's max_cpu_loras), paged_hf.engine.adapter_store
    max_cpu_loras: int | None = None
    # a folder of peft adapter folders: a request naming `name` is served `lora_root/name` without a load call
    lora_root: str | None = None
    # bounds on a request's stop strings: each one is searched in every new token's text of that request
    max_stop_strings: int = 64
    max_stop_string_chars: int = 512
    # bounds on a request's grammar (structured outputs), sample.structured_output.GrammarLimits: the spec's
    # size in bytes and a JSON schema's nesting, the compile's time (seconds; it runs off the engine thread)
    # and the compiled-grammar cache's bytes
    max_grammar_bytes: int = 64 << 10
    max_grammar_depth: int = 64
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_bytes: int = 64 << 20
    # bounds on a request's token constraints: bad_words entries (each tokenized twice at submission)
    max_bad_words: int = 1024
    # CPU: run the model's float32/bfloat16 linears on oneDNN-packed copies of their weights during steps
    # (2.3x faster float32 matmuls than MKL's on AMD; costs the weights' memory once more),
    # paged_hf.worker.fast_paths.packed_linears
    pack_linear_weights: bool = True
    # CPU: q/k/v and gate/up as one matmul each, RMSNorm and SiLU-and-multiply as single compiled ops, in the
    # modules that run Llama's forward code (paged_hf.worker.fast_paths.fused_layers); False: the model's own modules
    fuse_layers: bool = True
    # speculative decoding (vLLM's speculative_config): a SpeculativeConfig or its fields as a dict / JSON
    # text, e.g. {"method": "ngram", "num_speculative_tokens": 4}; None: off
    speculative: object = None
    # the KV tier under the prefix cache (docs/prefix_caching.md): GiB of host memory for blocks the pool drops
    # (vLLM's kv_offloading_size), and a directory of block files that outlives restarts, at most kv_cache_dir_size GiB
    kv_offloading_size: float | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_size: float = 16.0
    # disaggregated prefill/decode (vLLM's kv_transfer_config, docs/disaggregated.md): a KVTransferConfig or its
    # fields as a dict / JSON text, e.g. {"kv_connector": "PagedHFConnector", "kv_role": "kv_producer"}; it
    # needs the KV tier's directory (a fresh temporary one unless kv_cache_dir names one)
    kv_transfer_config: object = None
    # a pipeline stage's engine (paged_hf.LLM(pipeline_parallel_size=N), docs/scaling.md): micro-batches in flight at
    # once; None: one per stage (vLLM's), 1: one batch goes through all stages before the next starts
    pipeline_batches_in_flight: int | None = None
    # who is served first (paged_hf.core.request_queue): "fcfs" (arrival order), "priority" (a request's
    # priority, lower first; it may preempt lower-ranked running requests) or "fair" (tenants share the step
    # budget by virtual token counters, weighted by tenant_weights {tenant: weight}, default 1)
    scheduling_policy: str = "fcfs"
    tenant_weights: dict = field(default_factory=dict)
    # while requests decode, a step carries only the prefill that keeps it within this many seconds (timed steps'
    # fitted cost; paged_hf.core.stream_pace), so a big prompt does not stall the running streams; None: the
    # whole budget (vLLM's behaviour, the most throughput)
    max_stream_gap_s: float | None = None
    # "int8" | "w4a16" | "w4a16_gptq": `paged_hf.wrap` quantizes the model's float linears in place before serving
    # it (int8: W8A8, per output channel, per-token int8 activations; w4a16: 4-bit groups of 64 with zero points,
    # round to nearest; w4a16_gptq: the same layout by GPTQ on text the model writes itself, slower to load);
    # lm_head and embeddings untouched. None: as loaded (a quantized checkpoint is served quantized either way).
    # docs/quantization.md
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs is None and isinstance(self.max_num_batched_tokens, int):
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.num_blocks is not None and not (isinstance(self.num_blocks, int) and self.num_blocks >= 1):
            raise ValueError(f"num_blocks must be an int >= 1 or None, got {self.num_blocks!r}")
        if self.kv_cache_memory is not None and not (isinstance(self.kv_cache_memory, (int, float)) and self.kv_cache_memory > 0):
            raise ValueError(f"kv_cache_memory must be bytes or a fraction in (0, 1], got {self.kv_cache_memory!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_loras", "max_lora_rank", "max_stop_strings",
                     "max_stop_string_chars", "max_grammar_bytes", "max_grammar_depth", "grammar_cache_bytes",
                     "max_bad_words"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        depth = self.pipeline_batches_in_flight
        if depth is not None and not (isinstance(depth, int) and depth >= 1):
            raise ValueError(f"pipeline_batches_in_flight must be an int >= 1 or None, got {depth!r}")
        if self.max_cpu_loras is not None and not (isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= 1):
            raise ValueError(f"max_cpu_loras must be an int >= 1 or None, got {self.max_cpu_loras!r}")
        timeout = self.grammar_compile_timeout_s
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"grammar_compile_timeout_s must be a number of seconds > 0, got {timeout!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_num_seqs="
                             f"{self.max_num_seqs}: every running request needs one token of each step's budget")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len >= 1):
            raise ValueError(f"max_model_len must be an int >= 1 or None, got {self.max_model_len!r}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPE_NAMES))} (or 'fp8'), "
                             f"got {self.kv_cache_dtype!r}")
        self.speculative = SpeculativeConfig.parse(self.speculative)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        for name in ("kv_offloading_size", "kv_cache_dir_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0)):
                raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}")
        if self.kv_cache_dir is not None and not (isinstance(self.kv_cache_dir, str) and self.kv_cache_dir):
            raise ValueError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"scheduling_policy must be 'fcfs', 'priority' or 'fair', got {self.scheduling_policy!r}")
        weights = self.tenant_weights
        if not isinstance(weights, dict) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights.values()):
            raise ValueError(f"tenant_weights must be a dict {{tenant: weight > 0}}, got {self.tenant_weights!r}")
        gap = self.max_stream_gap_s
        if gap is not None and (isinstance(gap, bool) or not (isinstance(gap, (int, float)) and gap > 0)):
            raise ValueError(f"max_stream_gap_s must be a number of seconds > 0 or None, got {gap!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_NAMES)}, "
                             f"got {self.quantization!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "flashinfer"):
            raise ValueError(f"attention_backend must be 'auto', 'torch', 'cpu' or 'flashinfer', got {self.attention_backend!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "PagedConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown PagedConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
