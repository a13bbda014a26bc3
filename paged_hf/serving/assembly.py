"""`paged-hf serve`'s server assembled from its resolved flags: the engine, the OpenAI app around it and uvicorn's
server. One assembly for every way of serving: one process (entrypoints/cli.py), tensor-parallel ranks
(tensor_parallel.py) and Ray Serve replicas (ray/), so that each serves exactly what `paged-hf serve` does.

The flags themselves are the command line's (paged_hf.entrypoints.cli); the engine's PagedConfig keyword arguments
come parsed in `args.engine_config` (set by the command, as `paged-hf bench` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

import paged_hf
from paged_hf.multimodal.registry import served_processor
from paged_hf.loader import default_model
from paged_hf.utils import describe_host

#: The environment variable that holds the server's API key when --api-key is not given.
API_KEY_ENV_VAR = "PAGED_HF_API_KEY"


def load_engine(args: argparse.Namespace, **load_kwargs) -> tuple:
    """(model, tokenizer, generator) as the serve flags ask; `load_kwargs` go to `load_model` (tp_plan). A vision
    folder's `tokenizer` is its processor (create_app serves its images)."""
    try:  # optional dependencies (fastapi, uvicorn: the 'serve' extra), checked before the model loads
        from paged_hf.serving import openai  # noqa: F401, PLC0415
    except ImportError as exc:
        raise ValueError(f"serving needs the 'serve' extra (pip install 'paged-hf[serve]'): {exc}") from None
    config = dict(args.engine_config)
    model, tokenizer = default_model.load_model(args.model, getattr(torch, args.dtype), args.device, **load_kwargs)
    # a vision folder's processor for its tokenizer: its images are served
    tokenizer, text_only = served_processor(model, default_model.with_processor(args.model, tokenizer))
    if text_only is not None:
        print(f"paged-hf serve: only the text of {args.model} is served: {text_only}", file=sys.stderr)
    generator = paged_hf.wrap(model, tokenizer, **config).generator
    check_adapters_loaded(generator, config.get("adapters", {}))
    return model, tokenizer, generator


def build_app(args: argparse.Namespace, model, tokenizer, generator, engine_threads: int | None = None):
    """The OpenAI app around `generator`, as the serve flags ask; `engine_threads`: torch's threads for the
    engine thread."""
    from paged_hf.serving.openai import create_app  # noqa: PLC0415 - optional dependency: fastapi

    settings = replace(serve_settings(args, model), engine_threads=engine_threads)
    names = args.served_model_name or [default_served_name(args.model or default_model.DEFAULT_MODEL)]
    app = create_app(generator, tokenizer, names, settings)
    print(f"paged-hf serve: {names[0]} on http://{args.host}:{args.port}/v1 ({generator.stats()['num_blocks']} KV "
          f"blocks, max_model_len {app.state.ctx.max_model_len})", file=sys.stderr)
    print(f"paged-hf serve: dtype {dtype_name(model)} ({getattr(args, 'dtype_reason', None) or 'as loaded'}) on "
          f"{describe_host()}", file=sys.stderr)
    return app


def dtype_name(model) -> str:
    """The dtype the model's weights are in ("bfloat16"), as the banner prints it."""
    dtype = getattr(model, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "unknown"


def make_server(args: argparse.Namespace, app):
    """uvicorn's server for `app`, draining on SIGTERM."""
    import uvicorn  # noqa: PLC0415 - optional dependency

    from paged_hf.serving.openai.lifecycle import DrainingServer  # noqa: PLC0415 - optional dependency: uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    return DrainingServer(config, app.state.ctx.engine, args.shutdown_grace)


def default_served_name(model: str) -> str:
    """A local folder is served under its own name: /v1/models and error messages never show the server's
    file system. A hub id is served as it is."""
    if os.path.exists(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model)))
    return model


