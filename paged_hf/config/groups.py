"""The engine's fields in groups, each declared once (config/options.py): the KV cache, the scheduler, LoRA adapters,
bounds on one request, and the CPU fast paths. `PagedConfig` (config/engine.py) holds one of each, with the nested
speculative and KV-transfer configs."""

from __future__ import annotations

from dataclasses import dataclass

from paged_hf.config.options import Flag, OptionGroup, boolean, integer, name_equals, number, one_of, option, text
from paged_hf.kernels.quant import KV_CACHE_DTYPE_NAMES

DEFAULT_MAX_NUM_SEQS = 64
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")


def _kv_cache_memory(name: str, value):
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be bytes or a fraction in (0, 1], got {value!r}")
    return value


def _tenant_weights(name: str, value):
    if not isinstance(value, dict) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in value.values()):
        raise ValueError(f"{name} must be a dict {{tenant: weight > 0}}, got {value!r}")
    return value


def _tenant_weight_flags(items: list[str]) -> dict:
    weights = name_equals(items, "--tenant-weight", float)
    if not all(weight > 0 for weight in weights.values()):
        raise ValueError(f"--tenant-weight expects TENANT=WEIGHT with a weight > 0, got {items!r}")
    return weights


def _adapters(name: str, value):
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict {{name: peft folder}}, got {value!r}")
    return value


@dataclass
class CacheConfig(OptionGroup):
    """The paged KV cache: its blocks, their dtype, the prefix cache and the KV tier under it; the images' encoder
    outputs."""
    block_size: int = option(16, "tokens per KV block", integer(), (Flag(("--block-size",), int),))
    num_blocks: int | None = option(None, "KV cache blocks (default: sized from kv_cache_memory)",
                                    integer(optional=True), (Flag(("--num-blocks",), int),))
    # None: half the free GPU memory, or on CPU 4 GiB capped at a quarter of the available RAM (vLLM's CPU default)
    kv_cache_memory: float | int | None = option(
        None, "KV cache bytes, or a fraction of free memory (<= 1)", _kv_cache_memory,
        (Flag(("--kv-cache-memory",), float, parse=lambda memory: memory if memory <= 1 else int(memory)),))
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's)",
                                       integer(optional=True), (Flag(("--max-model-len",), int),))
    enable_prefix_caching: bool = option(True, "automatic prefix caching", boolean, (
        Flag(("--no-prefix-caching", "--no-enable-prefix-caching"), action="store_true", given=False,
             dest="no_prefix_caching"),
        Flag(("--enable-prefix-caching",), action="store_true", given=True, dest="enable_prefix_caching")))
    attention_backend: str = option("auto", "attention kernel: auto (the device's own where it serves every layer), "
                                    "torch, cpu or flashinfer", one_of(*ATTENTION_BACKENDS))
    # a quantized cache with one scale per (block, KV head) holds 2x the tokens of a bf16 cache in the same memory
    kv_cache_dtype: str = option(
        "auto", "KV cache storage: auto (the model's dtype) or int8/fp8 with per-block scales (2x the tokens of bf16 "
        "in the same memory)", one_of(*KV_CACHE_DTYPE_NAMES, aliases={"fp8": "fp8_e4m3"}),
        (Flag(("--kv-cache-dtype",), choices=(*KV_CACHE_DTYPE_NAMES, "fp8")),))
    kv_offloading_size: float | None = option(
        None, "GiB of host memory for KV blocks the prefix cache drops (found again as prefix hits)",
        number(optional=True, unit="a number of GiB"), (Flag(("--kv-offloading-size",), float, metavar="GIB"),))
    kv_cache_dir: str | None = option(
        None, "directory of KV block files under the prefix cache; a restart with it finds them again",
        text(), (Flag(("--kv-cache-dir",), metavar="PATH"),))
    kv_cache_dir_size: float = option(16.0, "most GiB --kv-cache-dir holds", number(unit="a number of GiB"),
                                      (Flag(("--kv-cache-dir-size",), float, metavar="GIB"),))
    # vLLM's encoder cache, in bytes: the same image anywhere in any prompt runs no vision tower while it is kept
    encoder_cache_bytes: int = option(
        256 << 20, "bytes of images' vision-tower outputs kept by their content, least recently used dropped first "
        "(0: off)", integer(minimum=0), (Flag(("--encoder-cache-bytes",), int, metavar="BYTES"),))


