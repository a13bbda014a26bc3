"""Multi-tenant serving: one `paged-hf serve` process, many tenants, each with its own model name (LoRA adapter).

Starts the server (a subprocess, as in a deployment), asks it which models it serves, gives each tenant one of
them and drives them all at once with the official `openai` client from many threads; prints each tenant's
latency. Each tenant's adapter is a model name in the request (`model="tenant-a"`); the engine batches all
tenants together, each token through its own adapter. Without --adapter (no adapters served) every tenant uses
the base model (the script says so), which still shows continuous batching across tenants.

    python examples/multi_tenant_server.py [--model PATH] [--adapter NAME=PATH ...] [--tenants 4]
        [--requests-per-tenant 6] [--threads 12] [--max-tokens 24] [--base-url URL --api-key KEY]
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "Why is the sky blue? Answer in one sentence.", "Give one tip for learning to code.",
             "What is photosynthesis? Keep it short.", "Suggest a name for a pet turtle."]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(extra_args: list[str], api_key: str, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`paged-hf serve` on a free local port; returns (process, base URL) once /health answers."""
    port = free_port()
    # tenants share the server: a message's "<|im_start|>system" must stay text, never a forged system turn
    command = [sys.executable, "-m", "paged_hf", "serve", "--port", str(port), "--api-key", api_key,
               "--escape-special-tokens-in-content", "--log-level", "warning", *extra_args]
    process = subprocess.Popen(command, env={**os.environ, "TQDM_DISABLE": "1"})
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode} (see its message above)")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit(f"the server did not answer /health within {timeout:.0f} s")


def stop_server(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def assign_models(client: openai.OpenAI, num_tenants: int) -> dict[str, str]:
    """Tenant -> served model name: adapters round-robin, or the base model for all when none is served."""
    served = [m.id for m in client.models.list().data]
    base, adapters = served[0], served[1:]
    if not adapters:
        print(f"No LoRA adapters are served (give --adapter NAME=PATH): all {num_tenants} tenants "
              f"use the base model {base!r}.")
        return {f"tenant-{i}": base for i in range(num_tenants)}
    return {f"tenant-{i}": adapters[i % len(adapters)] for i in range(num_tenants)}


def run_tenants(client: openai.OpenAI, models: dict[str, str], per_tenant: int, threads: int,
                max_tokens: int) -> dict[str, list[float]]:
    """Every tenant's requests interleaved over one thread pool; seconds per request, per tenant."""
    jobs = [(tenant, i) for i in range(per_tenant) for tenant in models]

    def one(job: tuple[str, int]) -> tuple[str, float]:
        tenant, i = job
        start = time.perf_counter()
        client.chat.completions.create(model=models[tenant], max_tokens=max_tokens, temperature=0.7, seed=i,
                                       messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        return tenant, time.perf_counter() - start

    latencies: dict[str, list[float]] = {tenant: [] for tenant in models}
    with ThreadPoolExecutor(threads) as pool:
        for tenant, seconds in pool.map(one, jobs):
            latencies[tenant].append(seconds)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="LoRA adapter per tenant")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--requests-per-tenant", type=int, default=6)
    parser.add_argument("--threads", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--api-key", default=None, help="the running server's key (with --base-url)")
    args = parser.parse_args()

    process, api_key = None, args.api_key or secrets.token_hex(16)
    base_url = args.base_url
    if base_url is None:
        extra = (["--model", args.model] if args.model else []) + [f"--adapter={a}" for a in args.adapter]
        process, base_url = start_server(extra, api_key)
    try:
        client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                               timeout=600)
        models = assign_models(client, args.tenants)
        start = time.perf_counter()
        latencies = run_tenants(client, models, args.requests_per_tenant, args.threads, args.max_tokens)
        wall = time.perf_counter() - start
    finally:
        stop_server(process)
    print(f"{'tenant':<10} {'model':<28} {'requests':>8} {'mean s':>8} {'p50 s':>8} {'max s':>8}")
    for tenant, seconds in latencies.items():
        print(f"{tenant:<10} {models[tenant][:28]:<28} {len(seconds):>8} {statistics.mean(seconds):>8.2f} "
              f"{statistics.median(seconds):>8.2f} {max(seconds):>8.2f}")
    total = sum(len(s) for s in latencies.values())
    print(f"{total} requests from {len(latencies)} tenants in {wall:.1f} s ({total / wall:.2f} req/s)")


if __name__ == "__main__":
    main()
