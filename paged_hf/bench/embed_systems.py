"""The systems of `paged-hf bench --workload embed`, each on the same texts and the same sentence-transformers
model folder, in a process of its own (peak RSS is per process, and no system warms another's caches):

- `sentence_transformers`: `SentenceTransformer(folder).encode(texts)` at its default batch size (32);
- `paged_hf_embed`: `paged_hf.LLM(folder).embed(texts)`, one call for all of them;
- `paged_hf_embed_serve`: a real `paged-hf serve` process; this process is its clients, which POST the texts
  to `/v1/embeddings` in requests of `texts_per_request`, `concurrency` requests in flight, `encoding_format`
  base64 (what the `openai` SDK asks for by default).

The two offline systems run in `python -m paged_hf.bench.embed_systems SPEC`; each warms up on one short text
first, as the serving system does with one untimed request. Every system then embeds all texts `repeats` times
and reports its best time (each run's time in `walls_s`): on a machine shared with other jobs one run may lose
half its CPU time to them, and the best of a few is the figure that says most about the system itself. Every
system returns its vectors (of its first timed run), in text order.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from paged_hf.config.flags import engine_flags
from paged_hf.bench.serve import start_server, stop_server
from paged_hf.bench.machine import peak_rss_bytes
from paged_hf.bench.systems import stderr_fd

#: the systems, in the order they run
EMBED_SYSTEMS = ("paged_hf_embed_serve", "paged_hf_embed", "sentence_transformers")
SERVED_NAME = "bench-embed"
WARMUP_TEXT = "Warm up."


def timed_runs(run, repeats: int) -> dict:
    """`run()` -> vectors, `repeats` times -> {"wall_s": the best time, "walls_s": each, "vectors": the first's}."""
    walls, first = [], None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        vectors = run()
        walls.append(time.perf_counter() - start)
        first = vectors if first is None else first
    return {"wall_s": min(walls), "walls_s": walls, "vectors": first}


def run_sentence_transformers(folder: str, texts: list[str], device: str, dtype: str, repeats: int = 1) -> dict:
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415 - the bench/test extras have it

    model = SentenceTransformer(folder, device=device, model_kwargs={"dtype": getattr(torch, dtype)})
    model.encode([WARMUP_TEXT])
    # its default batch_size (32), as a user calls it
    result = timed_runs(lambda: model.encode(texts).astype("float32").tolist(), repeats)
    return dict(result, extra={"batch_size": 32})


def run_paged_hf_embed(folder: str, texts: list[str], device: str, dtype: str, engine_config: dict,
                       repeats: int = 1) -> dict:
    import paged_hf  # noqa: PLC0415

    llm = paged_hf.LLM(folder, dtype=dtype, device=device, **engine_config)
    llm.embed([WARMUP_TEXT], use_tqdm=False)
    result = timed_runs(lambda: [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], repeats)
    return dict(result, extra={"engine_config": engine_config, "stats": _stats(llm.generator.stats())})


def _stats(stats: dict) -> dict:
    return {key: stats[key] for key in ("num_blocks", "max_num_running", "num_preemptions") if key in stats}


def worker_main(spec_path: str) -> int:
    """Run the spec's system (sentence_transformers or paged_hf_embed) and write its result as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    system = spec["system"]
    try:
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        if system == "sentence_transformers":
            result = run_sentence_transformers(spec["folder"], spec["texts"], spec["device"], spec["dtype"],
                                               spec["repeats"])
        elif system == "paged_hf_embed":
            result = run_paged_hf_embed(spec["folder"], spec["texts"], spec["device"], spec["dtype"],
                                        spec["engine_config"], spec["repeats"])
        else:
            raise ValueError(f"{system!r} does not run in a worker")
        result["num_threads"] = torch.get_num_threads()
    except Exception as exc:  # reported as that system's error; the other systems still run
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result.update(system=system, peak_rss_bytes=peak_rss_bytes())
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


def run_in_worker(system: str, spec: dict, timeout_s: float | None) -> dict:
    """One offline system in a fresh `python -m paged_hf.bench.embed_systems` process -> its result."""
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_embed_") as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(dict(spec, system=system, result_path=str(result_path))))
        command = [sys.executable, "-m", "paged_hf.bench.embed_systems", str(spec_path)]
        try:
            proc = subprocess.run(command, stdout=stderr_fd(), timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"system": system, "error": f"timed out after {timeout_s} s"}
        if not result_path.exists():
            return {"system": system, "error": f"worker exited with code {proc.returncode} and no result"}
        return json.loads(result_path.read_text())


# --- paged-hf serve and its clients ---------------------------------------------------------------------------

def decode_base64(data: str) -> list[float]:
    """An embedding as the server sends it with encoding_format=base64: little-endian float32 bytes."""
    import numpy as np  # noqa: PLC0415 - torch's dependency

    return np.frombuffer(base64.b64decode(data), dtype="<f4").tolist()


async def post_batches(url: str, batches: list[list[str]], concurrency: int, timeout_s: float) -> list[list]:
    """POST every batch to `url` (at most `concurrency` in flight) -> each batch's vectors, in order.
    RuntimeError on any answer but 200."""
    import aiohttp  # noqa: PLC0415 - the bench/test extras have it

    semaphore = asyncio.Semaphore(concurrency)

    async def one(session, batch: list[str]) -> list:
        async with semaphore, session.post(url, json={"model": SERVED_NAME, "input": batch,
                                                      "encoding_format": "base64"}) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            data = sorted((await response.json())["data"], key=lambda item: item["index"])
            return [decode_base64(item["embedding"]) for item in data]

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await asyncio.gather(*(one(session, batch) for batch in batches))


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_peak_rss(pid: int) -> int | None:
    """The server process's peak RSS (Linux: VmHWM of /proc/PID/status), read before it is stopped."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_paged_hf_embed_serve(folder: str, texts: list[str], spec: dict, concurrency: int, texts_per_request: int,
                             server_timeout: float, timeout_s: float | None) -> dict:
    """`paged-hf serve --model FOLDER` in a fresh process, its clients here. After one untimed warm-up request,
    each timed run opens a client session, sends every batch and reads (and decodes) the last answer."""
    port = _unused_port()
    argv = [sys.executable, "-m", "paged_hf", "serve", "--model", folder, "--served-model-name", SERVED_NAME,
            "--dtype", spec["dtype"], "--device", spec["device"], "--log-level", "warning",
            *engine_flags(spec["engine_config"]), "--port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"])) if spec.get("threads") else None
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    batches = [texts[i:i + texts_per_request] for i in range(0, len(texts), texts_per_request)]
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_embed_serve_") as tmp:
        log_path = Path(tmp, "server.log")
        try:
            process = start_server(argv, port, env, server_timeout, log_path)
        except RuntimeError as exc:
            return {"system": "paged_hf_embed_serve", "error": f"{exc}: {log_path.read_text()[-1500:]}"}
        try:
            asyncio.run(post_batches(url, [[WARMUP_TEXT]], 1, server_timeout))
            result = timed_runs(lambda: [vector for answer in asyncio.run(post_batches(
                url, batches, concurrency, timeout_s or 3600)) for vector in answer], spec["repeats"])
            peak = server_peak_rss(process.pid)
        except Exception as exc:  # noqa: BLE001 - a failed run is a result, not a crash of the benchmark
            return {"system": "paged_hf_embed_serve", "error": f"{type(exc).__name__}: {exc}"}
        finally:
            stop_server(process)
    return {"system": "paged_hf_embed_serve", **result, "peak_rss_bytes": peak, "num_threads": spec.get("threads"),
            "extra": {"num_requests": len(batches), "texts_per_request": texts_per_request,
                      "concurrency": concurrency, "encoding_format": "base64",
                      "engine_config": spec["engine_config"]}}


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
