"""The command-line flags every `paged-hf` command shares: which model (`--model/--device/--dtype`) and how the
engine is configured (the `PagedConfig` fields a user tunes), parsed into `PagedConfig` keyword arguments."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from paged_hf.config.engine import QUANTIZATION_NAMES
from paged_hf.config.kv_transfer import KVTransferConfig
from paged_hf.config.speculative import SpeculativeConfig
from paged_hf.kernels.quant import KV_CACHE_DTYPE_NAMES
from paged_hf.loader.device_dtype import DTYPE_NAMES, resolve_device, resolve_model_dtype


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help="torch device of the model (auto: cuda when present)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                        help="auto (vLLM's rule): the checkpoint's dtype; on CPU a bf16/fp16 checkpoint only where the "
                        "CPU computes it natively (AVX512-BF16/AMX), else float32; the default model is float32")


def resolve_model_args(args: argparse.Namespace) -> None:
    """`paged-hf serve MODEL` as `vllm serve MODEL`; --device/--dtype auto become concrete names."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    args.device = resolve_device(args.device)
    choice = resolve_model_dtype(args.dtype, args.device, args.model)
    args.dtype, args.dtype_reason = choice.name, choice.reason  # the reason: for serve's start-up banner


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The PagedConfig fields a user tunes most; unset flags keep the engine's defaults."""
    group = parser.add_argument_group("engine (paged_hf.wrap) configuration")
    group.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (chunked prefill size)")
    group.add_argument("--max-num-seqs", type=int, help="most requests running at once")
    group.add_argument("--num-blocks", type=int, help="KV cache blocks (default: sized from memory)")
    group.add_argument("--block-size", type=int, help="tokens per KV block")
    group.add_argument("--kv-cache-memory", type=float, help="KV cache bytes, or a fraction of free memory (<= 1)")
    group.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    group.add_argument("--kv-cache-dtype", choices=(*KV_CACHE_DTYPE_NAMES, "fp8"),
                       help="KV cache storage: auto (the model's dtype) or int8/fp8 with per-block scales (2x the "
                       "tokens of bf16 in the same memory)")
    group.add_argument("--quantization", choices=QUANTIZATION_NAMES, default=None,
                       help="quantize the model's linears at load (int8: W8A8 per channel; w4a16: 4-bit groups of 64, "
                       "round to nearest; w4a16_gptq: the same by GPTQ on text the model writes, minutes to load); a "
                       "quantized checkpoint folder is served quantized without it")
    group.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                       help="disable automatic prefix caching")
    group.add_argument("--enable-prefix-caching", action="store_true", help="(vLLM's flag; on by default)")
    group.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                       help="GiB of host memory for KV blocks the prefix cache drops (found again as prefix hits)")
    group.add_argument("--kv-cache-dir", metavar="PATH",
                       help="directory of KV block files under the prefix cache; a restart with it finds them again")
    group.add_argument("--kv-cache-dir-size", type=float, metavar="GIB",
                       help="most GiB --kv-cache-dir holds (default: 16)")
    group.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                       help='disaggregated prefill/decode, vLLM\'s form: \'{"kv_connector": "PagedHFConnector", '
                            '"kv_role": "kv_producer"}\' (or kv_consumer, kv_both; docs/disaggregated.md)')
    group.add_argument("--max-stop-strings", type=int, help="most stop strings per request (default: 64)")
    group.add_argument("--max-stop-string-chars", type=int, help="longest stop string (default: 512 characters)")
    group.add_argument("--max-grammar-bytes", type=int, help="largest structured-output spec (default: 64 KiB)")
    group.add_argument("--max-grammar-depth", type=int, help="deepest JSON schema nesting (default: 64)")
    group.add_argument("--grammar-compile-timeout", type=float, dest="grammar_compile_timeout_s",
                       help="seconds a grammar may take to compile (default: 10); longer is a 400")
    group.add_argument("--grammar-cache-bytes", type=int, help="compiled grammars kept (default: 64 MiB)")
    group.add_argument("--max-bad-words", type=int, help="most bad_words per request (default: 1024)")
    group.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                       help="a peft LoRA adapter folder to load under NAME (repeatable)")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="vLLM's spelling of --adapter: NAME=PATH or JSON {\"name\": ..., \"path\": ...}")
    group.add_argument("--enable-lora", action="store_true", help="(vLLM's flag; adapters always work)")
    group.add_argument("--scheduling-policy", choices=("fcfs", "priority", "fair"), default=None,
                       help="fcfs (default: arrival order), priority (a request's priority, lower first, may preempt "
                       "lower ones) or fair (tenants share the step budget: user field, else API key, else adapter)")
    group.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=WEIGHT",
                       help="--scheduling-policy fair: a tenant's share weight (default 1; repeatable)")
    group.add_argument("--max-stream-gap", type=float, dest="max_stream_gap_s", metavar="SECONDS",
                       help="while requests decode, a step carries only the prefill that keeps it within SECONDS, "
                       "so a big prompt does not stall running streams (default: none, the whole budget)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": "PATH", '
                            '"num_speculative_tokens": 4}\' (bench: only the paged_hf_spec system speculates)')


def engine_config(args: argparse.Namespace) -> dict:
    """Only the flags that were given, as PagedConfig keyword arguments."""
    config = {}
    for name in ("max_num_batched_tokens", "max_num_seqs", "num_blocks", "block_size", "max_model_len",
                 "max_stop_strings", "max_stop_string_chars", "kv_cache_dtype", "max_grammar_bytes",
                 "max_grammar_depth", "grammar_compile_timeout_s", "grammar_cache_bytes", "max_bad_words",
                 "kv_offloading_size", "kv_cache_dir", "kv_cache_dir_size", "quantization", "max_stream_gap_s"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    if args.kv_cache_memory is not None:
        memory = args.kv_cache_memory
        config["kv_cache_memory"] = memory if memory <= 1 else int(memory)
    if args.no_prefix_caching:
        config["enable_prefix_caching"] = False
    if args.speculative_config is not None:
        config["speculative"] = asdict(SpeculativeConfig.parse(args.speculative_config))  # checked, JSON-able
    if getattr(args, "kv_transfer_config", None) is not None:
        config["kv_transfer_config"] = asdict(KVTransferConfig.parse(args.kv_transfer_config))
    if getattr(args, "scheduling_policy", None) is not None:
        config["scheduling_policy"] = args.scheduling_policy
    if getattr(args, "tenant_weight", None):
        config["tenant_weights"] = dict(_tenant_weight(item) for item in args.tenant_weight)
    adapters = list(args.adapter) + list(getattr(args, "lora_modules", []))
    if adapters:
        config["adapters"] = dict(_name_equals_path(item) for item in adapters)
    return config


def _tenant_weight(item: str) -> tuple[str, float]:
    name, sep, weight = item.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = 0.0
    if not sep or not name or not value > 0:
        raise ValueError(f"--tenant-weight expects TENANT=WEIGHT with a weight > 0, got {item!r}")
    return name, value


def _name_equals_path(item: str) -> tuple[str, str]:
    if item.lstrip().startswith("{"):  # vLLM's JSON form of --lora-modules
        try:
            spec = json.loads(item)
            return spec["name"], spec["path"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--lora-modules expects NAME=PATH or {{\"name\": ..., \"path\": ...}}, got {item!r}") from None
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter expects NAME=PATH, got {item!r}")
    return name, path