def serve_settings(args: argparse.Namespace, model):
    """ServerSettings from the flags: the API key also from $PAGED_HF_API_KEY, sampling defaults from the
    checkpoint's generation_config.json unless --generation-config vllm."""
    from paged_hf.serving.openai import ServerSettings  # noqa: PLC0415 - optional dependency: fastapi
    from paged_hf.serving.openai.api_keys import read_api_key_file  # noqa: PLC0415 - as above
    from paged_hf.serving.openai.sampling_defaults import generation_config_defaults  # noqa: PLC0415 - as above

    defaults = generation_config_defaults(model) if args.generation_config == "auto" else {}
    return ServerSettings(api_key=args.api_key or os.environ.get(API_KEY_ENV_VAR) or None,
                          api_keys=read_api_key_file(getattr(args, "api_key_file", None)),
                          prefix_cache_isolation=args.prefix_cache_isolation, metrics_keys=tuple(args.metrics_key),
                          max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                          max_request_items=args.max_request_items, max_embedding_inputs=args.max_embedding_inputs,
                          max_detokenize_tokens=args.max_detokenize_tokens, max_n=args.max_n,
                          max_tokens_cap=args.max_tokens_cap or None, max_queue=args.max_queue,
                          chat_template=read_chat_template(args.chat_template), sampling_defaults=defaults,
                          cors_origins=tuple(_origins(args.allowed_origins)), tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template,
                          escape_special_tokens=args.escape_special_tokens_in_content,
                          chat_template_timeout_s=args.chat_template_timeout,
                          max_rendered_chat_chars=args.max_rendered_chat_chars,
                          max_logprob_entries=args.max_logprob_entries,
                          responses_store_max_count=args.responses_store_max_count,
                          responses_store_max_bytes=args.responses_store_max_bytes,
                          responses_store_dir=args.responses_store_dir, media_limits=media_limits(args))


def media_limits(args: argparse.Namespace):
    """The image flags (cli.add_media_args) as MediaLimits; --limit-mm-per-prompt in vLLM's JSON form."""
    from paged_hf.serving.openai.media import MediaLimits  # noqa: PLC0415 - optional dependency: fastapi

    limits = MediaLimits()
    value = getattr(args, "limit_mm_per_prompt", None)
    if value is not None:
        try:
            counts = json.loads(value)
        except ValueError:
            counts = None
        if not isinstance(counts, dict) or set(counts) - {"image"} or not isinstance(counts.get("image", 0), int):
            raise ValueError(f"--limit-mm-per-prompt {value!r}: give a JSON object like '{{\"image\": 4}}' (only "
                             "images are served)")
        limits = MediaLimits(max_images=counts.get("image", limits.max_images))
    return MediaLimits(tuple(getattr(args, "allowed_media_domains", None) or ()),
                       getattr(args, "allowed_local_media_path", None), limits.max_images,
                       getattr(args, "max_image_bytes", limits.max_bytes),
                       getattr(args, "max_image_pixels", limits.max_pixels),
                       getattr(args, "media_fetch_timeout", limits.fetch_timeout_s))


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM)."""
    if value is None or not os.path.isfile(value):
        if value is not None and not any(mark in value for mark in ("{{", "{%")):
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        return value
    with open(value) as fh:
        return fh.read()


def _origins(values: list[str]) -> list[str]:
    """--allowed-origins a b, or vLLM's JSON list '["a", "b"]'."""
    origins = []
    for value in values:
        origins += json.loads(value) if value.lstrip().startswith("[") else [value]
    return origins


def check_adapters_loaded(generator, adapters: dict) -> None:
    """--adapter must end up served: an engine that did not load a name (no LoRA support, or a changed
    engine) fails at startup, not at the first request for that adapter."""
    if not adapters:
        return
    served = set(generator.adapter_names())
    missing = sorted(set(adapters) - served)
    if missing:
        raise ValueError(f"--adapter {', '.join(missing)}: the engine did not load it (served adapters: "
                         f"{sorted(served)}); serve without that --adapter or fix its folder")
