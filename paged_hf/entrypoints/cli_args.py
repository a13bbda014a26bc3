"""The command-line flags every `paged-hf` command shares: which model (`--model/--device/--dtype`) and how the
engine is configured (every `PagedConfig` field that declares a flag: config/flags.py makes them)."""

from __future__ import annotations

import argparse

from paged_hf.config.flags import add_engine_args, engine_config
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


__all__ = ["add_engine_args", "add_model_args", "engine_config", "resolve_model_args"]
