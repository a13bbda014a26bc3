"""`paged-hf bench --serve --disaggregated`: one prefill and one decode instance against two ordinary replicas,
each instance pinned to a core of its own, both behind `paged-hf proxy`, on a prefill-heavy mix.

The mix, both kinds arriving steadily (Poisson) over the same span: `--long-prompts` prompts of
`--long-input-len` tokens (16 new tokens each) at `--request-rate` a second (default one every 5 s), and
`--streams` short prompts (64 tokens) streaming `--output-len` tokens each, spread over the span the long ones
take. In a replica a long prompt's prefill shares steps with the streams' decodes, so their gaps between tokens
stretch; split, the decode instance only decodes and loads the prompts' blocks (the two share one
--kv-cache-dir: same host, no copy). Reported: the streams' gaps between tokens (p50, p99) and every request's
output tokens per second of wall time.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from paged_hf.config.flags import engine_flags
from paged_hf.bench.loadgen import run_load, summarize
from paged_hf.bench.serve import (SERVED_NAME, free_port, log, random_prompts, served_model,
                                  start_server, stop_server)

SHORT_INPUT_LEN = 64
LONG_OUTPUT_LEN = 16
DEFAULT_LONG_RATE = 0.2  # long prompts per second when --request-rate is not given
TRANSFER = '{"kv_connector": "PagedHFConnector", "kv_role": "%s"}'


def pinned(argv: list[str], core: int | None) -> list[str]:
    """`argv` on one core (taskset), when the machine has that core and taskset."""
    if core is None or shutil.which("taskset") is None or core >= (os.cpu_count() or 1):
        return argv
    return ["taskset", "-c", str(core), *argv]


def instance_argv(args, model_path: str, role: str | None, workdir: Path) -> list[str]:
    argv = [sys.executable, "-m", "paged_hf", "serve", "--model", model_path, "--served-model-name", SERVED_NAME,
            "--dtype", args.dtype, "--device", args.device, "--log-level", "warning", *engine_flags(args.engine_config)]
    if role is None:
        return argv
    return argv + ["--kv-transfer-config", TRANSFER % role, "--kv-cache-dir", str(workdir / "kv_blocks")]


def start(argv: list[str], name: str, args, workdir: Path, core: int | None = None):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = start_server(pinned([*argv, "--port", str(port)], core), port, env, args.server_timeout,
                           workdir / f"{name}.log")
    return process, f"http://127.0.0.1:{port}"


def run_system(name: str, args, model_path: str, workdir: Path, streams, longs) -> dict:
    """Two instances (prefill + decode, or two replicas) and the proxy; the mix through the proxy."""
    split = name == "1 prefill + 1 decode"
    roles = ("kv_producer", "kv_consumer") if split else (None, None)
    processes = []
    try:
        urls = []
        for core, role in enumerate(roles):
            process, url = start(instance_argv(args, model_path, role, workdir), f"{name[:1]}-{core}", args, workdir,
                                 core)
            processes.append(process)
            urls.append(url)
        flags = ["--prefill", urls[0], "--decode", urls[1]] if split else ["--decode", urls[0], "--decode", urls[1]]
        proxy, proxy_url = start([sys.executable, "-m", "paged_hf", "proxy", *flags, "--prefill-threshold-tokens",
                                  str(SHORT_INPUT_LEN * 2)], f"{name[:1]}-proxy", args, workdir)
        processes.append(proxy)
        log(f"{name}: serving; {len(streams)} streams, {len(longs)} long prompts")
        asyncio.run(run_load(proxy_url, SERVED_NAME, streams[:1], 2, 1))  # warm-up, untimed
        return {"system": name, **measure(proxy_url, args, streams, longs)}
    except RuntimeError as exc:
        log(f"{name}: {exc}")
        return {"system": name, "error": str(exc)}
    finally:
        for process in processes:
            stop_server(process)


def measure(url: str, args, streams, longs) -> dict:
    rate = args.request_rate if args.request_rate != float("inf") else DEFAULT_LONG_RATE
    stream_rate = len(streams) * rate / max(1, len(longs))  # the streams spread over the long prompts' span

    async def both():
        return await asyncio.gather(
            run_load(url, SERVED_NAME, streams, args.output_len, len(streams), stream_rate, args.seed),
            run_load(url, SERVED_NAME, longs, LONG_OUTPUT_LEN, len(longs), rate, args.seed + 1))

    start = time.perf_counter()
    (stream_records, stream_wall), (long_records, long_wall) = asyncio.run(both())
    wall = time.perf_counter() - start
    total = summarize(stream_records + long_records, wall)
    return {"streams": summarize(stream_records, stream_wall), "long": summarize(long_records, long_wall),
            "output_tok_s": total["output_tok_s"], "num_ok": total["num_ok"], "num_requests": total["num_requests"],
            "wall_s": wall}


def run_disaggregated_bench(args) -> int:
    """Both systems on the same mix, one after the other; prints the table (and writes JSON to --out)."""
    _, model_path, tokenizer = served_model(args)
    streams = random_prompts(tokenizer, args.streams, SHORT_INPUT_LEN, args.seed)
    longs = random_prompts(tokenizer, args.long_prompts, args.long_input_len, args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_disagg_") as tmp:
        workdir = Path(args.out or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = [run_system(name, args, model_path, workdir, streams, longs)
                   for name in ("1 prefill + 1 decode", "2 replicas")]
        report = {"settings": {"model": model_path, "dtype": args.dtype, "streams": args.streams,
                               "stream_output_len": args.output_len, "long_prompts": args.long_prompts,
                               "long_input_len": args.long_input_len, "cores": os.cpu_count()},
                  "systems": results}
        print(format_disaggregated_table(report), flush=True)
        if args.out:
            (workdir / "disaggregated_bench.json").write_text(json.dumps(report, indent=2))
    return 1 if any(r.get("error") for r in results) else 0


def format_disaggregated_table(report: dict) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = ["| system | ok | output tok/s | streams' gap p50/p99 ms | long TTFT p50/p99 ms |", "|---|---|---|---|---|"]
    rows = {r["system"]: r for r in report["systems"]}
    for r in report["systems"]:
        if r.get("error"):
            lines.append(f"| {r['system']} | error: {r['error'][:80]} | | | |")
            continue
        gaps, ttft = r["streams"]["itl_s"], r["long"]["ttft_s"]
        lines.append(f"| {r['system']} | {r['num_ok']}/{r['num_requests']} | {r['output_tok_s']:.1f} | "
                     f"{ms(gaps['p50'])}/{ms(gaps['p99'])} | {ms(ttft['p50'])}/{ms(ttft['p99'])} |")
    split, replicas = rows.get("1 prefill + 1 decode", {}), rows.get("2 replicas", {})
    if split.get("streams") and replicas.get("streams") and split["streams"]["itl_s"]["p99"]:
        lines.append(f"streams' gap p99: {replicas['streams']['itl_s']['p99'] / split['streams']['itl_s']['p99']:.2f}x "
                     f"lower split; output tok/s {split['output_tok_s'] / replicas['output_tok_s']:.2f} of the replicas'")
    return "\n".join(lines)