@dataclass
class SchedulerConfig(OptionGroup):
    """Who runs in a step and how much of it: the token budget, the running set, the waiting queue's policy."""
    max_num_batched_tokens: int = option(512, "per-step token budget (chunked prefill size)", integer(),
                                         (Flag(("--max-num-batched-tokens",), int),))
    # None: 64, or max_num_batched_tokens when that is smaller (every running request needs a token of each step's
    # budget, or the tail of the running list would starve)
    max_num_seqs: int | None = option(None, "most requests running at once", integer(optional=True),
                                      (Flag(("--max-num-seqs",), int),))
    scheduling_policy: str = option(
        "fcfs", "fcfs (arrival order), priority (a request's priority, lower first, may preempt lower ones) or fair "
        "(tenants share the step budget: user field, else API key, else adapter)",
        one_of("fcfs", "priority", "fair"), (Flag(("--scheduling-policy",), choices=("fcfs", "priority", "fair")),))
    tenant_weights: dict = option(
        help="scheduling_policy fair: a tenant's share weight (default 1)", check=_tenant_weights, factory=dict,
        flags=(Flag(("--tenant-weight",), action="append", metavar="TENANT=WEIGHT",
                    parse=_tenant_weight_flags),))
    max_stream_gap_s: float | None = option(
        None, "while requests decode, a step carries only the prefill that keeps it within this many seconds, so a "
        "big prompt does not stall running streams (default: none, the whole budget)",
        number(strict=True, optional=True, unit="a number of seconds"),
        (Flag(("--max-stream-gap",), float, metavar="SECONDS"),))
    # a pipeline stage's engine (paged_hf.LLM(pipeline_parallel_size=N)): micro-batches in flight at once; None: one
    # per stage (vLLM's), 1: one batch goes through all stages before the next starts
    pipeline_batches_in_flight: int | None = option(None, "micro-batches in flight on a pipeline",
                                                    integer(optional=True))

    def check_together(self) -> None:
        if self.max_num_seqs is None:
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_num_seqs="
                             f"{self.max_num_seqs}: every running request needs one token of each step's budget")


@dataclass
class LoRAConfig(OptionGroup):
    """peft LoRA adapters: which are loaded, how many a step holds, and where more are found by name."""
    adapters: dict = option(help="peft LoRA adapter folders to load, {name: folder}", check=_adapters, factory=dict,
                            flags=(Flag(("--adapter",), action="append", metavar="NAME=PATH",
                                        parse=lambda items: name_equals(items, "--adapter")),
                                   Flag(("--lora-modules",), nargs="+", metavar="NAME=PATH", dest="lora_modules",
                                        parse=lambda items: name_equals(items, "--lora-modules"))))
    # on a CPU model a step holds max(max_loras, max_cpu_loras)
    max_loras: int = option(4, "LoRA adapters in device slots at once (on a CPU, where adapters are read in place "
                            "from host memory, a step holds up to --max-cpu-loras when that is larger)", integer(),
                            (Flag(("--max-loras",), int),))
    max_lora_rank: int = option(64, "largest LoRA rank", integer(), (Flag(("--max-lora-rank",), int),))
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept in host memory, least recently used dropped and read again from their folder on "
        "use (default: all)", integer(optional=True), (Flag(("--max-cpu-loras",), int),))
    lora_root: str | None = option(
        None, "serve every adapter folder under DIR by its name (model=NAME reads DIR/NAME on first use, no load "
        "call); the server also allows /v1/load_lora_adapter and /v1/unload_lora_adapter for folders under DIR only",
        text(), (Flag(("--lora-root",), metavar="DIR"),))


@dataclass
class RequestLimits(OptionGroup):
    """Bounds on what one request may ask, checked at submission (a ValueError naming the field)."""
    max_stop_strings: int = option(64, "most stop strings per request", integer(), (Flag(("--max-stop-strings",), int),))
    max_stop_string_chars: int = option(512, "longest stop string (characters)", integer(),
                                        (Flag(("--max-stop-string-chars",), int),))
    max_grammar_bytes: int = option(64 << 10, "largest structured-output spec (bytes)", integer(),
                                    (Flag(("--max-grammar-bytes",), int),))
    max_grammar_depth: int = option(64, "deepest JSON schema nesting", integer(), (Flag(("--max-grammar-depth",), int),))
    grammar_compile_timeout_s: float = option(
        10.0, "seconds a grammar may take to compile (it runs off the engine thread); longer is refused",
        number(strict=True, unit="a number of seconds"), (Flag(("--grammar-compile-timeout",), float),))
    grammar_cache_bytes: int = option(64 << 20, "compiled grammars kept (bytes)", integer(),
                                      (Flag(("--grammar-cache-bytes",), int),))
    max_bad_words: int = option(1024, "most bad_words per request (each tokenized twice at submission)", integer(),
                                (Flag(("--max-bad-words",), int),))
    max_logprobs: int = option(20, "most logprobs (and prompt_logprobs) a request may ask for, vLLM's; -1: no limit",
                               integer(minimum=-1), (Flag(("--max-logprobs",), int),))


@dataclass
class CpuPaths(OptionGroup):
    """The CPU fast paths a step swaps in (paged_hf/worker/fast_paths/)."""
    # 2.3x faster float32 matmuls than MKL's on AMD; costs the weights' memory once more, so the copies are made at
    # the first step of more sequences than the few-row loops compute (one chat never makes them)
    pack_linear_weights: bool = option(True, "run the model's float32/bfloat16 linears on oneDNN-packed copies of "
                                       "their weights in steps of more sequences than the few-row loops compute "
                                       "(made at the first such step)", boolean)
    fuse_layers: bool = option(True, "q/k/v and gate/up as one matmul each, RMSNorm and SiLU-and-multiply as single "
                               "compiled ops, in modules that run Llama's forward code", boolean)
